"""quantization="fp8": the weights of every linear layer and routed expert in float8 e4m3, quantized as the model
loads (vLLM's online `--quantization fp8`, with a scale per output feature where vLLM takes one per tensor).

Each output feature (a row of W [N, K]) gets scale = max |row| / 448 (e4m3's largest finite value) and its weights
become round-to-nearest e4m3 codes of w / scale. Activations, sums, norms, the embedding and the LM head keep the
model's dtype (weight-only quantization): a decode step reads half the bytes of bfloat16 weights, which is what
bounds it at small batches and for mixture-of-experts models (kernels/fp8_gemm.py, kernels/moe.py).

Under tensor parallelism a row-parallel layer (o_proj, down_proj, an expert's down projection) holds a slice of each
row: its rows' maxima are taken over every rank (an all-reduce of the max), so every rank count gives the same codes
and scales. On the CPU the weights keep float32, holding exactly the values the GPU's codes times scales give
(`keep_fp8=False`): the model computes what the fp8 model computes, and its fast float32 kernels still apply, but
no memory is saved. fp8_linear_reference is the torch reference of the GPU kernels.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picovllm import kernels
from picovllm.distributed import TPGroup

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


Block = tuple[int, int] | None      # (rows, cols) a scale covers; None: one scale a row (an output feature)


def row_scales(amax: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """Rows' (or blocks') largest magnitudes -> their float32 scales (an all-zero one gets 1); pow2: the next power
    of two up (an FP8 checkpoint's ue8m0 scales)."""
    amax = amax.to(torch.float32)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return torch.exp2(torch.ceil(torch.log2(scale))) if pow2 else scale


def _by_block(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [..., N, K] -> [..., N / bn, bn, K / bk, bk], zero-padded to whole blocks."""
    bn, bk = block
    n, k = w.shape[-2:]
    w = F.pad(w, (0, -k % bk, 0, -n % bn))
    return w.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))


def _expand(scale: torch.Tensor, block: Block, shape: torch.Size) -> torch.Tensor:
    """A weight's scales, one per element of a weight of `shape` (rows' [..., N] or blocks' [..., N / bn, K / bk])."""
    if block is None:
        return scale[..., None]
    n, k = shape[-2:]
    return scale.repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]


def quantize_rows(w: torch.Tensor, amax: torch.Tensor | None = None, block: Block = None,
                  pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (codes [..., N, K] float8 e4m3, scales float32) with codes * scales ~ w: scales [..., N], one
    a row, or with block (bn, bk) [..., ceil(N / bn), ceil(K / bk)], one a block (pow2: powers of two). amax: each
    row's largest magnitude, where it spans more than w holds (a tensor-parallel slice)."""
    if amax is None:
        amax = w.abs().amax(-1) if block is None else _by_block(w.abs(), block).amax((-3, -1))
    scale = row_scales(amax, pow2)
    codes = (w.to(torch.float32) / _expand(scale, block, w.shape)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: Block = None) -> torch.Tensor:
    return (codes.to(torch.float32) * _expand(scale, block, codes.shape)).to(dtype)


def fp8_linear_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None, block: Block = None) -> torch.Tensor:
    """x @ (codes * scales).T (+ bias): kernels/fp8_gemm.fp8_linear's reference."""
    return F.linear(x, dequantize(codes, scale, x.dtype, block), bias)


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               block: Block = None) -> torch.Tensor:
    """A float8 linear layer's forward: the Triton kernel where the layers run theirs, else the reference."""
    if kernels.use_triton(x):
        from picovllm.kernels.fp8_gemm import fp8_linear as kernel   # triton: imported at the first GPU call
        return kernel(x, codes, scale, bias, block)
    return fp8_linear_reference(x, codes, scale, bias, block)


