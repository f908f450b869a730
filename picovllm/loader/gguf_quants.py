"""GGUF's quantized blocks decoded into the two forms the CPU's quantized kernels run, without rounding anything.

Block layouts (llama.cpp's ggml-common.h): Q4_0 = f16 d, 16 bytes of nibbles (element j in the low nibble of byte
j, element j + 16 in the high one), value d * (q - 8). Q4_1 = f16 d, f16 m, the same nibbles, value d * q + m.
Q8_0 = f16 d, 32 int8, value d * q. Q4_K = 256 elements: f16 d, f16 dmin, 12 bytes packing eight 6-bit scales
and mins, 128 bytes of nibbles (byte l of 32-byte chunk c: sub-block 2c's element l low, 2c + 1's high), value
d * sc * q - dmin * mn per 32. Q6_K = 256 elements: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8
scales (one per 16), f16 d, value d * sc * (q - 32).

The two forms (the kernels' `kind`):
  q4: codes u in 0..15, a scale d and an offset m per 32 elements: value = d * u + m  (Q4_0, Q4_1, Q4_K)
  q8: codes q in -128..127, a scale d per 16 elements:          value = d * q      (Q8_0, Q6_K)
Q4_K and Q6_K's scales are products (d * sc) that float16 cannot hold exactly, so those keep float32 scales.

MXFP4 (GPT-OSS's experts, ggml type 39) has no kernel here: dequantize_mxfp4 turns it into float32 at load, exactly
(e2m1 values times a power of two). Its block (ggml-common.h's block_mxfp4): one e8m0 scale byte e, then 16 bytes of
e2m1 nibbles, element j in the low nibble of byte j and element j + 16 in the high one (Q4_0's order, not the HF
checkpoints' two-neighbours-a-byte: loader/mxfp4.py); value e2m1(q) * 2^(e - 127).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# ggml type name -> (elements per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}
QUANTIZED_TYPES = tuple(BLOCKS)


@dataclass
class DecodedBlocks:
    """A [n, k] weight in one of the two kernel forms (see the module docstring)."""
    kind: str                   # "q4" or "q8"
    codes: np.ndarray           # [n, k] uint8 (q4) or int8 (q8)
    scales: np.ndarray          # [n, k / 32] (q4) or [n, k / 16] (q8), float32
    offsets: np.ndarray | None  # [n, k / 32] float32 (q4), None (q8)
    scale_dtype: np.dtype       # float16 where every scale and offset is exactly a float16, else float32

    def take_rows(self, order) -> DecodedBlocks:
        """These blocks with their rows in `order` (an index array or slice)."""
        return DecodedBlocks(self.kind, self.codes[order], self.scales[order],
                             None if self.offsets is None else self.offsets[order], self.scale_dtype)

    def dequantize(self) -> np.ndarray:
        """[n, k] float64: the weight the blocks stand for."""
        n, k = self.codes.shape
        group = k // self.scales.shape[1]
        w = self.codes.astype(np.float64).reshape(n, -1, group) * self.scales.astype(np.float64)[..., None]
        if self.offsets is not None:
            w += self.offsets.astype(np.float64)[..., None]
        return w.reshape(n, k)


def concatenate(parts: list[DecodedBlocks]) -> DecodedBlocks:
    """The parts' rows one after another (they share kind, k and scale dtype)."""
    first = parts[0]
    return DecodedBlocks(first.kind, np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                         None if first.offsets is None else np.concatenate([p.offsets for p in parts]),
                         first.scale_dtype)


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def decode_blocks(type_name: str, raw: np.ndarray, n: int, k: int) -> DecodedBlocks:
    """raw: the [n, k] tensor's bytes as GGUF stores them (uint8, n * k / block * bytes long); type_name: its ggml
    type (one of QUANTIZED_TYPES). ValueError naming the type for any other."""
    if type_name not in BLOCKS:
        raise ValueError(f"quantization {type_name} has no quantized CPU kernel (supported: {', '.join(BLOCKS)})")
    per, size = BLOCKS[type_name]
    if k % per:
        raise ValueError(f"{type_name} weight of shape ({n}, {k}): {k} columns is not a multiple of its block ({per})")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per, size)
    return _DECODERS[type_name](b, n, k)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray, n: int, k: int) -> DecodedBlocks:
    d = _f16(b, 0)
    return DecodedBlocks("q4", _nibbles(b[..., 2:18]).reshape(n, k), d, -8 * d, np.dtype(np.float16))


def _q4_1(b: np.ndarray, n: int, k: int) -> DecodedBlocks:
    return DecodedBlocks("q4", _nibbles(b[..., 4:20]).reshape(n, k), _f16(b, 0), _f16(b, 2), np.dtype(np.float16))


def _q8_0(b: np.ndarray, n: int, k: int) -> DecodedBlocks:
    d = _f16(b, 0)
    return DecodedBlocks("q8", b[..., 2:34].copy().view(np.int8).reshape(n, k), np.repeat(d, 2, axis=1), None,
                         np.dtype(np.float16))


def _q4_k(b: np.ndarray, n: int, k: int) -> DecodedBlocks:
    d, dmin, s = _f16(b, 0), _f16(b, 2), b[..., 4:16].astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = b[..., 16:144].reshape(n, -1, 4, 32)                   # four chunks of 32 bytes: two sub-blocks each
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3)              # [n, blocks, chunk, low/high, 32]
    scales = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
    offsets = -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
    return DecodedBlocks("q4", codes.reshape(n, k), scales, offsets, np.dtype(np.float32))


def _q6_k(b: np.ndarray, n: int, k: int) -> DecodedBlocks:
    ql, qh = b[..., 0:128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
    sc, d = b[..., 192:208].copy().view(np.int8), _f16(b, 208)
    lo, hi = ql[..., :32], ql[..., 32:]
    parts = [(lo & 0x0F) | ((qh & 3) << 4), (hi & 0x0F) | (((qh >> 2) & 3) << 4),
             (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)]   # elements 0-31, 32-63, ...
    q = np.stack(parts, axis=3).astype(np.int16) - 32           # [n, blocks, half, 4, 32]
    scales = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
    return DecodedBlocks("q8", q.astype(np.int8).reshape(n, k), scales, None, np.dtype(np.float32))


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


MXFP4_BLOCK = (32, 17)              # elements, bytes
_ROWS_AT_ONCE = 4096                # bounds the float temporaries (gpt-oss-20b's expert tensors: 92160 rows)


def dequantize_mxfp4(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """The [n, k] float32 weight whose MXFP4 blocks GGUF stores as `raw` (uint8, n * k / 32 * 17 bytes)."""
    from picovllm.loader.mxfp4 import E2M1

    per, size = MXFP4_BLOCK
    if k % per:
        raise ValueError(f"MXFP4 weight of shape ({n}, {k}): {k} columns is not a multiple of its block ({per})")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per, size)
    lut, out = np.array(E2M1, dtype=np.float32), np.empty((n, k), dtype=np.float32)
    for r in range(0, n, _ROWS_AT_ONCE):
        rows = b[r:r + _ROWS_AT_ONCE]
        qs = rows[..., 1:]
        values = np.concatenate([lut[qs & 0x0F], lut[qs >> 4]], axis=-1)       # elements 0-15, then 16-31
        exponent = rows[..., :1].astype(np.int32) - 127
        out[r:r + len(rows)] = np.ldexp(values, exponent).reshape(len(rows), k)
    return out
