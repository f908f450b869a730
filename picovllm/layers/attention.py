"""Attention over a flat varlen batch whose earlier context lives in the paged KV cache.

The model runner builds one AttentionMetadata per step and passes it down explicitly. A batch
is ordered decodes first (query length 1), then prefill chunks. An AttentionBackend writes the
step's new K/V into the cache by slot and computes attention; the torch backend here is the
reference (and the CPU path); kernels in picovllm.kernels implement the same contract.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from picovllm.layers.decode_plan import plan_decode


class WorkList(NamedTuple):
    items: torch.Tensor     # [I, 4] int32: (sequence, query tile, split, splits), -1 rows past the step's
    splits: torch.Tensor    # [S] int32: each sequence's splits (0 or 1 past the step's sequences)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor   # [B + 1] int32: where each sequence's new tokens start in the batch
    seq_lens: torch.Tensor          # [B] int32: context length of each sequence after this step
    # [B, max_blocks] int32; a row's entries past its table's end are stale (cuda_graph.StagedTables: any block id,
    # or SLID_OUT's -1), as those of blocks wholly before a sliding window are -1: a backend must not read them
    block_tables: torch.Tensor
    num_decodes: int                # the first num_decodes sequences have exactly one new token
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]       # host copies, so the reference backend never syncs
    seq_lens_cpu: list[int]
    # A work list (kernels/work_attention.py): set by the mixed-step CUDA graphs (engine/mixed_graph.py),
    # whose launches cannot depend on the step's layout; the host lists above then describe the capture,
    # not the step. Only a backend with supports_work_lists is given one.
    work: WorkList | None = None
    # What a backend derives from this step's metadata once and reuses in every layer, by its own key.
    scratch: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Computes attention for one layer. Called once per layer per step by Attention.forward.
    accepts_stored_kv: forward may be told that the caller has stored k, v in the cache already (kv_stored), in
    the kernel that computed them (kernels.rotary.rope_qkv); a backend that leaves it False always stores them.
    supports_work_lists: forward honours AttentionMetadata.work (engine/mixed_graph.py captures only such a
    backend); one that leaves it False is never given a work list."""

    accepts_stored_kv: bool = False
    supports_work_lists: bool = False

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, kv_scales: KVScales | None = None,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D].

        Must first store k, v at meta.slot_mapping (unless kv_stored: the caller has, with store_kv's
        result; only ever passed where accepts_stored_kv, and k, v may then be None), then return [T, Hq, D]
        where token t of sequence s, at position p = seq_lens[s] - query_len[s] + t, attends causally to positions
        0 .. p, or with a sliding window to the last `window` of them (p - window + 1 .. p, as HF's).
        softcap: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2).
        kv_scales: (k_scale, v_scale), each [Hkv] float32, when the caches are float8_e4m3fn: store
        quantize(x, scale), read dequantize(x8, scale) (below; engine/kv_scales.py says where scales come from).
        Every key and value attended to is then the one read back from the cache, the new tokens' too.
        A backend that cannot read fp8 must raise, never ignore them.
        sinks: [Hq] float32 (GPT-OSS's attention sinks): each query head's softmax also takes the logit sinks[h], a
        key whose value is 0, so out = sum_i exp(s_i) v_i / (sum_i exp(s_i) + exp(sinks[h])) over the scores s_i
        (already scaled). Passed as a keyword only when set, never with softcap; a backend that cannot must raise.
        """


KVScales = tuple[torch.Tensor, torch.Tensor]    # (k_scale, v_scale) of one layer, [Hkv] float32 each


class KVWrite(NamedTuple):
    """Where a kernel that computes a step's K/V may store them itself, as store_kv below would."""
    k_cache: torch.Tensor               # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor          # [T] int64; -1: a padding row, not stored
    kv_scales: KVScales | None          # given exactly when the caches are fp8
    # the cache's rotation (Attention.kv_rotation), if any: the kernel stores k R and v R, and returns q R and k R
    rotation: torch.Tensor | None = None


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                                 # e4m3fn's largest finite value


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H, D], scale [H] float32 -> fp8 x / scale, clamped to the format's range (computed in float32)."""
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 x8 [..., H, D], scale [H] -> x8 * scale (in float32), in dtype."""
    return (x8.float() * scale[:, None]).to(dtype)


def index_copy(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.index_copy_(dim, index, src) for any cache dtype: fp8 goes through byte views (the CPU has no
    index_copy_ for float8); src is cast to dst's dtype and device."""
    src = src.to(dst.device, dst.dtype)
    if dst.dtype == FP8_DTYPE:
        return dst.view(torch.uint8).index_copy_(dim, index, src.view(torch.uint8))
    return dst.index_copy_(dim, index, src)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
    h, d = k_cache.shape[-2:]
    if kv_scales is not None:
        k, v = quantize(k, kv_scales[0]), quantize(v, kv_scales[1])
    index_copy(k_cache.view(-1, h, d), 0, slot_mapping, k)
    index_copy(v_cache.view(-1, h, d), 0, slot_mapping, v)


