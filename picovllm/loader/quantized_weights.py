"""A GGUF's quantized weights kept quantized on the CPU: each linear layer, the LM head and the embedding table
whose every part the file stores as Q4_0/Q4_1/Q8_0/Q4_K/Q6_K gets a QuantizedWeight (kernels/cpu/quant_gemm.py)
and a weight parameter on the meta device (no memory; anything that would still read it fails loudly).

Fused layers take their parts as segments: q, k and v (gate and up) of one form are packed as one; of different
forms (a Q4_K q beside a Q6_K v) they stay separate segments of the one layer. A layer with a part the file keeps
in float (F32/F16/BF16) is dequantized whole and runs the float32 path. The embedding looks its rows up in the
quantized table; with tied embeddings the LM head shares it.
"""
from __future__ import annotations

import torch
from torch import nn

from picovllm.kernels.cpu.quant_gemm import QuantizedSegment, QuantizedWeight, pack
from picovllm.loader.gguf_quants import DecodedBlocks, concatenate
from picovllm.loader.source import ModelSource
from picovllm.loader.weights import load_weights, parameter_of

PREFIX = "quant:"   # a segment's tensors in the engine-weights file: quant:<module>#<i>:<kind>:<n>.codes|.scales


def _shards(model: nn.Module, param: str) -> list:
    """The shard ids a fused parameter is loaded from, in its row order ([None] for an unfused one)."""
    ids = [sid for fused, sid in model.packed_modules.values() if param.endswith(f".{fused}.weight")]
    return ids or [None]


def _segments(parts: list[DecodedBlocks]) -> list[QuantizedSegment]:
    """Runs of parts of one form, each packed as one segment (a run is cut where a part's rows end mid-panel)."""
    runs: list[list[DecodedBlocks]] = []
    for p in parts:
        last = runs[-1] if runs else None
        if last and last[-1].kind == p.kind and last[-1].scale_dtype == p.scale_dtype \
                and sum(b.codes.shape[0] for b in last) % 16 == 0:
            last.append(p)
        else:
            runs.append([p])
    return [pack(concatenate(run) if len(run) > 1 else run[0]) for run in runs]


def _attach(model: nn.Module, param: str, qw: QuantizedWeight) -> None:
    """Give the module owning `param` its QuantizedWeight; its weight goes to the meta device."""
    module = model.get_submodule(param.rsplit(".", 1)[0])
    meta = nn.Parameter(torch.empty(tuple(module.weight.shape), device="meta"), requires_grad=False)
    if hasattr(module, "packed"):                      # a linear layer or the LM head
        module.packed = qw
    else:                                              # the embedding (and, tied, the LM head)
        module.quantized = qw
        if model.lm_head is not None and model.lm_head.weight is module.weight:
            model.lm_head.packed, model.lm_head.weight = qw, meta
    module.weight = meta


def load_quantized(model: nn.Module, source: ModelSource, isa: str) -> list[str]:
    """Fill `model` from source.stored_weights(): quantized where every part is, float32 elsewhere (not packed:
    the caller packs). Returns the parameter names that run quantized."""
    pending: dict[str, dict] = {}
    floats, quantized = [], []
    for ckpt_name, t in source.stored_weights():
        name, shard = parameter_of(model, ckpt_name)
        if ckpt_name == "lm_head.weight" and (getattr(model.cfg, "tie_word_embeddings", False)
                                              or model.lm_head is None):     # tied, or a pooling model's: none
            continue
        if isinstance(t, torch.Tensor) and name not in pending and _shards(model, name) == [None]:
            floats.append((ckpt_name, t))
            continue
        parts = pending.setdefault(name, {})
        parts[shard] = (ckpt_name, t)
        order = _shards(model, name)
        if set(parts) != set(order):
            continue
        del pending[name]
        got = [parts[s] for s in order]
        if all(isinstance(t, DecodedBlocks) for _, t in got):
            _attach(model, name, QuantizedWeight(_segments([t for _, t in got]), isa))
            quantized.append(name)
        else:   # a part in float: the whole layer runs float32
            floats += [(n, t if isinstance(t, torch.Tensor) else torch.from_numpy(t.dequantize()).float())
                       for n, t in got]
    floats += [item for parts in pending.values() for item in parts.values()]   # load_weights names what is missing
    load_weights(model, iter(floats), frozenset(quantized))
    return quantized


def quantized_modules(model: nn.Module) -> dict[str, QuantizedWeight]:
    """module name -> its QuantizedWeight (the tied LM head's is its embedding's, listed once)."""
    found, seen = {}, set()
    for name, m in model.named_modules():
        qw = getattr(m, "quantized", None) or getattr(m, "packed", None)
        if isinstance(qw, QuantizedWeight) and id(qw) not in seen:
            found[name] = qw
            seen.add(id(qw))
    return found


def stored_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The quantized segments as tensors for the engine-weights file."""
    out = {}
    for name, qw in quantized_modules(model).items():
        for i, s in enumerate(qw.segments):
            out[f"{PREFIX}{name}#{i}:{s.kind}:{s.n}.codes"] = s.codes
            out[f"{PREFIX}{name}#{i}:{s.kind}:{s.n}.scales"] = s.scales
    return out


def restore(model: nn.Module, stored: dict[str, torch.Tensor], isa: str) -> list[str]:
    """Attach the QuantizedWeights stored_tensors() wrote; returns the parameter names that run quantized."""
    segs: dict[str, dict[int, QuantizedSegment]] = {}
    for key, codes in stored.items():
        if key.startswith(PREFIX) and key.endswith(".codes"):
            module, rest = key[len(PREFIX):-len(".codes")].split("#")
            i, kind, n = rest.split(":")
            scales = stored[key[:-len(".codes")] + ".scales"]
            segs.setdefault(module, {})[int(i)] = QuantizedSegment(kind, int(n), codes.shape[1] * 32, codes, scales)
    names = []
    for module, by_index in segs.items():
        qw = QuantizedWeight([by_index[i] for i in sorted(by_index)], isa)
        _attach(model, f"{module}.weight", qw)
        names.append(f"{module}.weight")
    return names
