"""Whole-step CUDA graphs for steps of several sequences: a prompt's chunk beside decodes (a mixed step), several
chunks, a chunk longer than the prefill graphs' buckets (engine/prefill_graph.py).

Under online traffic most steps are mixed. Eager, such a step launched ~25 kernels a layer from Python; in pieces
around eager attention (engine/piecewise_graph.py) the attention's own launches were still most of its host time.
Here attention is captured too: it runs over a work list (kernels/work_attention.py), a (sequence, query tile, share
of a decode's keys) item per program and KV head, padded with empty items to a length that depends on the token
bucket alone. A decode is a chunk of one token, whose keys may be split over programs as the decode kernel splits
them. So one graph per token bucket serves every layout of decodes and chunks, at any context.

Two kinds of step stay with the pieces. A short chunk (at most SHORT_CHUNK tokens) over a context longer than
MAX_CONTEXT, a new message after a long conversation, say: its few query tiles each stream the whole context, where
the eager path sends such a chunk, alone, through the split decode kernel (kernels/backend.py _short_prefill). And
decodes whose contexts sum past MAX_DECODE_CONTEXT tokens: there the step is bound by reading their keys, which the
decode kernel does 10-20% faster than the work list's tiles (BENCHMARKS.md, eleventh session).

Static buffers: token ids, positions, slots and the LM head's rows (int64); query starts, sequence lengths, each
sequence's splits and the work list (one int32 buffer, each part at a 64-byte offset); block tables. Padding tokens
get slot -1 (the KV store skips them) and are in no item. The LM head runs eagerly on the rows that sample or score
prompt tokens.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from picovllm.engine.cuda_graph import StagedTables, capture_largest_first, pinned
from picovllm.engine.piecewise_graph import piecewise_buckets
from picovllm.engine.step_input import StepInput
from picovllm.kernels.work_attention import max_work_items, work_items, work_tile
from picovllm.layers.attention import AttentionMetadata, WorkList

SHORT_CHUNK = 16      # as kernels/backend.py's SHORT_PREFILL
MAX_CONTEXT = 2048    # the context past which such a chunk goes to the pieces
# The decodes' summed context past which the pieces take the step. On an H200 (Qwen3-0.6B shape, D decodes at C
# tokens beside a 256-token chunk) the graphs won or tied up to 131,072 tokens (16 x 8,192: 8.6 ms against 9.5; 64 x
# 2,048: 8.2-8.5 against 8.0-8.4) and lost past it (64 x 4,096: 16.2 against 13.4; 32 x 8,192: 15.0 against 12.7).
MAX_DECODE_CONTEXT = 131072


def _aligned(n: int) -> int:
    return -(-n // 16) * 16      # int32 elements: 64 bytes


class MixedGraphRunner:
    def __init__(self, model: nn.Module, max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.sizes = piecewise_buckets(max_num_batched_tokens)
        self.max_tokens = min(self.sizes[-1], max_num_batched_tokens)
        self.max_seqs = min(max_num_seqs, self.max_tokens)
        self.max_context, self.max_decode_context = MAX_CONTEXT, MAX_DECODE_CONTEXT
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        attn = model.attention_layers()[0]
        self.tile = work_tile(attn.num_heads // attn.num_kv_heads)     # query tokens a work item
        t, s = self.sizes[-1], self.max_seqs
        self.tokens = torch.zeros(4, t, dtype=torch.long, device=device)   # ids, positions, slots, LM-head rows
        self.tokens[2].fill_(-1)
        self._lens_at = _aligned(s + 1)
        self._splits_at = self._lens_at + _aligned(s)
        self._work_at = self._splits_at + _aligned(s)
        self.meta_i32 = torch.full((self._work_at + 4 * max_work_items(t, s, self.tile),), -1, dtype=torch.int32,
                                   device=device)
        self.meta_i32[self._splits_at:self._work_at] = 0
        self.block_tables = torch.zeros(s, self.max_blocks, dtype=torch.int32, device=device)
        self.staged_tables = StagedTables(s, self.max_blocks)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}

    def _items(self, size: int) -> int:
        return max_work_items(size, self.max_seqs, self.tile)

    def _meta(self, size: int) -> AttentionMetadata:
        m, s = self.meta_i32, self.max_seqs
        work = WorkList(m[self._work_at:self._work_at + 4 * self._items(size)].view(-1, 4),
                        m[self._splits_at:self._splits_at + s])
        longest = self.max_blocks * self.block_size
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :size], query_start_loc=m[:s + 1], seq_lens=m[self._lens_at:self._lens_at + s],
            block_tables=self.block_tables, num_decodes=0, max_query_len=size, max_seq_len=longest,
            query_lens_cpu=[size], seq_lens_cpu=[longest], work=work)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.tokens[0, :size], self.tokens[1, :size], self._meta(size))

    @torch.inference_mode()
    def capture(self) -> "MixedGraphRunner":
        """Capture every bucket, largest first (the smaller ones reuse its memory). The work list is empty while
        they are: the warm-up forwards and the captures write nothing."""
        self.graphs, self.hidden = capture_largest_first(self.sizes, self._forward)
        return self

    def fits(self, step: StepInput) -> bool:
        """Steps of at most the largest bucket's tokens and max_num_seqs sequences, but for a chunk of at most
        SHORT_CHUNK tokens over a context past max_context and decodes whose contexts sum past max_decode_context
        (prompt logprobs included: the LM head runs eagerly on whichever rows ask)."""
        if not 0 < len(step.input_ids) <= self.max_tokens or len(step.seq_lens) > self.max_seqs:
            return False
        qsl, nd = step.query_start_loc, step.num_decodes
        if sum(step.seq_lens[:nd]) > self.max_decode_context:
            return False
        return all(b - a > SHORT_CHUNK or n <= self.max_context
                   for a, b, n in zip(qsl[nd:], qsl[nd + 1:], step.seq_lens[nd:]))

    def load(self, step: StepInput) -> int:
        """Copy the step into the static buffers (from pinned memory, without blocking); the bucket to replay."""
        n, ns = len(step.input_ids), len(step.seq_lens)
        size = next(s for s in self.sizes if s >= n)
        tokens = np.zeros((4, size), dtype=np.int64)
        tokens[0, :n], tokens[1, :n], tokens[2, :n] = step.input_ids, step.positions, step.slot_mapping
        tokens[2, n:] = -1
        rows = step.sample_indices + step.prompt_indices      # compute_logits' order: sampled, then prompt rows
        tokens[3, :len(rows)] = rows
        qsl = step.query_start_loc
        items, splits = work_items([b - a for a, b in zip(qsl, qsl[1:])], step.seq_lens, self._items(size), self.tile)
        meta = np.zeros(self._work_at + 4 * self._items(size), dtype=np.int32)
        meta[:ns + 1] = qsl
        meta[self._lens_at:self._lens_at + ns] = step.seq_lens
        meta[self._splits_at:self._splits_at + ns] = splits
        meta[self._work_at:] = items.reshape(-1)
        width = -(-max(step.seq_lens) // self.block_size)     # the blocks the contexts use (tables may hold more)
        self.tokens[:, :size].copy_(pinned(tokens), non_blocking=True)
        self.meta_i32[:len(meta)].copy_(pinned(meta), non_blocking=True)
        self.staged_tables.upload(step.block_tables, width, self.block_tables)
        return size

    def run(self, step: StepInput, prev_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor | None:
        """Replay the step's bucket; the logits of the sampled rows and then of the prompt-logprob rows, or None
        when there are none. prev_tokens: (rows, token ids) of input ids still on the device (overlapped
        scheduling)."""
        size = self.load(step)
        if prev_tokens is not None:
            self.tokens[0].index_copy_(0, *prev_tokens)
        self.graphs[size].replay()
        k = step.num_logit_rows
        if not k:
            return None
        return self.model.compute_logits(self.hidden[size].index_select(0, self.tokens[3, :k]))