def _read(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., Hkv, D] as the model's dtype: dequantized when the cache is fp8."""
    return x if scale is None else dequantize(x, scale, dtype)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, H, D] cache, block ids [*shape] -> those blocks [*shape, bs, H, D].

    index_select on the cache viewed as one row per block copies whole blocks; on the CPU it is
    several times faster than advanced indexing (cache[block_ids]), which copies element-wise.
    """
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape, *cache.shape[1:])


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
    """[num_blocks, bs, H, D] cache, one sequence's block table -> its tokens start .. length - 1 [length - start,
    H, D] (blocks wholly before `start` are not read)."""
    bs = cache.shape[1]
    first, n = start // bs, -(-length // bs)
    return gather_blocks(cache, block_table[first:n]).flatten(0, 1)[start - first * bs:length - first * bs]


def attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention, q [..., Hq, M, D] over keys/values [..., Hkv, L, D] (Hq a multiple of Hkv); mask: bool
    (True = visible) or additive, broadcast to the scores [..., Hq, M, L]; sinks: broadcast to [..., Hq, M, 1], a
    zero-valued key's logit per row (AttentionBackend.forward). SDPA, unless the scores are soft-capped (Gemma 2)
    or have sinks (GPT-OSS), which SDPA cannot do: then the same math spelled out, in float32."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale, enable_gqa=True)
    g = q.shape[-3] // keys.shape[-3]
    keys, vals = keys.repeat_interleave(g, -3).float(), vals.repeat_interleave(g, -3).float()
    s = q.float() @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if sinks is None:
        return (s.softmax(-1) @ vals).to(q.dtype)
    s = torch.cat([s, sinks.float().expand(*s.shape[:-1], 1)], dim=-1)     # the sink's column, dropped after
    return (s.softmax(-1)[..., :-1] @ vals).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None, softcap=None, kv_scales=None, sinks=None):
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        ks, vs = kv_scales if kv_scales is not None else (None, None)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, window, softcap, kv_scales, sinks)
        starts = meta.query_start_loc.tolist() if meta.num_seqs > nd else []
        for s in range(nd, meta.num_seqs):
            a, b = starts[s], starts[s + 1]
            seq_len = meta.seq_lens_cpu[s]
            if b - a == seq_len and kv_scales is None:   # all new: its K/V are k, v themselves
                out[a:b] = self._attend(q[a:b], k[a:b], v[a:b], scale, window, softcap, sinks)
            else:                    # keys from the first one the chunk's first query sees
                first = 0 if window is None else max(0, seq_len - (b - a) - window + 1)
                keys = _read(gather_kv(k_cache, meta.block_tables[s], seq_len, first), ks, q.dtype)
                vals = _read(gather_kv(v_cache, meta.block_tables[s], seq_len, first), vs, q.dtype)
                out[a:b] = self._attend(q[a:b], keys, vals, scale, window, softcap, sinks)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, scale, window=None, softcap=None, kv_scales=None, sinks=None):
        """q: the num_decodes decode rows [nd, Hq, D] (one token each) -> their output, by length groups."""
        nd = meta.num_decodes
        key = ("torch_decode", k_cache.shape[1], q.dtype, window)
        plan = meta.scratch.get(key)
        if plan is None:
            plan = meta.scratch[key] = plan_decode(meta.seq_lens_cpu[:nd], meta.block_tables[:nd],
                                                   k_cache.shape[1], q.dtype, window)
        hq, d = q.shape[1:]
        hkv = k_cache.shape[2]
        ks, vs = kv_scales if kv_scales is not None else (None, None)
        out = torch.empty_like(q)
        for g in plan:
            qg = q if g.rows is None else q.index_select(0, g.rows)
            keys = _read(gather_blocks(k_cache, g.block_ids), ks, q.dtype).flatten(1, 2).transpose(1, 2)  # [n,Hkv,L,D]
            vals = _read(gather_blocks(v_cache, g.block_ids), vs, q.dtype).flatten(1, 2).transpose(1, 2)
            # The query heads of one KV head act as its "query length": no KV head is expanded.
            sink = None if sinks is None else sinks.view(hkv, hq // hkv, 1)
            o = attend(qg.reshape(-1, hkv, hq // hkv, d), keys, vals, g.mask, scale, softcap, sink).reshape(-1, hq, d)
            if g.rows is None:
                return o
            out.index_copy_(0, g.rows, o)
        return out

    @staticmethod
    def _attend(q, keys, vals, scale, window=None, softcap=None, sinks=None):
        """q [ql, Hq, D], the sequence's last keys/values [L, Hkv, D]: the last ql positions attend causally
        (within the window)."""
        ql, seq_len = q.shape[0], keys.shape[0]
        # 4-D [1, H, L, D]: on the CPU, 3-D inputs miss SDPA's flash kernel and run 2-3x slower.
        q, keys, vals = (x.transpose(0, 1)[None] for x in (q, keys, vals))
        if ql == seq_len and window is None and softcap is None and sinks is None:
            o = F.scaled_dot_product_attention(q, keys, vals, is_causal=True, scale=scale, enable_gqa=True)
        else:
            pos_q = torch.arange(seq_len - ql, seq_len, device=q.device)[:, None]
            pos_k = torch.arange(seq_len, device=q.device)[None, :]
            mask = pos_k <= pos_q
            if window is not None:
                mask &= pos_k > pos_q - window
            o = attend(q, keys, vals, mask, scale, softcap, None if sinks is None else sinks.view(-1, 1, 1))
        return o[0].transpose(0, 1)


def _rotary_kernels():
    from picovllm.kernels import rotary   # triton: imported only where a Triton backend asks (kv_write)
    return rotary


def kv_rotation(head_dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """R [D, D], orthonormal and symmetric (R @ R = I): Sylvester's Hadamard matrix of the largest power of two
    dividing D, repeated along the diagonal, divided by its norm. An fp8 cache holds K R and V R: a head's few
    outlier channels spread over all of them, so e4m3's relative rounding no longer falls mostly on the channels
    that carry the scores. (q R)(k R)^T = q k^T and (sum p v R) R = sum p v, so attention is unchanged apart from
    the rounding (Attention.forward). Default model, 6,039 tokens, float32 weights: fp8 KV's perplexity +1.39%
    over float KV without the rotation, +0.40% with it (BENCHMARKS.md)."""
    n = head_dim & -head_dim
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h / math.sqrt(n)] * (head_dim // n)).to(device, dtype)


class Attention(nn.Module):
    """Holds this layer's view of the KV cache (bound by the model runner) and its backend.
    scale: of the scores (default head_dim ** -0.5); sliding_window: attend to the last this many positions
    only (None: all); softcap: soft-cap the scores (see AttentionBackend.forward); sinks: [num_heads] float32
    logits of a zero-valued key per head (GPT-OSS; AttentionBackend.forward), set by the model; kv_scales: this layer's
    (k_scale, v_scale) when the cache is fp8 (bound by the model runner with the cache, else None), and then
    kv_rotation too: q, k and v enter the backend times it, and the output leaves times it (kv_rotation()), unless
    output_rotated: the output projection's weight holds the rotation (engine/kv_scales.py fold_output_rotations)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window, self.softcap = sliding_window, softcap
        self.sinks: torch.Tensor | None = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_scales: KVScales | None = None
        self.kv_rotation: torch.Tensor | None = None
        self.output_rotated = False
        self.backend: AttentionBackend = TorchAttentionBackend()

    def kv_write(self, meta: AttentionMetadata) -> KVWrite | None:
        """Where the kernel that computes this step's K/V may store them (then forward(..., kv_stored=True)), or
        None: the backend stores them (it cannot skip its store, no cache is bound, or the cache's rotation is
        one that kernel cannot apply: kernels.rotary.rotation_fits)."""
        if not self.backend.accepts_stored_kv or self.k_cache is None:
            return None
        r = self.kv_rotation
        if r is not None and not _rotary_kernels().rotation_fits(self.head_dim, r):
            return None
        return KVWrite(self.k_cache, self.v_cache, meta.slot_mapping, self.kv_scales, r)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_stored: bool = False) -> torch.Tensor:
        """kv_stored: k, v are in the cache already, written where kv_write(meta) said; with a rotation, that
        kernel also returned q and k rotated (v is not, and the backend reads a stored step's K/V from the cache)."""
        r = self.kv_rotation
        if r is not None and not kv_stored:
            q, k, v = q @ r, k @ r, v @ r
        # the keywords only when set: a backend that cannot skip its store need not take it
        extra = {"kv_stored": True} if kv_stored else {}
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window,
                                   self.softcap, self.kv_scales, **extra)
        return out if r is None or self.output_rotated else out @ r
