"""CUDA graphs for small prefill steps (EngineConfig.prefill_cuda_graphs; on by default for one GPU).

An eager prefill launches ~10 kernels per layer from Python; for a prompt of a few hundred tokens that host
work, not the GPU, sets the time to first token. A step that is one prefill chunk of at most PREFILL_BUCKETS[-1]
tokens (no decodes beside it, no prompt logprobs) is padded to the next bucket and replays the forward and LM
head captured for that bucket, with or without prefix-cached context before the chunk.

Every tensor the graph reads lives in a static buffer here: token ids, positions and slots; the query start,
the sequence length and the block table in one int32 buffer (each at a 16-byte offset). The attention launches
are sized by the bucket on the host (query tiles past the chunk's real length return at once, the kernels read
the real length and context from the buffers), so one graph serves every chunk length and context up to
max_model_len. Padding tokens get slot -1 (the KV store skips them); their rows flow through the row-wise
layers and are never read: the LM head reads the chunk's last real row through a static index.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from picovllm.engine.cuda_graph import capture_largest_first, pinned
from picovllm.layers.attention import AttentionMetadata

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
META_OFFSET = 8   # int32 buffer: query start [0, n] at 0, the sequence length at 4, the block table from 8


def prefill_buckets(max_num_batched_tokens: int) -> list[int]:
    """The token counts captured: the buckets a chunk can reach under the step budget (at least the smallest)."""
    return [b for b in PREFILL_BUCKETS if b <= max_num_batched_tokens] or [PREFILL_BUCKETS[0]]


class PrefillGraphRunner:
    def __init__(self, model: nn.Module, max_num_batched_tokens: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.sizes = prefill_buckets(max_num_batched_tokens)
        self.max_tokens = min(self.sizes[-1], max_num_batched_tokens)
        self.max_blocks = max_blocks_per_seq
        self.tokens = torch.zeros(3, self.sizes[-1], dtype=torch.long, device=device)   # ids, positions, slots
        self.tokens[2].fill_(-1)
        self.meta_i32 = torch.zeros(META_OFFSET + max_blocks_per_seq, dtype=torch.int32, device=device)
        self.sample_row = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        longest = self.max_blocks * self.block_size
        m = self.meta_i32
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :size], query_start_loc=m[0:2], seq_lens=m[4:5],
            block_tables=m[META_OFFSET:].view(1, self.max_blocks), num_decodes=0, max_query_len=size,
            max_seq_len=longest, query_lens_cpu=[size], seq_lens_cpu=[longest])

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.tokens[0, :size], self.tokens[1, :size], self._meta(size))
        return self.model.compute_logits(hidden.index_select(0, self.sample_row))

    @torch.inference_mode()
    def capture(self, pool=None) -> "PrefillGraphRunner":
        """Capture every bucket, largest first (the smaller ones reuse its memory); pool: share another runner's."""
        self.meta_i32[:2] = torch.tensor([0, 1], dtype=torch.int32)   # a 1-token chunk in the warm-up forwards
        self.meta_i32[4] = 1
        self.graphs, self.logits = capture_largest_first(self.sizes, self._forward, pool)
        return self

    def fits(self, step) -> bool:
        return (step.num_decodes == 0 and len(step.seq_lens) == 1 and not step.prompt_indices
                and 0 < len(step.input_ids) <= self.max_tokens and len(step.block_tables[0]) <= self.max_blocks)

    def run(self, step) -> torch.Tensor | None:
        """Replay the bucket's graph for a one-chunk prefill step; its sampled row's logits [1, vocab], or None
        when the chunk does not sample (a prompt's earlier chunk). A prefill reads no token still in flight."""
        assert not step.prev_dst, "only decodes read tokens of the step in flight"
        n = len(step.input_ids)
        size = next(s for s in self.sizes if s >= n)
        table = step.block_tables[0]
        tokens = pinned(np.array([step.input_ids, step.positions, step.slot_mapping], dtype=np.int64))
        meta = np.zeros(META_OFFSET + len(table), dtype=np.int32)
        meta[1], meta[4], meta[META_OFFSET:] = n, step.seq_lens[0], table
        self.tokens[:, :n].copy_(tokens, non_blocking=True)
        if size > n:
            self.tokens[2, n:size].fill_(-1)
        self.meta_i32[:len(meta)].copy_(pinned(meta), non_blocking=True)
        self.sample_row.fill_(n - 1)
        self.graphs[size].replay()
        return self.logits[size] if step.sample_indices else None
