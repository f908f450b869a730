"""The skinny (decode batch of 1-8 rows) linear kernel against a float64 matmul, and the row-parallel layer's routing.

Without CUDA the kernel runs under TRITON_INTERPRET=1 in float16 (the interpreter's tl.dot has no bfloat16); on a
GPU compiled, in bfloat16 and float16.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from picovllm import kernels                                              # noqa: E402
from picovllm.kernels.skinny_gemm import skinny_fits, skinny_linear       # noqa: E402
from picovllm.layers.linear import RowParallelLinear                      # noqa: E402
from picovllm.models.llama import LlamaMLP                                # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
CASES = [
    pytest.param("cpu", torch.float16, id="interp-fp16",
                 marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", torch.bfloat16, id="gpu-bf16",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA")]),
    pytest.param("cuda", torch.float16, id="gpu-fp16",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA")]),
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


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("m", [1, 5])
def test_silu_gated_matches_float64(device, dtype, m):
    """x = [gate | up]: the kernel multiplies w by silu(gate) * up."""
    g = torch.Generator().manual_seed(m)
    k, n = 512, 32
    x = torch.randn(m, 2 * k, generator=g, dtype=torch.float64) * 2
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.05
    gate, up = x[:, :k], x[:, k:]
    want = (gate * torch.sigmoid(gate) * up) @ w.T
    got = skinny_linear(x.to(device, dtype), w.to(device, dtype), silu_gated=True)
    assert rel_err(got.cpu(), want) < tol(dtype)


def test_fits_only_few_rows_and_aligned_k():
    w = torch.zeros(32, 512, dtype=torch.float16)
    assert skinny_fits(torch.zeros(8, 512, dtype=torch.float16), w)
    assert not skinny_fits(torch.zeros(9, 512, dtype=torch.float16), w)          # a larger batch: cuBLAS
    assert not skinny_fits(torch.zeros(2, 512, dtype=torch.float32), w)          # not half precision
    assert not skinny_fits(torch.zeros(2, 384, dtype=torch.float16), torch.zeros(32, 384, dtype=torch.float16))
    assert not skinny_fits(torch.zeros(2, 512, dtype=torch.float16), w.t().contiguous().t())   # w not contiguous
    assert skinny_fits(torch.zeros(2, 1024, dtype=torch.float16), w, silu_gated=True)
    assert not skinny_fits(torch.zeros(2, 512, dtype=torch.float16), w, silu_gated=True)


@pytest.mark.skipif(not INTERPRET, reason="routes CPU tensors through the kernel under TRITON_INTERPRET=1")
def test_mlp_folds_its_activation_for_few_rows(monkeypatch):
    """With the kernels on (as on a GPU), a gated MLP of <= 8 rows runs down_proj with silu inside the skinny kernel,
    9 rows the plain path; both equal a float64 MLP."""
    from types import SimpleNamespace
    calls = []
    real = RowParallelLinear.silu_gated

    def spy(self, h):
        out = real(self, h)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kernels, "use_triton", lambda x: True)
    monkeypatch.setattr(RowParallelLinear, "silu_gated", spy)
    cfg = SimpleNamespace(hidden_size=256, intermediate_size=512, hidden_act="silu")
    mlp = LlamaMLP(cfg, __import__("picovllm.distributed", fromlist=["SINGLE"]).SINGLE)
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(1024, 256, generator=g, dtype=torch.float64) * 0.05
    down = torch.randn(256, 512, generator=g, dtype=torch.float64) * 0.05
    mlp.gate_up_proj.weight.data = gu.half()
    mlp.down_proj.weight.data = down.half()
    for rows, folded in [(3, True), (9, False)]:
        x = torch.randn(rows, 256, generator=g, dtype=torch.float64)
        h = x.half().double() @ gu.half().double().T
        gate, up = h[:, :512], h[:, 512:]
        want = (gate * torch.sigmoid(gate) * up) @ down.half().double().T
        got = mlp(x.half())
        assert calls[-1] is folded
        assert rel_err(got, want) < 3e-3
