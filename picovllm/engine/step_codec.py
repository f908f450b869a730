"""The binary wire form of a StepInput: what TP rank 0 sends its workers every step (RunStep).

JSON cost ~19 ms a step at batch 256 (benchmarks/tp_step_codec.py); this layout is a fixed header and
one numpy array per field, so encoding and decoding are a few array copies:

    header  "<4sH8I": magic b"PVSI", the protocol version (engine/messages.py), then the counts
            num_tokens N, num_seqs S, num_decodes, num_samples K, num_prev P, table_entries T,
            num_prompt_rows L, sampling_bytes J
    int32   input_ids[N], positions[N]
    int64   slot_mapping[N]              (slots may pass 2**31 in a large cache)
    int32   query_start_loc[S + 1], seq_lens[S], block_table_offsets[S + 1], block_table_entries[T],
            sample_indices[K], prev_dst[P], prev_src[P], prompt_indices[L], prompt_targets[L], prompt_topk[L]
    bytes   sampling[J]                  JSON list of SamplingRow objects; J = 0 for no rows (the TP case)

Little-endian throughout. decode() checks the layout and raises ValueError naming the field at fault.
"""
from __future__ import annotations

import json
import struct
from dataclasses import fields
from itertools import chain

import numpy as np

from picovllm.engine.step_input import SamplingRow, StepInput

MAGIC = b"PVSI"
_HEADER = struct.Struct("<4sH8I")
_I32, _I64 = np.dtype("<i4"), np.dtype("<i8")
_ROW_FIELDS = tuple(f.name for f in fields(SamplingRow))


def encode_step(step: StepInput, version: int) -> bytes:
    n, s = len(step.input_ids), len(step.seq_lens)
    offsets = np.zeros(s + 1, dtype=_I32)
    np.cumsum([len(t) for t in step.block_tables], out=offsets[1:])
    table_entries = np.fromiter(chain.from_iterable(step.block_tables), dtype=_I32, count=int(offsets[-1]))
    rows = _encode_rows(step.sampling)
    header = _HEADER.pack(MAGIC, version, n, s, step.num_decodes, len(step.sample_indices),
                          len(step.prev_dst), len(table_entries), len(step.prompt_indices), len(rows))
    arrays = (np.asarray(step.input_ids, dtype=_I32), np.asarray(step.positions, dtype=_I32),
              np.asarray(step.slot_mapping, dtype=_I64), np.asarray(step.query_start_loc, dtype=_I32),
              np.asarray(step.seq_lens, dtype=_I32), offsets, table_entries,
              np.asarray(step.sample_indices, dtype=_I32), np.asarray(step.prev_dst, dtype=_I32),
              np.asarray(step.prev_src, dtype=_I32), np.asarray(step.prompt_indices, dtype=_I32),
              np.asarray(step.prompt_targets, dtype=_I32), np.asarray(step.prompt_topk, dtype=_I32))
    return b"".join((header, *(a.tobytes() for a in arrays), rows))


def is_step_frame(data: bytes) -> bool:
    return data[:len(MAGIC)] == MAGIC


def decode_step(data: bytes, version: int, where: str = "StepInput") -> StepInput:
    """The StepInput encode_step wrote with this version; ValueError naming the field if data is not such a frame."""
    if len(data) < _HEADER.size:
        raise ValueError(f"{where}: {len(data)} bytes, shorter than the {_HEADER.size}-byte header")
    if data[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{where}: not a step frame (magic {bytes(data[:len(MAGIC)])!r})")
    _, sent, n, s, num_decodes, k, p, t, m, j = _HEADER.unpack_from(data)
    if sent != version:
        raise ValueError(f"{where}: message version {sent}: this worker speaks version {version}")
    reader = _Reader(data, _HEADER.size, where)
    ids, pos = reader.array("input_ids", _I32, n), reader.array("positions", _I32, n)
    slots, qsl = reader.array("slot_mapping", _I64, n), reader.array("query_start_loc", _I32, s + 1)
    lens, offsets = reader.array("seq_lens", _I32, s), reader.array("block_tables", _I32, s + 1)
    entries = reader.array("block_tables", _I32, t)
    samp, dst, src = (reader.array(name, _I32, c) for name, c in
                      (("sample_indices", k), ("prev_dst", p), ("prev_src", p)))
    p_idx, p_tgt, p_k = (reader.array(name, _I32, m) for name in ("prompt_indices", "prompt_targets", "prompt_topk"))
    rows = _decode_rows(reader.raw("sampling", j), f"{where}.sampling")
    reader.check_end()
    _check_consistent(where, n, s, num_decodes, qsl, offsets, t, len(samp), rows)
    if m and (p_idx.min() < 0 or p_idx.max() >= n):
        raise ValueError(f"{where}.prompt_indices: must index the {n} tokens")
    entries_l, offsets_l = entries.tolist(), offsets.tolist()
    tables = [entries_l[a:b] for a, b in zip(offsets_l, offsets_l[1:])]
    return StepInput(ids.tolist(), pos.tolist(), slots.tolist(), qsl.tolist(), lens.tolist(), tables,
                     num_decodes, samp.tolist(), rows, dst.tolist(), src.tolist(), p_idx.tolist(), p_tgt.tolist(),
                     p_k.tolist())


class _Reader:
    """Reads the arrays of a frame in order; a frame that ends early names the field it cut."""

    def __init__(self, data: bytes, offset: int, where: str) -> None:
        self.data, self.offset, self.where = data, offset, where

    def raw(self, name: str, nbytes: int) -> bytes:
        end = self.offset + nbytes
        if end > len(self.data):
            raise ValueError(f"{self.where}.{name}: the frame ends {end - len(self.data)} bytes short of it")
        out, self.offset = self.data[self.offset:end], end
        return out

    def array(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        return np.frombuffer(self.raw(name, count * dtype.itemsize), dtype=dtype)

    def check_end(self) -> None:
        if self.offset != len(self.data):
            raise ValueError(f"{self.where}: {len(self.data) - self.offset} bytes after the last field (sampling)")


def _check_consistent(where: str, n: int, s: int, num_decodes: int, qsl: np.ndarray, offsets: np.ndarray,
                      t: int, k: int, rows: list[SamplingRow]) -> None:
    """The counts agree with each other: what the forward would otherwise index out of bounds."""
    if s == 0 or qsl[0] != 0 or qsl[-1] != n or (np.diff(qsl) <= 0).any():
        raise ValueError(f"{where}.query_start_loc: must rise from 0 to the {n} tokens over {s} sequences")
    if offsets[0] != 0 or offsets[-1] != t or (np.diff(offsets) < 0).any():
        raise ValueError(f"{where}.block_tables: offsets must rise from 0 to the {t} entries")
    if num_decodes > s:
        raise ValueError(f"{where}.num_decodes: {num_decodes} of {s} sequences")
    if rows and len(rows) != k:
        raise ValueError(f"{where}.sampling: {len(rows)} rows for {k} sample indices")


def _encode_rows(rows: list[SamplingRow]) -> bytes:
    if not rows:
        return b""
    return json.dumps([[getattr(r, f) for f in _ROW_FIELDS] for r in rows], separators=(",", ":")).encode()


def _decode_rows(data: bytes, where: str) -> list[SamplingRow]:
    """Rows travel as lists in SamplingRow's field order (the protocol version pins that order)."""
    if not data:
        return []
    try:
        rows = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == len(_ROW_FIELDS) for r in rows):
        raise ValueError(f"{where}: expected a list of {len(_ROW_FIELDS)}-field rows")
    return [SamplingRow(*r) for r in rows]
