"""CUDA graphs for decode steps: the model forward and LM head, captured once per batch size.

A decode-only step is padded up to the next captured batch size and replayed. Every tensor the
graph reads lives in a static buffer here (token ids, positions, slots, context lengths, block
tables); a step copies its inputs into them from pinned host memory without blocking. Padding
rows get slot -1 (the KV store skips them) and context length 0 (attention reads nothing for
them), so they touch no real request's cache. Only the Triton attention backend is captured: its
launch grids depend on the batch size alone, never on the context lengths.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from picovllm.layers.attention import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def pinned(array: np.ndarray) -> torch.Tensor:
    """A pinned host tensor holding a copy of array (so a non-blocking upload can read it later)."""
    t = torch.empty(array.shape, dtype=torch.from_numpy(array[:0]).dtype, pin_memory=torch.cuda.is_available())
    t.numpy()[...] = array
    return t


def capture_largest_first(sizes: list[int], forward, pool=None) -> tuple[dict, dict]:
    """CUDA graphs of forward(size) for every size, largest first (the smaller ones reuse its memory in the pool),
    each captured after one run outside capture (Triton compiles, lazy initialisations, the allocator's growth).
    pool: another runner's, to share. Returns (graphs, the captured outputs), keyed by size."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    graphs, outputs = {}, {}
    for size in sorted(sizes, reverse=True):
        forward(size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = forward(size)
        graphs[size] = graph
    torch.cuda.synchronize()
    return graphs, outputs


def fill_block_tables(out: np.ndarray, tables: list[list[int]]) -> None:
    """Write ragged block tables into the rows of a 2-D int32 array (entries past a row's end are stale; a table
    longer than the array is cut at its width)."""
    width = out.shape[1]
    for row, table in zip(out, tables):
        if len(table) > width:
            table = table[:width]
        row[:len(table)] = table


class StagedTables:
    """The block tables a graph runner uploads (or an eager step packs: step_tensors), kept in a host array from step
    to step: a step writes only the entries its rows' tables gained since the array last held them (a decoding row's
    table gains one every block_size tokens), where converting every entry from Python each step cost ~0.6 ms at
    batch 256 with 2k-token contexts (0.49 ms in step_tensors, 0.10 staged).
    The step's rows then go up from a contiguous pinned copy (pinned(): a strided or pageable source would make torch
    stage it through pageable memory, which may wait for the stream).

    It relies on the rule Request.block_table keeps: a table's entries are never changed in place (anything but an
    append gives the request a new list), so the same list object, no shorter, still holds what was written. A TP
    worker's tables keep it too: they are its own lists, appended to as rank 0's deltas arrive
    (engine/step_codec.py)."""

    def __init__(self, rows: int, cols: int) -> None:
        self._array = np.zeros((rows, cols), dtype=np.int32)
        self._held: list[list[int] | None] = [None] * rows     # each row's table object
        self._written = [0] * rows                             # and how many of its entries the row holds

    def fits(self, tables: list[list[int]], width: int) -> bool:
        rows, cols = self._array.shape
        return len(tables) <= rows and width <= cols

    def upload(self, tables: list[list[int]], width: int, dst: torch.Tensor) -> None:
        """dst[:len(tables), :width] := the tables, by one non-blocking copy (entries past a table's end are stale;
        a table longer than the array is cut at its width)."""
        dst[:len(tables), :width].copy_(pinned(self.stage(tables, width)), non_blocking=True)

    def stage(self, tables: list[list[int]], width: int) -> np.ndarray:
        """The kept array's first len(tables) rows and width columns, holding the tables (as upload's; a view,
        valid until the next call)."""
        out, held, written, cols = self._array, self._held, self._written, self._array.shape[1]
        for i, table in enumerate(tables):
            n = min(len(table), cols)
            if held[i] is table:
                k = written[i]
                if k < n:
                    out[i, k:n] = table[k:n]
            else:
                out[i, :n] = table if n == len(table) else table[:n]
                held[i] = table
            written[i] = n
        return out[:len(tables), :width]


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        m, dev = self.max_bs, device
        self.tokens = torch.zeros(3, m, dtype=torch.long, device=dev)     # input ids, positions, slots
        self.tokens[2].fill_(-1)
        self.seq_lens = torch.zeros(m, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(m, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.staged_tables = StagedTables(m, max_blocks_per_seq)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        longest = self.max_blocks * self.block_size
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], num_decodes=bs,
            max_query_len=1, max_seq_len=longest, query_lens_cpu=[1] * bs, seq_lens_cpu=[longest] * bs)

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.tokens[0, :bs], self.tokens[1, :bs], self._meta(bs))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> "CUDAGraphRunner":
        self.graphs, self.logits = capture_largest_first(self.sizes, self._forward)
        return self

    def fits(self, step) -> bool:
        n = len(step.seq_lens)
        return (step.num_decodes == n and 0 < n <= self.max_bs and len(step.input_ids) == n
                and max(len(t) for t in step.block_tables) <= self.max_blocks)

    def run(self, step, prev_tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Replay the graph for a decode-only step; returns the logits of its n rows ([n, vocab]).
        prev_tokens: (rows, token ids) of input ids still on the device (overlapped scheduling)."""
        n = len(step.seq_lens)
        bs = next(s for s in self.sizes if s >= n)
        width = max(len(t) for t in step.block_tables)
        tokens = pinned(np.array([step.input_ids, step.positions, step.slot_mapping], dtype=np.int64))
        lens = pinned(np.array(step.seq_lens, dtype=np.int32))
        self.tokens[:, :n].copy_(tokens, non_blocking=True)
        if prev_tokens is not None:
            self.tokens[0].index_copy_(0, *prev_tokens)
        self.seq_lens[:n].copy_(lens, non_blocking=True)
        self.staged_tables.upload(step.block_tables, width, self.block_tables)
        if bs > n:
            self.tokens[2, n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(0)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
