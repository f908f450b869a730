"""The binary wire form of a StepInput: what TP rank 0 sends its workers every step (RunStep).

JSON cost ~19 ms a step at batch 256 (benchmarks/tp_step_codec.py); this layout is a fixed header and
one numpy array per field, so encoding and decoding are a few array copies:

    header  "<4sH8I": magic b"PVSI", the protocol version (engine/messages.py), then the counts
            num_tokens N, num_seqs S, num_decodes, num_samples K, num_prev P, table_entries T (those sent:
            the deltas below), num_prompt_rows L, sampling_bytes J
    int32   input_ids[N], positions[N]
    int64   slot_mapping[N], block_table_keys[S]     (slots may pass 2**31 in a large cache)
    int32   query_start_loc[S + 1], seq_lens[S], block_table_bases[S], block_table_offsets[S + 1],
            block_table_entries[T], sample_indices[K], prev_dst[P], prev_src[P], prompt_indices[L],
            prompt_targets[L], prompt_topk[L]
    bytes   sampling[J]                  JSON list of SamplingRow objects; J = 0 for no rows (the TP case)

Little-endian throughout. decode() checks the layout and raises ValueError naming the field at fault.

Block tables travel as deltas. A request's table is only ever appended to in place (anything else gives it a new
list: Request.block_table), so rank 0 (SentTables) keys each table object it sends and remembers how many of its
entries it sent; a worker (ReceivedTables) keeps one list per key. Row i's table is key block_table_keys[i]'s list,
which held block_table_bases[i] entries, with entries[offsets[i]:offsets[i + 1]] appended: a table not sent the
step before gets a new key and base 0 (it goes whole), one sent then sends only what it gained. Both sides keep
exactly the keys of the last step's rows, so a finished, preempted or unscheduled request's table is forgotten by
the next step (and goes whole if it comes back). A worker's tables are then the same list objects from step to
step, appended to in place as rank 0's are: its graph runners' StagedTables write only the new entries, as rank
0's do. Rows that share a table (a speculative chunk's) share its key; only the first carries the entries.
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


def encode_step(step: StepInput, version: int, tables: SentTables | None = None) -> bytes:
    """step's frame; its block tables as deltas against `tables` (which then hold them), or whole without."""
    n, s = len(step.input_ids), len(step.seq_lens)
    keys, bases, offsets, entries = (tables if tables is not None else SentTables()).send(step.block_tables)
    rows = _encode_rows(step.sampling)
    header = _HEADER.pack(MAGIC, version, n, s, step.num_decodes, len(step.sample_indices),
                          len(step.prev_dst), len(entries), len(step.prompt_indices), len(rows))
    arrays = (np.asarray(step.input_ids, dtype=_I32), np.asarray(step.positions, dtype=_I32),
              np.asarray(step.slot_mapping, dtype=_I64), keys, np.asarray(step.query_start_loc, dtype=_I32),
              np.asarray(step.seq_lens, dtype=_I32), bases, offsets, entries,
              np.asarray(step.sample_indices, dtype=_I32), np.asarray(step.prev_dst, dtype=_I32),
              np.asarray(step.prev_src, dtype=_I32), np.asarray(step.prompt_indices, dtype=_I32),
              np.asarray(step.prompt_targets, dtype=_I32), np.asarray(step.prompt_topk, dtype=_I32))
    return b"".join((header, *(a.tobytes() for a in arrays), rows))


def is_step_frame(data: bytes) -> bool:
    return data[:len(MAGIC)] == MAGIC