def has_float8(device: torch.device) -> bool:
    """Whether the device computes with float8 e4m3 (Triton's fp8e4nv): the CPU, or a GPU of compute capability
    8.9+ (Ada, Hopper). fp8 weights and the fp8 KV cache need it."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8_weights(source, device: torch.device) -> None:
    """ValueError naming EngineConfig.quantization where "fp8" cannot run: a GGUF (already quantized in its own
    form), a GPU without float8 e4m3 (Triton's fp8e4nv: compute capability 8.9+)."""
    if source.stored_weights is not None:
        raise ValueError("EngineConfig.quantization 'fp8' quantizes an HF folder's weights at load; a GGUF runs in its "
                         "own quantized form with 'auto' (or dequantized with 'none')")
    if not has_float8(device):
        raise ValueError("EngineConfig.quantization 'fp8' needs a GPU with float8 e4m3 (compute capability 8.9+: Ada, "
                         f"Hopper), this one is {torch.cuda.get_device_name(device)}")


def _fits(m: nn.Module, block: tuple[int, int]) -> bool:
    """Whether module m's weight, as this rank holds it, falls on the checkpoint's bn x bk blocks: every fused part
    (q, k, v; gate, up) and tensor-parallel slice starts and ends on a block boundary. Where not, its blocks here
    would mix the checkpoint's, and its codes would not come back."""
    from picovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from picovllm.layers.moe import FusedMoE
    bn, bk = block
    if isinstance(m, QKVParallelLinear):
        d = m.head_dim
        return all(x % bn == 0 for x in (m.num_heads * d, m.num_kv_heads * d, m.q_head_start * d,
                                          m.kv_head_start * d))
    if isinstance(m, MergedColumnParallelLinear):
        return all(size % bn == 0 for size in m.out_sizes)
    if isinstance(m, RowParallelLinear):
        return m.tp.size == 1 or (m.in_start % bk == 0 and m.weight.shape[1] % bk == 0)
    if isinstance(m, FusedMoE):      # gate and up fused; down's columns sliced by rank
        return m.inter % bn == 0 and (m.tp.size == 1 or m.inter % bk == 0)
    return m.tp.size == 1 or m.weight.shape[0] % bn == 0        # a column-parallel slice


def _fits_on_every_rank(m: nn.Module, block: tuple[int, int]) -> bool:
    """_fits, agreed by the layer's ranks: their slices differ (uneven KV-head splits), and a rank that took per-row
    scales alone would all-reduce its rows' maxima with ranks that do not."""
    fits = _fits(m, block)
    if m.tp.size > 1:
        flag = torch.tensor([int(fits)], device=next(m.parameters()).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=m.tp.group)
        fits = bool(flag.item())
    return fits


def _quantize_param(module: nn.Module, name: str, sliced_rows: bool, tp: TPGroup, keep_fp8: bool,
                    block: Block, pow2: bool) -> None:
    """module.<name> (a float weight [..., N, K]) -> float8 codes, with module.<name>_scale (rows' [..., N] or
    blocks') and module.<name>_block; or, keep_fp8 False, the same values in the weight's own dtype. sliced_rows:
    each rank holds a slice of every row (row-parallel), so a row's maximum is taken over the ranks too (blocks are
    each rank's own)."""
    w = getattr(module, name)
    amax = None
    if block is None and sliced_rows and tp.size > 1:
        amax = w.data.abs().amax(-1).to(torch.float32)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
    codes, scale = quantize_rows(w.data, amax, block, pow2 and block is not None)
    if keep_fp8:
        setattr(module, name, nn.Parameter(codes, requires_grad=False))
        getattr(module, name).weight_loader = getattr(w, "weight_loader", None)
        module.register_buffer(name + "_scale", scale, persistent=False)
        setattr(module, name + "_block", block)
    else:
        w.data.copy_(dequantize(codes, scale, w.dtype, block))


def quantize_model_weights(model: nn.Module, keep_fp8: bool, block: Block = None, pow2_scales: bool = False,
                           only: frozenset[str] | None = None) -> int:
    """quantization="fp8" on a loaded model: every ColumnParallelLinear and RowParallelLinear weight and every
    FusedMoE's expert weights, in place (module docstring). block: a scale per block of that shape (an FP8
    checkpoint's own, pow2_scales: its scales powers of two), so that its codes come back, rather than per row; a
    layer whose fused parts or tensor-parallel slice do not fall on those blocks takes a scale per row (a warning
    says how many). only: the parameter names to quantize (an FP8 checkpoint's float8 ones), None: all. Returns how
    many tensors were quantized."""
    from picovllm.layers.linear import ColumnParallelLinear, RowParallelLinear
    from picovllm.layers.moe import FusedMoE
    n, per_row = 0, []
    for name, m in list(model.named_modules()):
        linear = isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight.dim() == 2 \
            and m.weight.dtype.is_floating_point and m.weight.dtype != FP8
        experts = isinstance(m, FusedMoE) and m.experts.gate_up_proj.dtype != FP8
        params = [f"{name}.weight"] if linear else [f"{name}.experts.gate_up_proj", f"{name}.experts.down_proj"]
        if not (linear or experts) or (only is not None and not all(p in only for p in params)):
            continue
        mine = block if block is None or _fits_on_every_rank(m, block) else None
        if mine != block:
            per_row.append(name)
        if linear:
            _quantize_param(m, "weight", isinstance(m, RowParallelLinear), m.tp, keep_fp8, mine, pow2_scales)
            n += 1
        else:
            _quantize_param(m.experts, "gate_up_proj", False, m.tp, keep_fp8, mine, pow2_scales)
            _quantize_param(m.experts, "down_proj", True, m.tp, keep_fp8, mine, pow2_scales)
            n += 2
    if per_row:
        warnings.warn(f"picovllm: fp8 weights: {len(per_row)} layers (e.g. {per_row[0]}) do not fall on the "
                      f"checkpoint's {block[0]}x{block[1]} scale blocks (fused parts or tensor-parallel slices); "
                      "they take a scale per row, their codes rounded again", stacklevel=2)
    if keep_fp8 and torch.cuda.is_available():
        torch.cuda.empty_cache()        # the float weights' memory back, for the KV cache's profile
    return n
