"""Routed experts on the GPU: each token's k (token, expert) pairs grouped by expert, then one grouped GEMM per
projection, each program multiplying a tile of one expert's rows by that expert's weight.

Layout (no host sync, so a decode step stays CUDA-graph capturable): the T*k pairs, sorted by expert, are laid out
in segments padded to BLOCK_M rows, so every row tile belongs to one expert; `rows` holds each slot's pair index
(-1 for padding) and `tile_expert` each tile's expert (-1 past the last segment). The sizes are worst-case bounds
(T*k + E*(BLOCK_M-1) slots), known on the host. gate_up: x's rows gathered by token (pair // k) -> [T*k, 2I];
the activation; down: rows by pair, scaled by the routing weight -> [T*k, H]; the k rows of a token summed.
The torch reference is picovllm.layers.moe.experts_reference.

A decode step's routing is two launches (route_topk: softmax, top-k and renormalisation per token; a counting sort
for group_by_expert, a program per expert), where torch's ops took about twenty small kernels a layer; larger
batches (prefill chunks) group with torch (group_by_expert_torch, the sort kernel's reference). The sort ran in one
program before: 101.5 us for a batch-256 step's 2048 pairs on an H200, against 5.9 us now (BENCHMARKS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from picovllm.kernels.decode_attention import dot_precision
from picovllm.kernels.fp8_gemm import block_divisor, scale_grid


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, rows_ptr, tile_expert_ptr, scale_ptr, bias_ptr, w_scale_ptr, N, K,
                         stride_am, stride_we, stride_wn, stride_om, stride_be, stride_se, stride_sn, stride_sk, SBN,
                         SBK, A_DIV: tl.constexpr, SCALE: tl.constexpr, BIAS: tl.constexpr, W_SCALE: tl.constexpr,
                         W_BLOCKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """out[pair] = (a[pair // A_DIV] @ (w[expert] (* its scales)).T (+ bias[expert])) (* scale[pair]) for the pairs
    of one row tile. W_SCALE: w is float8 (layers/fp8_weights.py), widened to a's dtype tile by tile; each output
    feature's sum times its row's scale, or (W_BLOCKED) each chunk's sums times the scales of their SBN x SBK blocks
    (BLOCK_K divides SBK)."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(rows_ptr + offs_m)
    valid = pairs >= 0
    a_rows = tl.where(valid, pairs // A_DIV, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & (k[None, :] < K),
                    other=0.0)
        b = tl.load(w + offs_n[None, :] * stride_wn + k[:, None], mask=(offs_n[None, :] < N) & (k[:, None] < K),
                    other=0.0)   # [BLOCK_K, BLOCK_N]: the expert's weight, transposed
        if W_SCALE:
            b = b.to(a.dtype)
        if W_BLOCKED:
            s = tl.load(w_scale_ptr + expert.to(tl.int64) * stride_se + (offs_n // SBN) * stride_sn
                        + (k0 // SBK) * stride_sk, mask=offs_n < N, other=0.0)
            acc += tl.dot(a, b, input_precision=DOT_PRECISION) * s[None, :]
        else:
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if W_SCALE and not W_BLOCKED:
        acc *= tl.load(w_scale_ptr + expert.to(tl.int64) * stride_se + offs_n * stride_sn, mask=offs_n < N,
                       other=0.0)[None, :]
    if BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=offs_n < N,
                       other=0.0).to(tl.float32)[None, :]
    if SCALE:
        acc *= tl.load(scale_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = out_ptr + tl.where(valid, pairs, 0).to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


@triton.jit
def _to_f16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    x = tl.clamp(x, -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL)    # float16's largest; NaN stays
    tl.store(out_ptr + offs, x.to(tl.float16), mask=offs < n)


def to_f16(x: torch.Tensor) -> torch.Tensor:
    """x in float16, saturated at float16's largest finite value (one pass; NaN stays NaN): float8 experts'
    activations, whose dots then widen the weights in one instruction per two values (fused_experts)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    if x.numel():
        _to_f16_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024, num_warps=4)
    return out


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token: softmax over its experts' logits in float32, the TOP_K largest in descending order (repeated
    argmax), renormalised to sum to 1 if asked (layers.moe.route)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + offs, mask=offs < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    # the experts not taken yet (probabilities are >= 0); a NaN one (NaN or inf logits) ranks above every other, as
    # in torch.topk, so that every id is an expert's: a NaN compares false, and the padding lanes' -1 would win
    left = tl.where(offs < num_experts, tl.where(p != p, float("inf"), p), -1.0)
    k = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], tl.float32)
    ids = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(left, 0)
        weights = tl.where(k == j, tl.sum(tl.where(offs == best, p, 0.0), 0), weights)   # p[best], NaN kept
        ids = tl.where(k == j, best, ids)
        left = tl.where(offs == best, -1.0, left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + t * TOP_K + k, weights, mask=k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """layers.moe.route in one launch: [T, E] logits -> (weights [T, k] float32, expert ids [T, k] int64)."""
    t, e = router_logits.shape
    if not 1 <= top_k <= e:     # past E the kernel would take padding lanes: NaN weights, ids past the experts
        raise ValueError(f"route_topk: top_k must be in [1, {e}] (the experts), got {top_k}")
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t:
        _route_kernel[(t,)](router_logits, weights, ids, e, router_logits.stride(0), TOP_K=top_k,
                            K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                            BLOCK_E=triton.next_power_of_2(e))
    return weights, ids


@triton.jit
def _group_kernel(ids_ptr, rows_ptr, tile_expert_ptr, num_pairs, num_slots, num_experts,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """group_by_expert_torch's layout by a counting sort, one program per expert plus one for the end. Each program
    counts every expert's pairs (a histogram a CHUNK of pairs; bin num_experts takes the chunk's padding) and from
    them places the segments (padded to BLOCK_M). Program e < num_experts then writes expert e's pairs into its
    segment in pair order (stable, as the reference's sort), -1 into the segment's padding, and e as the expert of
    the segment's tiles; program num_experts writes -1 into every slot and tile after the last segment."""
    me = tl.program_id(0)
    c = tl.arange(0, CHUNK)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + p0 + c, mask=p0 + c < num_pairs, other=num_experts).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E)
    counts = tl.where(e < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    seg_end = tl.cumsum(padded, 0)
    # No branch on the end program: triton 3.6 on sm_90 miscompiled an if/else reassigning seg_start (every program
    # read 48 after it, for one 16-expert batch, on an H100); the end program's pairs loop finds no pair of its own.
    end = me == num_experts
    seg_start = tl.where(end, tl.sum(padded, 0), tl.sum(tl.where(e == me, seg_end - padded, 0), 0))
    seg_stop = tl.where(end, num_slots, tl.sum(tl.where(e == me, seg_end, 0), 0))
    placed = seg_start * 0    # this expert's pairs written so far
    for p0 in range(0, num_pairs, CHUNK):
        pair = p0 + c
        hit = (tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1) == me).to(tl.int32)
        tl.store(rows_ptr + seg_start + placed + tl.cumsum(hit, 0) - hit, pair, mask=hit != 0)
        placed += tl.sum(hit, 0)
    pad_from = seg_start + placed
    for s0 in range(pad_from, seg_stop, CHUNK):
        tl.store(rows_ptr + s0 + c, tl.full([CHUNK], -1, tl.int32), mask=s0 + c < seg_stop)
    expert = tl.where(me < num_experts, me, -1)
    for t0 in range(seg_start // BLOCK_M, seg_stop // BLOCK_M, CHUNK):
        tl.store(tile_expert_ptr + t0 + c, tl.zeros([CHUNK], tl.int32) + expert, mask=t0 + c < seg_stop // BLOCK_M)


# group_by_expert sorts up to this many pairs in its kernel (decode batches, prefill chunks of up to 4k tokens at
# top-8); more go to torch's sort. Each of the kernel's programs reads every pair, so its time grows with the pairs
# where the sort's stays near its launch cost: on an H200 (8-128 experts) the kernel took 51-73 us at 32,768 pairs
# against torch's 124-126, and 144 against 138 at 65,536 for 128 experts (BENCHMARKS.md)
GROUP_KERNEL_MAX_PAIRS = 32768


def _num_slots(pairs: int, num_experts: int, block_m: int) -> int:
    """Slots for `pairs` pairs in segments padded to block_m, whatever the experts' counts (a whole tile's worth)."""
    slots = pairs + num_experts * (block_m - 1)
    return -(-slots // block_m) * block_m


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (rows [slots] int32: pair index per slot, -1 for padding; tile_expert [slots / block_m] int32:
    each row tile's expert, -1 past the end). Expert segments are padded to block_m rows. Up to
    GROUP_KERNEL_MAX_PAIRS pairs: _group_kernel; more: group_by_expert_torch."""
    pairs = ids.numel()
    if pairs > GROUP_KERNEL_MAX_PAIRS:
        return group_by_expert_torch(ids, num_experts, block_m)
    slots = _num_slots(pairs, num_experts, block_m)
    rows = torch.empty(slots, dtype=torch.int32, device=ids.device)
    tile_expert = torch.empty(slots // block_m, dtype=torch.int32, device=ids.device)
    _group_kernel[(num_experts + 1,)](ids.contiguous(), rows, tile_expert, pairs, slots, num_experts, BLOCK_M=block_m,
                                      BLOCK_E=triton.next_power_of_2(num_experts + 1), CHUNK=1024, num_warps=4)
    return rows, tile_expert


def group_by_expert_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """group_by_expert in torch ops (a stable sort of the pairs by expert): larger batches, and the kernel's
    reference."""
    flat = ids.flatten()
    pairs, e = flat.numel(), num_experts
    dev = ids.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    seg_end = padded.cumsum(0)
    rank = torch.arange(pairs, device=dev) - (counts.cumsum(0) - counts)[flat[order]]   # place within its expert
    slots = _num_slots(pairs, e, block_m)
    rows = torch.full((slots,), -1, dtype=torch.int32, device=dev)
    rows[(seg_end - padded)[flat[order]] + rank] = order.to(torch.int32)
    starts = torch.arange(0, slots, block_m, device=dev)
    tile_expert = torch.searchsorted(seg_end, starts, right=True)
    tile_expert = torch.where(tile_expert < e, tile_expert, -1).to(torch.int32)
    return rows, tile_expert


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, tile_expert: torch.Tensor, num_pairs: int,
                 a_div: int, scale: torch.Tensor | None = None, block_m: int = 16, block_n: int = 64,
                 block_k: int = 128, num_warps: int = 4, num_stages: int = 3,
                 bias: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                 w_block: tuple[int, int] | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [*, K]; w [E, N, K]; bias [E, N] or None; for a float8 w its float32 scales w_scale, [E, N] one a row, or
    with w_block (bn, bk) [E, ceil(N / bn), ceil(K / bk)] one a block -> out [num_pairs, N] in out_dtype (a's by
    default) (see _grouped_gemm_kernel; tiles: expert_tiles)."""
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=out_dtype or a.dtype, device=a.device)
    grid_args = (0, 0, 0, 1, 1)
    if w_scale is not None:
        grid_args = (w_scale.stride(0), *scale_grid(w_scale[0], w_block))
        if w_block is not None:
            block_k = min(block_k, block_divisor(w_block[1]))
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, rows, tile_expert, scale if scale is not None else out, bias if bias is not None else out,
        w_scale if w_scale is not None else out, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        bias.stride(0) if bias is not None else 0, *grid_args, A_DIV=a_div, SCALE=scale is not None,
        BIAS=bias is not None, W_SCALE=w_scale is not None, W_BLOCKED=w_block is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=dot_precision(a.dtype), num_warps=num_warps,
        num_stages=num_stages)
    return out


def expert_tiles(pairs: int, num_experts: int) -> dict:
    """grouped_gemm's tile for this many (token, expert) pairs: decode batches (a few rows an expert) stream each
    expert's weight in 16-row tiles; prefill chunks, with 32-128+ rows an expert, take the big tensor-core tiles. On
    an H200 at Qwen3-30B-A3B's shapes (BENCHMARKS.md): 16-row tiles 3.2-4.2 TB/s of weights at 8-256 tokens;
    128x128 tiles 3.4x faster than 16-row ones at 16k tokens, 64x128 1.3x at 512."""
    per_expert = pairs / num_experts
    if per_expert >= 128:
        return dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    if per_expert >= 32:
        return dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
    return dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, act, gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None, gate_up_scale: torch.Tensor | None = None,
                  down_scale: torch.Tensor | None = None, w_block: tuple[int, int] | None = None) -> torch.Tensor:
    """As experts_reference: x [T, H]; weights (float32), ids [T, k]; gate_up [E, 2I, H]; down [E, H, I]; the
    biases [E, 2I] and [E, H] (GPT-OSS's) or None; for float8 weights their scales (grouped_gemm's w_scale: one a
    row, [E, 2I] and [E, H], or one a w_block).

    Float8 experts under bfloat16 activations take their dots in float16: the GEMMs' inputs (x, the activation's
    output) pass to float16 saturated at its largest value (to_f16), the outputs stay x's dtype. Every e4m3 value is
    exact in float16 and widens in one instruction per two values, where e4m3 -> bfloat16 takes four; on an H100 that
    made a layer's experts 1.17x faster at 256 tokens and 1.46x at one (BENCHMARKS.md)."""
    t, top_k = ids.shape
    tiles = expert_tiles(t * top_k, gate_up.shape[0])   # from shapes alone: the same in every replay of a graph
    rows, tile_expert = group_by_expert(ids, gate_up.shape[0], tiles["block_m"])
    x = x.contiguous()
    f16 = to_f16 if gate_up_scale is not None and x.dtype == torch.bfloat16 else (lambda v: v)
    h = act(grouped_gemm(f16(x), gate_up, rows, tile_expert, t * top_k, top_k, bias=gate_up_bias,
                         w_scale=gate_up_scale, w_block=w_block, out_dtype=x.dtype, **tiles))
    y = grouped_gemm(f16(h), down, rows, tile_expert, t * top_k, 1, weights.flatten().contiguous(), bias=down_bias,
                     w_scale=down_scale, w_block=w_block, out_dtype=x.dtype, **tiles)
    return y.view(t, top_k, down.shape[1]).sum(1, dtype=torch.float32).to(x.dtype)   # -1 is ambiguous at 0 tokens
