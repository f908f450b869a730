"""The skinny (decode batch of 1-8 rows) linear kernel against a float64 matmul, and the row-parallel layer's routing.

Without CUDA the kernel runs under TRITON_INTERPRET=1 in float16 (the interpreter's tl.dot has no bfloat16); on a
GPU compiled, in bfloat16 and float16.
"""
import pytest
import torch

# sets TRITON_INTERPRET=1 without CUDA, before a kernel module loads
from test_kernels import INTERPRET, compiled, interpreted

from picovllm import kernels                                              # noqa: E402
from picovllm.kernels.skinny_gemm import skinny_fits, skinny_linear       # noqa: E402
from picovllm.layers.linear import RowParallelLinear                      # noqa: E402

CASES = [
    interpreted("cpu", torch.float16, id="interp-fp16"),
    compiled("cuda", torch.bfloat16, id="gpu-bf16"),
    compiled("cuda", torch.float16, id="gpu-fp16"),
]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def tol(dtype) -> float:
    return 8e-3 if dtype == torch.bfloat16 else 1e-3


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("m,n,k,bias", [(1, 48, 512, False), (3, 40, 768, True), (8, 32, 1024, False)])
def test_skinny_matches_float64(device, dtype, m, n, k, bias):
    """n = 40 and 48 are not multiples of the 16- or 32-wide output tiles: the last tile's rows are masked."""
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.05
    b = torch.randn(n, generator=g, dtype=torch.float64) if bias else None
    want = x @ w.T + (b if bias else 0)
    got = skinny_linear(x.to(device, dtype), w.to(device, dtype), b.to(device, dtype) if bias else None)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got.cpu(), want) < tol(dtype)


def test_fits_only_few_rows_and_aligned_k():
    w = torch.zeros(32, 512, dtype=torch.float16)
    assert skinny_fits(torch.zeros(8, 512, dtype=torch.float16), w)
    assert not skinny_fits(torch.zeros(9, 512, dtype=torch.float16), w)          # a larger batch: cuBLAS
    assert not skinny_fits(torch.zeros(2, 512, dtype=torch.float32), w)          # not half precision
    assert not skinny_fits(torch.zeros(2, 384, dtype=torch.float16), torch.zeros(32, 384, dtype=torch.float16))
    assert not skinny_fits(torch.zeros(2, 512, dtype=torch.float16), w.t().contiguous().t())   # w not contiguous
    assert not skinny_fits(torch.zeros(2, 1024, dtype=torch.float16), w)          # x's K is not w's


@pytest.mark.skipif(not INTERPRET, reason="routes CPU tensors through the kernel under TRITON_INTERPRET=1")
def test_row_parallel_routes_few_rows_of_o_proj_shapes(monkeypatch):
    """With the kernels on (as on a GPU), a row-parallel layer with K <= 2 N takes the skinny kernel for <= 8 rows and
    F.linear for 9; one with K = 3 N (a down_proj's shape) always F.linear. Every result equals float64."""
    import picovllm.kernels.skinny_gemm as sg
    calls = []
    real = sg.skinny_linear
    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    monkeypatch.setattr(sg, "skinny_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    for n, k, rows, routed in [(256, 512, 3, True), (256, 512, 9, False), (512, 512, 8, True), (256, 768, 2, False)]:
        layer = RowParallelLinear(k, n)
        w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.05
        layer.weight.data = w.half()
        x = torch.randn(rows, k, generator=g, dtype=torch.float64)
        before = len(calls)
        got = layer(x.half())
        assert (len(calls) > before) is routed
        assert rel_err(got, x.half().double() @ w.half().double().T) < 2e-3
