"""MXFP4 weights of an HF checkpoint (GPT-OSS's experts: quantization_config.quant_method "mxfp4"), dequantized at
load into bfloat16 (exact), from which the loader copies them into the model's dtype.

The format (OCP microscaling): each group of 32 weights is 16 bytes of float4 e2m1 values, two a byte with the low
nibble first, and one byte of shared scale, e8m0 (the power of two 2^(s - 127)). A tensor NAME is stored as
NAME_blocks [..., rows, groups, 16] and NAME_scales [..., rows, groups]; dequantized it is [..., rows, groups * 32],
which the checkpoint's dense form holds transposed in its last two dims (GPT-OSS's experts: [E, in, out]). Every
e2m1 value times a power of two is exact in bfloat16 and float32, so the dequantized weights are the quantized
ones exactly.
"""
from __future__ import annotations

import torch

from picovllm.loader.source import WeightIterator

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] in dtype (one index of the first dimension,
    an expert, at a time, so the float intermediates stay one expert's size)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up "
                         "(blocks must be [..., groups, 16], scales [..., groups])")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype)
    stacked = blocks.dim() > 3
    bs, ss, os_ = (blocks, scales, out) if stacked else (blocks[None], scales[None], out[None])
    for i in range(len(bs)):
        b = bs[i].to(torch.int64)
        vals = torch.stack([lut[b & 15], lut[b >> 4]], dim=-1).flatten(-2)            # [..., G, 32]
        os_[i] = torch.ldexp(vals, ss[i].to(torch.int32)[..., None] - 127).flatten(-2)
    return out


def dequantized(weights: WeightIterator, dtype: torch.dtype = torch.bfloat16) -> WeightIterator:
    """The checkpoint's tensors with each NAME_blocks / NAME_scales pair of GPT-OSS's experts (the one layout known)
    as NAME in its dense layout ([E, out, in] dequantized, then the last two dims swapped, as the unquantized
    checkpoint stores it); a half without its other half, or a pair elsewhere, is a ValueError naming it."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        suffix = next((s for s in SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, t
            continue
        base = name[:-len(suffix)]
        if ".mlp.experts." not in base:
            raise ValueError(f"checkpoint tensor {name!r}: MXFP4 weights are read for GPT-OSS's experts only")
        parts = pending.setdefault(base, {})
        parts[suffix] = t
        if len(parts) == 2:
            del pending[base]
            w = dequantize(parts["_blocks"], parts["_scales"], dtype)
            yield base, w.transpose(-1, -2)
    if pending:
        base, parts = next(iter(pending.items()))
        missing = next(s for s in SUFFIXES if s not in parts)
        raise ValueError(f"checkpoint tensor {base + next(iter(parts))!r} has no {base + missing!r} (MXFP4 weights "
                         "come as _blocks and _scales pairs)")