def decode_step(data: bytes, version: int, where: str = "StepInput", tables: ReceivedTables | None = None
                ) -> StepInput:
    """The StepInput encode_step wrote with this version, its block tables built on `tables` (the tables of the
    frame before; without, the frame must send every table whole); ValueError naming the field if data is not
    such a frame."""
    if len(data) < _HEADER.size:
        raise ValueError(f"{where}: {len(data)} bytes, shorter than the {_HEADER.size}-byte header")
    if data[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{where}: not a step frame (magic {bytes(data[:len(MAGIC)])!r})")
    _, sent, n, s, num_decodes, k, p, t, m, j = _HEADER.unpack_from(data)
    if sent != version:
        raise ValueError(f"{where}: message version {sent}: this worker speaks version {version}")
    reader = _Reader(data, _HEADER.size, where)
    ids, pos = reader.array("input_ids", _I32, n), reader.array("positions", _I32, n)
    slots, keys = reader.array("slot_mapping", _I64, n), reader.array("block_table_keys", _I64, s)
    qsl, lens = reader.array("query_start_loc", _I32, s + 1), reader.array("seq_lens", _I32, s)
    bases, offsets = reader.array("block_table_bases", _I32, s), reader.array("block_tables", _I32, s + 1)
    entries = reader.array("block_tables", _I32, t)
    samp, dst, src = (reader.array(name, _I32, c) for name, c in
                      (("sample_indices", k), ("prev_dst", p), ("prev_src", p)))
    p_idx, p_tgt, p_k = (reader.array(name, _I32, m) for name in ("prompt_indices", "prompt_targets", "prompt_topk"))
    rows = _decode_rows(reader.raw("sampling", j), f"{where}.sampling")
    reader.check_end()
    _check_consistent(where, n, s, num_decodes, qsl, offsets, t, len(samp), rows)
    if m and (p_idx.min() < 0 or p_idx.max() >= n):
        raise ValueError(f"{where}.prompt_indices: must index the {n} tokens")
    block_tables = (tables if tables is not None else ReceivedTables()).receive(keys, bases, offsets, entries, where)
    return StepInput(ids.tolist(), pos.tolist(), slots.tolist(), qsl.tolist(), lens.tolist(), block_tables,
                     num_decodes, samp.tolist(), rows, dst.tolist(), src.tolist(), p_idx.tolist(), p_tgt.tolist(),
                     p_k.tolist())


class SentTables:
    """Rank 0's half of the block-table deltas: the tables of the last step sent, by object, each with its key and
    the number of entries sent. Holding the objects keeps their id()s from being reused by new lists."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[list[int], int, int]] = {}    # id(table) -> (table, key, entries sent)
        self._next_key = 0

    def send(self, tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(keys, bases, offsets, entries) of these rows' tables, which become the ones sent."""
        old, sent = self._sent, {}
        get_old, get_sent = old.get, sent.get
        keys, bases, gained = [], [], []
        lens = list(map(len, tables))
        next_key = self._next_key
        for table, n in zip(tables, lens):
            i = id(table)
            held = get_sent(i) or get_old(i)     # (a row sharing an earlier row's table: as that row left it)
            if held is None or n < held[2]:       # (shorter breaks Request.block_table's rule: whole all the same)
                key, base = next_key, 0
                next_key += 1
            else:
                key, base = held[1], held[2]
            sent[i] = (table, key, n)
            keys.append(key)
            bases.append(base)
            if n > base:
                gained.append(table[base:] if base else table)
        bases = np.array(bases, dtype=_I32)
        offsets = np.zeros(len(tables) + 1, dtype=_I32)
        np.cumsum(np.array(lens, dtype=_I32) - bases, out=offsets[1:])
        entries = np.fromiter(chain.from_iterable(gained), dtype=_I32, count=int(offsets[-1]))
        self._sent, self._next_key = sent, next_key
        return np.array(keys, dtype=_I64), bases, offsets, entries


class ReceivedTables:
    """A worker's half: the list of each key of the last step received, appended to in place as rank 0's are."""

    def __init__(self) -> None:
        self._held: dict[int, list[int]] = {}

    def receive(self, keys: np.ndarray, bases: np.ndarray, offsets: np.ndarray, entries: np.ndarray,
                where: str) -> list[list[int]]:
        """The rows' tables, which become the ones held. A frame found bad leaves the held tables as they were."""
        old, held, tables, grown = self._held, {}, [], []
        get_old, get_held = old.get, held.get
        entries_l, offsets_l = entries.tolist(), offsets.tolist()
        try:
            for key, base, a, b in zip(keys.tolist(), bases.tolist(), offsets_l, offsets_l[1:]):
                table = get_held(key)            # (a row sharing an earlier row's table: as that row left it)
                if table is None:
                    table = get_old(key)
                    if table is None:
                        if base != 0:
                            raise ValueError(f"{where}.block_table_keys: key {key} extends a table of {base} "
                                             "entries that this worker does not hold")
                        held[key] = table = entries_l[a:b]     # a new table, whole
                        tables.append(table)
                        continue
                if len(table) != base:
                    raise ValueError(f"{where}.block_table_bases: key {key} extends a table of {base} entries, "
                                     f"this worker's has {len(table)}")
                if b > a:
                    grown.append((table, base))
                    table += entries_l[a:b]
                held[key] = table
                tables.append(table)
        except ValueError:
            for table, base in grown:
                del table[base:]
            raise
        self._held = held
        return tables


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
