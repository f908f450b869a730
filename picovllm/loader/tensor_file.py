"""Tensors (float32, float16, uint8, int8) in the safetensors layout, written one tensor at a time and read back by memory-mapping.

The layout (safetensors' format): an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the bytes. Written here as a stream, so storing a model needs one tensor in
memory at a time (safetensors' own save_file wants them all); read back as views of the mapped file, so
loading copies each tensor once, into its parameter. Any safetensors reader opens these files.
"""
from __future__ import annotations

import json
import struct
from typing import Iterable, Iterator

import numpy as np
import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.uint8: "U8", torch.int8: "I8"}
_NUMPY = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "I8": np.int8}


def write(path: str, specs: list[tuple], tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """specs: (name, shape) of each tensor, or (name, shape, dtype) for another dtype than float32 (one of
    DTYPES), in the order `tensors` yields them (checked)."""
    header, offset, dtypes = {}, 0, []
    for name, shape, *dtype in specs:
        dtype = dtype[0] if dtype else torch.float32
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
        dtypes.append(dtype)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)           # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for (name, shape, *_), dtype, (got_name, t) in zip(specs, dtypes, tensors, strict=True):
            if got_name != name or tuple(t.shape) != tuple(shape):
                raise ValueError(f"tensor_file.write: expected {name} {shape}, got {got_name} {tuple(t.shape)}")
            f.write(memoryview(t.detach().to(dtype).contiguous().numpy()).cast("B"))   # no copy


def read(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in file order; each tensor a copy-on-write view of the mapped file (nothing is read
    until used, and writing to it never reaches the file)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + n)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _NUMPY:
            raise ValueError(f"{path}: tensor {name!r} is {info['dtype']}, this reader takes {', '.join(_NUMPY)}")
        begin, end = info["data_offsets"]
        yield name, torch.from_numpy(data[begin:end].view(_NUMPY[info["dtype"]])).view(info["shape"])
