"""Linear layers that know their tensor-parallel shard and how to load it from a full checkpoint.

Column-parallel layers split the output dimension (each rank computes a slice of the features);
row-parallel layers split the input dimension and all-reduce the partial sums.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from picovllm import kernels
from picovllm.distributed import SINGLE, TPGroup
from picovllm.layers.fp8_weights import FP8, fp8_linear


def _check(param_name: str, want: torch.Size, got: torch.Size) -> None:
    if tuple(want) != tuple(got):
        raise ValueError(f"weight {param_name}: shape mismatch, model expects {tuple(want)}, checkpoint has {tuple(got)}")


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE,
                 local_out: int | None = None) -> None:
        """local_out: this rank's output features, when the split is not out_features / tp.size."""
        super().__init__()
        if local_out is None:
            assert out_features % tp.size == 0, f"out_features {out_features} not divisible by tp size {tp.size}"
            local_out = out_features // tp.size
        self.tp = tp
        self.weight = _param(local_out, in_features)
        self.weight.weight_loader = self.load
        self.bias = _param(local_out) if bias else None
        if bias:
            self.bias.weight_loader = self.load
        self.packed = None   # a PackedWeight on the CPU (see packed_linear.py), set after loading

    def load(self, param: nn.Parameter, w: torch.Tensor, shard: object = None, name: str = "") -> None:
        n = param.shape[0]
        w = w.narrow(0, self.tp.rank * n, n) if w.shape[0] == n * self.tp.size else w
        _check(name, param.shape, w.shape)
        param.data.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, self.bias)
        if self.weight.dtype == FP8:     # quantization="fp8" (layers/fp8_weights.py)
            return fp8_linear(x, self.weight, self.weight_scale, self.bias, self.weight_block)
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices side by side (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, tp: TPGroup = SINGLE) -> None:
        super().__init__(in_features, sum(out_sizes), bias, tp)
        self.out_sizes = [s // tp.size for s in out_sizes]

    def load(self, param: nn.Parameter, w: torch.Tensor, shard: object = None, name: str = "") -> None:
        i = int(shard)
        n, off = self.out_sizes[i], sum(self.out_sizes[:i])
        part = w.narrow(0, self.tp.rank * n, n) if w.shape[0] == n * self.tp.size else w
        dst = param.data.narrow(0, off, n)
        _check(name, dst.shape, part.shape)
        dst.copy_(part)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections, split by KV head: each rank takes whole KV heads with their query heads.

    KV heads that tp size does not divide are split unevenly (9 heads, 3 KV heads on 2 ranks: 6 + 3
    query heads); with fewer KV heads than ranks, each KV head is replicated on tp / num_kv_heads ranks.
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        self.head_dim = head_dim
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
        if num_kv_heads >= tp.size:
            base, extra = divmod(num_kv_heads, tp.size)   # the first `extra` ranks take one more KV head
            self.num_kv_heads = base + (tp.rank < extra)
            self.kv_head_start = tp.rank * base + min(tp.rank, extra)
            group = num_heads // num_kv_heads
            self.num_heads, self.q_head_start = self.num_kv_heads * group, self.kv_head_start * group
        else:  # replicate: ranks r*k .. r*k+k-1 share KV head r, with k = tp / num_kv_heads
            if tp.size % num_kv_heads or num_heads % tp.size:
                raise ValueError(f"tensor_parallel_size {tp.size} cannot share out num_key_value_heads {num_kv_heads}: "
                                 "with fewer KV heads than ranks it must be a multiple of num_key_value_heads "
                                 f"and divide num_attention_heads ({num_heads})")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
            self.num_heads = num_heads // tp.size
            self.q_head_start = tp.rank * self.num_heads
        local_out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias, tp, local_out=local_out)

    @property
    def q_shard(self) -> tuple[int, int]:
        """(first feature, number of features) of this rank's attention output: the o_proj input shard."""
        return self.q_head_start * self.head_dim, self.num_heads * self.head_dim

    def load(self, param: nn.Parameter, w: torch.Tensor, shard: object = None, name: str = "") -> None:
        d = self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        if shard == "q":
            off, n, start, total = 0, q, self.q_head_start * d, self.total_heads * d
        else:
            off, n, start, total = (q if shard == "k" else q + kv), kv, self.kv_head_start * d, self.total_kv_heads * d
        dst = param.data.narrow(0, off, n)
        _check(name, (total,) + tuple(dst.shape[1:]), w.shape)
        dst.copy_(w.narrow(0, start, n))


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE,
                 in_shard: tuple[int, int] | None = None, reduce: bool = True) -> None:
        """in_shard: (first, count) of the input features this rank holds, when not an even split. reduce: False
        leaves the ranks' partial sums for the caller to add up (with others, in one all-reduce); a bias then enters
        rank 0's sum only, so that it is added once."""
        super().__init__()
        self.reduce = reduce
        if in_shard is None:
            assert in_features % tp.size == 0, f"in_features {in_features} not divisible by tp size {tp.size}"
            in_shard = (tp.rank * (in_features // tp.size), in_features // tp.size)
        self.tp = tp
        self.in_features, self.in_start = in_features, in_shard[0]
        self.weight = _param(out_features, in_shard[1])
        self.weight.weight_loader = self.load
        self.bias = _param(out_features) if bias else None
        if bias:
            self.bias.weight_loader = self.load
        self.packed = None   # a PackedWeight on the CPU (see packed_linear.py), set after loading

    def load(self, param: nn.Parameter, w: torch.Tensor, shard: object = None, name: str = "") -> None:
        if param.dim() == 2:
            _check(name, (param.shape[0], self.in_features), w.shape)
            w = w.narrow(1, self.in_start, param.shape[1])
        _check(name, param.shape, w.shape)
        param.data.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y = self.packed(x)
        elif self.weight.dtype == FP8:
            y = fp8_linear(x, self.weight, self.weight_scale, None, self.weight_block)
        elif _skinny(x, self.weight):   # a decode batch of a few rows (kernels/skinny_gemm.py)
            y = _skinny_kernels().skinny_linear(x, self.weight)
        else:
            y = F.linear(x, self.weight)
        return self._finish(y)

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        if self.reduce:
            y = self.tp.all_reduce(y)
        elif self.tp.rank != 0:       # a partial sum the caller reduces (Cohere's parallel block): rank 0 adds the bias
            return y
        return y if self.bias is None else y + self.bias


def _skinny_kernels():
    from picovllm.kernels import skinny_gemm   # triton: imported at the first GPU call
    return skinny_gemm


def _skinny(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a row-parallel layer's call goes to the skinny kernel: a GPU batch of at most 8 rows, and K <= 2 N. On
    an H200 it beat cuBLAS on o_proj (Qwen3-0.6B: 5.7 us against cuBLAS's split-K 12.3 at one row; -8B: 12.0 against
    12.5), not on 0.6B's down_proj (K = 3 N: 6.8 against 6.6) nor the column-parallel shapes (qkv, gate_up: 5-10%
    slower), which keep cuBLAS."""
    return (kernels.use_triton(x) and w.shape[1] <= 2 * w.shape[0]
            and _skinny_kernels().skinny_fits(x, w))
