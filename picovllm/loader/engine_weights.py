"""Filling a built model with its weights, and on the CPU keeping them in the engine's own layout in the cache.

On the CPU in float32 the linear layers get packed copies of their weights (layers/packed_linear.py). Loading a
checkpoint, fusing q/k/v and gate/up, and packing write about twice the model's size into fresh memory, which
costs seconds on a small VM (each new page is a fault). So the first start stores the result, the parameters
and the packed panels as the model holds them, in the artifact cache, and later starts map that file: the
parameters become copy-on-write views of the page cache and nothing is copied. The key is the checkpoint's
identity (ModelSource.identity), the dtype, this rank's shard, the model's parameter names and shapes, and the
packing layout.
"""
from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from picovllm.artifact_cache import ArtifactCache, make_key
from picovllm.kernels.cpu import quant_gemm, small_gemm
from picovllm.layers.packed_linear import onednn_packing_available, pack_linear_weights, packed_modules
from picovllm.loader import quantized_weights, tensor_file
from picovllm.loader.source import ModelSource
from picovllm.loader.weights import load_weights

FILE = "engine_weights.safetensors"
PANELS = "panels:"          # prefix of a packed module's panels in that file


def load_model_weights(model: nn.Module, source: ModelSource, disk_cache: bool, shard: tuple[int, int],
                       quantization: str = "none") -> None:
    """Load `source` into `model` (built on its device, in its dtype) and pack it where it runs on the CPU
    in float32. shard: (tensor-parallel rank, size). disk_cache: use the artifact cache (if it is on).
    quantization: EngineConfig's; "auto" keeps a GGUF's quantized tensors quantized (CPU, float32, one rank)."""
    param = next(model.parameters())
    cpu32 = param.device.type == "cpu" and param.dtype == torch.float32
    isa = _quantized_isa(source, quantization, cpu32, shard)
    panel_dtype = torch.bfloat16 if quantization == "bf16" else torch.float32
    # fp8: the weights are rounded after loading (ModelRunner), then packed: neither packed nor cached here
    packs = cpu32 and (onednn_packing_available() or isa is not None) and quantization != "fp8"
    cache = ArtifactCache.from_env() if packs and disk_cache and source.identity is not None else None
    built = []

    def build(folder: str) -> None:
        _load_and_pack(model, source, isa, panel_dtype)
        built.append(True)
        _store(model, os.path.join(folder, FILE))

    if cache is not None:
        layout = [(name, tuple(p.shape)) for name, p in model.named_parameters()]   # a model change: a new key
        key = make_key("engine-weights", source.identity, str(param.dtype), shard, small_gemm.NR,
                       small_gemm.available(), layout, *(("quantized", quant_gemm.LAYOUT),) if isa else (),
                       *(("panels", str(panel_dtype)),) if panel_dtype != torch.float32 else ())
        folder = cache.get_or_build("engine", key, build,
                                    f"{source.path} ({param.dtype}, rank {shard[0]} of {shard[1]})")
        if built:
            return
        if folder is not None:
            _map(model, os.path.join(folder, FILE), isa)
            return
    if packs:
        _load_and_pack(model, source, isa, panel_dtype)
    else:
        load_weights(model, source.weights())


def _quantized_isa(source: ModelSource, quantization: str, cpu32: bool, shard: tuple[int, int]) -> str | None:
    """The instruction set the quantized kernels run with, or None: the weights run in float."""
    if quantization in ("none", "bf16") or source.stored_weights is None:
        return None
    if not cpu32 or shard[1] != 1:
        if cpu32 and shard[0] == 0:      # once, from rank 0: every rank loads its shard
            warnings.warn(f"picovllm: quantization={quantization!r} runs these weights in float32: the quantized "
                          "kernels take tensor_parallel_size 1", stacklevel=3)
        return None
    isa = quant_gemm.isa()
    if isa is None:
        warnings.warn(f"picovllm: quantization={quantization!r} runs these weights in float32: the quantized CPU "
                      "kernels need a C compiler and AVX2 (FMA, F16C)", stacklevel=3)
    return isa


def _load_and_pack(model: nn.Module, source: ModelSource, isa: str | None, panel_dtype: torch.dtype) -> None:
    if isa is None:
        load_weights(model, source.weights())
    else:
        quantized_weights.load_quantized(model, source, isa)
    pack_linear_weights(model, panel_dtype=panel_dtype)


def _store(model: nn.Module, path: str) -> None:
    tensors = {n: p for n, p in model.named_parameters() if p.device.type != "meta"}
    for name, module in packed_modules(model):
        if module.packed is not None and module.packed.panels is not None:
            tensors[PANELS + name] = module.packed.panels
    tensors.update(quantized_weights.stored_tensors(model))
    tensor_file.write(path, [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], iter(tensors.items()))


def _map(model: nn.Module, path: str, isa: str | None) -> None:
    stored = dict(tensor_file.read(path))
    if isa is not None:
        quantized_weights.restore(model, stored, isa)
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            continue
        t = stored.get(name)
        if t is None or t.shape != p.shape:
            raise ValueError(f"{path}: parameter {name!r} is missing or has another shape")
        p.data = t
    pack_linear_weights(model, {name[len(PANELS):]: t for name, t in stored.items() if name.startswith(PANELS)})
