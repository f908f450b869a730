"""The GGUF container read in one pass: metadata as Python values, tensors as memory-mapped byte views.

Layout (llama.cpp's gguf.md): magic "GGUF", version (2 or 3), tensor count, metadata count; the metadata
key/value pairs; one info per tensor (name, dims, ggml type, offset); padding to `general.alignment`; the
tensor data. The gguf package's GGUFReader builds a numpy view per array element, which takes seconds on a
49k-token vocabulary; here strings are decoded straight from the mapped bytes and numeric arrays are one
numpy view each. Dequantization is still the gguf package's (`gguf.quants`).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

# value type -> (struct format, size) for scalars; 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]      # as GGUF lists it: fastest-varying dimension first
    ggml_type: int
    data: np.ndarray            # uint8 bytes of the tensor, a view of the mapped file


class GGUFFile:
    """metadata: {key: int | float | bool | str | list | np.ndarray}; tensors: {name: GGUFTensor}."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.getsize(path) < 4:
            raise ValueError(f"GGUF {path!r}: not a GGUF file (empty or shorter than its magic)")
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._mv = memoryview(self._buf)
        self._pos = 0
        if bytes(self._mv[:4]) != b"GGUF":
            raise ValueError(f"GGUF {path!r}: not a GGUF file (bad magic)")
        self._pos = 4
        version, n_tensors, n_kv = self._scalar(4), self._scalar(10), self._scalar(10)
        if version not in (2, 3):
            raise ValueError(f"GGUF {path!r}: version {version} is unsupported (2 or 3)")
        try:
            self.metadata = {}
            for _ in range(n_kv):
                key = self._string()
                self.metadata[key] = self._value(self._scalar(4))
            infos = [self._tensor_info() for _ in range(n_tensors)]
        except (struct.error, IndexError, UnicodeDecodeError, KeyError) as e:
            raise ValueError(f"GGUF {path!r}: truncated or corrupt header ({e})") from None
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = {name: GGUFTensor(name, shape, kind, self._tensor_bytes(start + off, shape, kind, name))
                        for name, shape, kind, off in infos}

    # -- the byte stream ----------------------------------------------------------------------
    def _scalar(self, kind: int):
        fmt, size = _SCALARS[kind]
        (v,) = struct.unpack_from(fmt, self._mv, self._pos)
        self._pos += size
        return v

    def _string(self) -> str:
        n = self._scalar(10)
        if self._pos + n > len(self._buf):
            raise IndexError("string runs past the end of the file")
        s = str(self._mv[self._pos:self._pos + n], "utf-8")
        self._pos += n
        return s

    def _value(self, kind: int):
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            return self._scalar(kind)
        elem, count = self._scalar(4), self._scalar(10)
        if elem == STRING:
            return [self._string() for _ in range(count)]
        if elem == ARRAY:
            return [self._value(self._scalar(4)) for _ in range(count)]
        dtype = np.dtype(_NUMPY[elem])
        end = self._pos + count * dtype.itemsize
        if end > len(self._buf):
            raise IndexError("array runs past the end of the file")
        arr = np.frombuffer(self._mv[self._pos:end], dtype=dtype).copy()
        self._pos = end
        return arr

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar(10) for _ in range(self._scalar(4)))
        return name, dims, self._scalar(4), self._scalar(10)

    def _tensor_bytes(self, start: int, shape: tuple[int, ...], kind: int, name: str) -> np.ndarray:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"GGUF {self.path!r}: tensor {name!r} has unknown ggml type {kind}") from None
        if shape and shape[0] % block:      # a row (GGUF's first dimension) is whole blocks
            raise ValueError(f"GGUF {self.path!r}: tensor {name!r} of type {GGMLQuantizationType(kind).name} has rows "
                             f"of {shape[0]} values, not a multiple of its blocks of {block}")
        count = int(np.prod(shape, dtype=np.int64))
        size = count // block * type_size
        if start + size > len(self._buf):
            raise ValueError(f"GGUF {self.path!r}: tensor {name!r} runs past the end of the file (truncated?)")
        return self._buf[start:start + size]
