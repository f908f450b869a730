"""TritonAttentionBackend: the AttentionBackend contract of picovllm.layers.attention on Triton kernels."""
from __future__ import annotations

import torch

from picovllm.kernels.decode_attention import decode_attention
from picovllm.kernels.prefill_attention import prefill_attention
from picovllm.kernels.store_kv import store_kv
from picovllm.layers.attention import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Decodes (the first num_decodes sequences) go to the split-K decode kernel, prefill chunks to
    the varlen prefill kernel. Grid sizes come from the metadata's host-side lists: no syncs.
    Decode launches depend on the batch size alone, so decode steps can be CUDA-graph captured."""

    supports_cuda_graphs = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, kv_scales=None) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                             scale, out=out[:nd], window=window, softcap=softcap, kv_scales=kv_scales)
        num_prefills = meta.num_seqs - nd
        if num_prefills:
            max_q = max(meta.query_lens_cpu[nd:])
            prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                              nd, num_prefills, max_q, scale, out, window=window, softcap=softcap,
                              kv_scales=kv_scales)
        return out
