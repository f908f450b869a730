"""FP8 weights of an HF checkpoint, dequantized at load into float32 (the loader copies them into the model's dtype).
The model then runs them unquantized, or, on a GPU with float8 (quantization "auto" or "fp8"), quantizes them again
in the checkpoint's own blocks, which gives back its codes (layers/fp8_weights.py; float8_parameters below says
which layers).

A quantized linear's NAME.weight is float8_e4m3fn [N, K]; its scale tensor holds one float per block of rows x
columns ([ceil(N / rows), ceil(K / cols)]: the last row and column of blocks may be cut short), and the weight is
each value times the scale of its block. Two conventions name them:
  quant_method "fp8" (transformers' FineGrainedFP8Config, vLLM's Fp8Config; Qwen3-*-FP8, DeepSeek's):
    NAME.weight_scale_inv, one per weight_block_size [rows, cols] block; without weight_block_size, one for the whole
    tensor (NAME.weight_scale_inv as transformers writes it, NAME.weight_scale as AutoFP8 does). Scales are floats,
    or under scale_fmt "ue8m0" powers of two: float8_e8m0fnu, or its bytes as uint8 (2^(b - 127)).
  quant_method "compressed-tensors", format float-quantized or naive-quantized, 8-bit float weights (RedHatAI's
    FP8 checkpoints): NAME.weight_scale by the group's strategy: tensor (one), channel ([N, 1]) or block
    ([ceil(N / rows), ceil(K / cols)] of its block_structure).
Which tensors are quantized is read from the tensors (a float8 weight and its scale), not from the module lists
(modules_to_not_convert, ignore). Activation scales (static input_scale, activation_scale, output_scale) and an FP8
KV cache's and attention's scales (k_scale / v_scale, older files' kv_scale, q_scale, prob_scale) are dropped:
activations are never quantized here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from picovllm.loader.source import WeightIterator

FP8_METHODS = ("fp8", "compressed-tensors")
DROPPED = (".input_scale", ".activation_scale", ".output_scale", ".k_scale", ".v_scale",
           ".kv_scale", ".q_scale", ".prob_scale")       # older checkpoints' one KV scale, FP8 attention's q and p
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)
CT_FORMATS = ("float-quantized", "naive-quantized")
Granularity = tuple[int | None, int | None]     # (rows, cols) one scale covers; None: the whole dimension


@dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's quantization_config says of its FP8 weights, checked once (refusals name the field)."""
    scale_names: tuple[str, ...]            # NAME.weight's scale: NAME.<one of these>
    granularities: tuple[Granularity, ...]  # the block shapes a scale may have (a config group each)
    e8m0_bytes: bool = False                # uint8 scales are e8m0 exponents (scale_fmt "ue8m0")

    @classmethod
    def from_quantization_config(cls, qc: dict[str, Any]) -> "Fp8Scheme":
        method = qc.get("quant_method")
        if method == "fp8":
            return _fine_grained(qc)
        if method == "compressed-tensors":
            return _compressed_tensors(qc)
        raise ValueError(f"config.json quantization_config.quant_method={method!r}: not an FP8 method "
                         f"({', '.join(FP8_METHODS)})")


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json quantization_config.{field}={value!r}: {why}")


