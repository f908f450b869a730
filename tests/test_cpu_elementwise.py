"""The CPU elementwise kernels (picovllm/kernels/cpu/elementwise.c) against float64 references computed
here: RMSNorm with and without the residual add, SiLU(gate) * up, rotary; split between threads or not."""
import pytest
import torch

from picovllm.kernels.cpu import elementwise as cpu
from picovllm.layers.activation import SiluAndMul
from picovllm.layers.layernorm import RMSNorm
from picovllm.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no working C compiler")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request, monkeypatch):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    monkeypatch.setattr(cpu, "MIN_ELEMENTS_PER_THREAD", 64)     # split even small inputs
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("rows,n", [(1, 7), (5, 576), (33, 64), (300, 100)])
def test_rms_norm_matches_float64(rows, n, threads):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, n, generator=g) * 3
    res = torch.randn(rows, n, generator=g)
    w = torch.randn(n, generator=g)
    eps = 1e-5

    def ref(h):
        h = h.double()
        return w.double() * h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)

    norm = RMSNorm(n, eps)
    norm.weight.data.copy_(w)
    out = norm(x)
    assert torch.allclose(out.double(), ref(x), rtol=1e-5, atol=1e-5)
    out2, new_res = norm(x, res)
    assert torch.equal(new_res, x + res)                       # one fp32 add each, as torch does
    assert torch.allclose(out2.double(), ref(x.double() + res.double()), rtol=1e-5, atol=1e-5)
    assert not x.isnan().any() and out.shape == x.shape


def test_rms_norm_of_huge_and_non_finite_values():
    """Rows whose sum of squares is not finite come out as torch's float32 norm gives them (-ffast-math's
    approximate reciprocal square root had given a whole row of NaN where torch gives zeros): finite values whose
    squares overflow float32 -> zeros; an infinity -> NaN at its element, zeros elsewhere; a NaN -> all NaN."""
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.fill_(1.0)
    x = torch.full((3, 64), 1e19)
    x[:, ::2] = -1e19
    x[1, 5] = float("inf")
    x[2, 9] = float("nan")
    out = norm(x)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert not want[0].isnan().any() and want[1].isnan().sum() == 1 and want[2].isnan().all()
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("rows,n", [(1, 3), (4, 1536), (70, 96)])
def test_silu_and_mul_matches_float64(rows, n, threads):
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, 2 * n, generator=g) * 6
    x[0, 0], x[-1, 1] = -200.0, 200.0                          # exp's range: silu -> 0 and -> x
    gate, up = x.double().chunk(2, -1)
    ref = gate * torch.sigmoid(gate) * up
    out = SiluAndMul()(x)
    assert out.shape == (rows, n)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_non_contiguous_and_other_dtypes_take_the_torch_path():
    x = torch.randn(4, 16)[:, ::2]
    assert not cpu.usable(x) and not cpu.usable(torch.randn(4, 8, dtype=torch.float64))
    norm = RMSNorm(8, 1e-6)
    ref = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(norm(x).double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 37])
def test_rope_matches_float64(tokens, threads):
    """Strided q/k views of one qkv row, as the attention layer passes them; positions out of order."""
    hq, hk, d, max_pos = 6, 2, 16, 100
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    pos = torch.randperm(max_pos, generator=g)[:tokens]
    rot = RotaryEmbedding(d, max_pos, 10000.0)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[:, None] * inv[None]                                   # [T, d/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def ref(x):
        x1, x2 = x.double().chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    assert tokens == 1 or not q.is_contiguous()
    rq, rk = rot(pos, q, k)
    assert rq.is_contiguous() and rq.shape == q.shape and rk.shape == k.shape
    assert torch.allclose(rq.double(), ref(q), atol=1e-5) and torch.allclose(rk.double(), ref(k), atol=1e-5)
