"""TritonAttentionBackend: the AttentionBackend contract of picovllm.layers.attention on Triton kernels."""
from __future__ import annotations

import torch

from picovllm.kernels.decode_attention import decode_attention
from picovllm.kernels.prefill_attention import prefill_attention
from picovllm.kernels.store_kv import store_kv
from picovllm.kernels.work_attention import work_attention
from picovllm.layers.attention import AttentionBackend, AttentionMetadata


SHORT_PREFILL = 16   # a prefill chunk of at most this many tokens attends through the decode kernel


class TritonAttentionBackend(AttentionBackend):
    """Decodes (the first num_decodes sequences) go to the split-K decode kernel, prefill chunks to
    the varlen prefill kernel (one short chunk alone to the decode kernel too: _short_prefill). Grid sizes come from the metadata's host-side lists: no syncs.
    Decode launches depend on the batch size alone, so decode steps can be CUDA-graph captured; given a work list
    (AttentionMetadata.work) every sequence goes to kernels/work_attention.py, whose launches the list sizes alone."""

    supports_cuda_graphs = True
    supports_work_lists = True
    accepts_stored_kv = True      # the model's rope_qkv stores K/V in its own launch (kernels/rotary.py)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, kv_scales=None, kv_stored: bool = False,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        out = torch.empty_like(q)
        if meta.work is not None:
            return work_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  meta.work.items, meta.work.splits, scale, out, window=window, softcap=softcap,
                                  kv_scales=kv_scales, sinks=sinks)
        nd = meta.num_decodes
        if nd:
            decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                             scale, out=out[:nd], window=window, softcap=softcap, kv_scales=kv_scales, sinks=sinks)
        num_prefills = meta.num_seqs - nd
        if num_prefills:
            max_q = max(meta.query_lens_cpu[nd:])
            if num_prefills == 1 and max_q <= SHORT_PREFILL:
                self._short_prefill(q, k_cache, v_cache, meta, max_q, scale, out, window, softcap, kv_scales, sinks)
            else:
                prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  nd, num_prefills, max_q, scale, out, window=window, softcap=softcap,
                                  kv_scales=kv_scales, sinks=sinks)
        return out

    @staticmethod
    def _short_prefill(q, k_cache, v_cache, meta: AttentionMetadata, max_q: int, scale: float, out,
                       window: int | None, softcap: float | None, kv_scales=None, sinks=None) -> None:
        """One prefill chunk of at most SHORT_PREFILL tokens (a suffix after a cached prefix, say) as that many
        decode rows: query token i sees the context and the chunk up to itself, seq_len - q_len + 1 + i keys,
        through the sequence's block table. The prefill kernel would give such a chunk one program per head,
        each streaming the whole context; the decode kernel splits the context across programs. Rows past
        the chunk's real length (a CUDA graph's padding) get length 0. The chunk is the batch's last
        sequence, so its tokens are rows nd .. nd + max_q - 1; device tensors only (no sync; capturable)."""
        nd = meta.num_decodes
        rows = slice(nd, nd + max_q)
        key = ("short_prefill", max_q)
        if key not in meta.scratch:           # once a step, for every layer
            start = meta.query_start_loc[nd:nd + 2]
            q_len = start[1] - start[0]
            i = torch.arange(max_q, dtype=torch.int32, device=q.device)
            lens = torch.where(i < q_len, meta.seq_lens[nd] - q_len + 1 + i, 0).to(torch.int32)
            # a fresh copy of the table row (not a stride-0 view, nor a row offset in the table: the decode kernel
            # then meets the same pointer alignment and strides as for decodes, the specialization the warm-up
            # compiled; Triton keys on both)
            meta.scratch[key] = lens, meta.block_tables[nd:nd + 1].expand(max_q, -1).clone()
        lens, tables = meta.scratch[key]
        decode_attention(q[rows], k_cache, v_cache, tables, lens, scale, out=out[rows], window=window,
                         softcap=softcap, kv_scales=kv_scales, sinks=sinks)