def _fine_grained(qc: dict[str, Any]) -> Fp8Scheme:
    for field, taken, default in (("activation_scheme", ("dynamic", "static"), "dynamic"),
                                  ("scale_fmt", ("float", "ue8m0"), "float"), ("fmt", ("e4m3",), "e4m3"),
                                  ("expert_dtype", ("fp8",), "fp8")):
        value = qc.get(field)
        if (default if value is None else str(value).lower()) not in taken:    # as transformers reads them
            raise _refuse(field, value, f"supported: {', '.join(map(repr, taken))}")
    if qc.get("modules_to_convert"):
        raise _refuse("modules_to_convert", qc["modules_to_convert"], "FP8 embedding tables are unsupported")
    block, e8m0_bytes = qc.get("weight_block_size"), qc.get("scale_fmt") == "ue8m0"
    if block is None:
        return Fp8Scheme(("weight_scale_inv", "weight_scale"), ((None, None),), e8m0_bytes)
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("weight_block_size", block, "must be two positive integers [rows, cols] (or null: per tensor)")
    return Fp8Scheme(("weight_scale_inv",), ((block[0], block[1]),), e8m0_bytes)


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("config_groups", groups, "an FP8 checkpoint names its quantized weights' scheme there")
    for field in ("sparsity_config", "transform_config"):
        value = qc.get(field)
        if value and (field == "transform_config" or value.get("format", "dense") != "dense"):
            raise _refuse(field, value, "sparse or transformed compressed-tensors weights are unsupported")
    granularities: list[Granularity] = []
    for name, group in groups.items():
        weights = group.get("weights")
        if weights is None:         # activations only: the weights are stored unquantized
            continue
        where = f"config_groups.{name}.weights"
        kind = (weights.get("type", "int"), weights.get("num_bits", 8))
        if kind != ("float", 8):
            raise _refuse(where, weights, f"{kind[1]}-bit {kind[0]} weights are unsupported (only FP8: 8-bit float)")
        fmt_field = f"config_groups.{name}.format" if group.get("format") else "format"
        fmt = group.get("format") or qc.get("format")
        if fmt not in CT_FORMATS:
            raise _refuse(fmt_field, fmt, f"FP8 weights are read in the formats {', '.join(CT_FORMATS)}")
        for field, ok in (("symmetric", True), ("dynamic", False)):
            if weights.get(field, ok) != ok:
                raise _refuse(f"{where}.{field}", weights[field], f"FP8 weights are read with {field}={ok}")
        granularities.append(_ct_granularity(weights, where))
    return Fp8Scheme(("weight_scale",), tuple(dict.fromkeys(granularities)))


def _ct_granularity(weights: dict[str, Any], where: str) -> Granularity:
    """A compressed-tensors weights scheme's scale blocks (its strategy, or the one its group_size implies)."""
    strategy, group_size = weights.get("strategy"), weights.get("group_size")
    if strategy is None:
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    strategy = str(strategy).lower()
    if strategy == "tensor":
        return (None, None)
    if strategy == "channel":
        return (1, None)
    if strategy == "block":
        block = weights.get("block_structure")
        if isinstance(block, str):              # its older spelling, "128x128"
            block = [int(b) if b.isdigit() else b for b in block.split("x")]
        if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
            return (block[0], block[1])
        raise _refuse(f"{where}.block_structure", weights.get("block_structure"), "must be [rows, cols]")
    raise _refuse(f"{where}.strategy", strategy, "FP8 weights are read per tensor, channel or block")


def scale_values(scale: torch.Tensor, scheme: Fp8Scheme, name: str) -> torch.Tensor:
    """A checkpoint's scale tensor as float32."""
    if scale.dtype == torch.uint8 and scheme.e8m0_bytes:
        return torch.ldexp(torch.ones(scale.shape), scale.to(torch.int32) - 127)
    if scale.dtype in SCALE_DTYPES:
        return scale.to(torch.float32)
    raise ValueError(f"checkpoint tensor {name!r}: scales of dtype {scale.dtype} are unsupported (float32, bfloat16, "
                     "float16, float8_e8m0fnu; uint8 e8m0 bytes under quantization_config.scale_fmt 'ue8m0')")


def dequantize(q: torch.Tensor, scale: torch.Tensor, granularities: tuple[Granularity, ...],
               name: str = "weight") -> torch.Tensor:
    """q [N, K] float8, scale float32 of one of the granularities' grids -> [N, K] float32, each value times its
    block's scale (the exact product, 28 bits at most, rounded once to float32)."""
    n, k = q.shape
    blocks = [(rows or n, cols or k) for rows, cols in granularities]
    grids = [(-(-n // bn), -(-k // bk)) for bn, bk in blocks]
    fits = [i for i, grid in enumerate(grids) if tuple(scale.shape) == grid or (grid == (1, 1) and scale.numel() == 1)]
    if not fits:
        raise ValueError(f"checkpoint tensor {name!r}: scales {tuple(scale.shape)} for a weight of {(n, k)}, "
                         f"expected {' or '.join(map(str, grids))}")
    (bn, bk), grid = blocks[fits[0]], grids[fits[0]]
    w = q.to(torch.float32)
    s = scale.reshape(grid).repeat_interleave(bn, 0)[:n]       # [N, column blocks]: rows expanded only
    full = k // bk
    w[:, :full * bk].unflatten(1, (full, bk)).mul_(s[:, :full, None])
    if full < grid[1]:                                         # a last, narrower column block
        w[:, full * bk:].mul_(s[:, full:])
    return w


def dequantized(weights: WeightIterator, scheme: Fp8Scheme) -> WeightIterator:
    """The checkpoint's tensors with each float8 NAME.weight and its scale as NAME.weight in float32 (yielded once
    both have come, in whichever order or file), activation and KV scales left out, every other tensor as it is.
    A float8 tensor without its scale, a scale without its weight, or a scale of a weight not float8_e4m3fn is a
    ValueError naming it."""
    pending: dict[str, dict[str, torch.Tensor]] = {}        # NAME -> its weight and/or scale so far
    for name, t in weights:
        if name.endswith(DROPPED):
            continue
        module, _, part = name.rpartition(".")
        one_byte_float = t.dtype.is_floating_point and t.dtype.itemsize == 1
        if part not in scheme.scale_names and not (part == "weight" and one_byte_float):
            if one_byte_float:
                raise ValueError(f"checkpoint tensor {name!r} is {t.dtype}: only weights are read in FP8")
            yield name, t
            continue
        parts = pending.setdefault(module, {})
        if part != "weight" and any(p != "weight" for p in parts):
            raise ValueError(f"checkpoint tensor {name!r}: {module!r} has two scales "
                             f"({', '.join(module + '.' + p for p in [*parts, part] if p != 'weight')})")
        parts[part] = t
        if len(parts) == 2:
            del pending[module]
            scale_name = next(p for p in parts if p != "weight")
            q = parts["weight"]
            if q.dtype != torch.float8_e4m3fn or q.dim() != 2:
                raise ValueError(f"checkpoint tensor {module + '.weight'!r} has a scale ({module}.{scale_name}) but "
                                 f"is {q.dtype} {tuple(q.shape)}: FP8 weights are float8_e4m3fn matrices")
            s = scale_values(parts[scale_name], scheme, f"{module}.{scale_name}")
            yield module + ".weight", dequantize(q, s, scheme.granularities, module + ".weight")
    if pending:
        module, parts = next(iter(pending.items()))
        part = next(iter(parts))
        if part == "weight":
            raise ValueError(f"checkpoint tensor {module + '.weight'!r} is {parts[part].dtype} but has no scale ("
                             + " or ".join(f"{module}.{s}" for s in scheme.scale_names) + ")")
        raise ValueError(f"checkpoint tensor {module + '.' + part!r} has no float8 weight ({module}.weight) to scale")


def float8_parameters(model: torch.nn.Module, checkpoint) -> frozenset[str]:
    """The model's parameters all of whose checkpoint tensors were float8 (checkpoint: a source.Fp8Checkpoint): what
    quantization "auto" keeps in fp8 on a GPU. A layer the checkpoint left unquantized (modules_to_not_convert,
    ignore), or a fused one with such a part, is not among them."""
    from picovllm.loader.weights import parameter_of
    all_float8: dict[str, bool] = {}
    for name in checkpoint.weights:
        param = parameter_of(model, name)[0]
        all_float8[param] = all_float8.get(param, True) and name in checkpoint.quantized
    return frozenset(p for p, ok in all_float8.items() if ok)
