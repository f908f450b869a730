"""Quantized weights on the CPU (loader/gguf_quants.py, kernels/cpu/quant_gemm.c) against independent oracles.

Decoding: random GGUF blocks of every quantized type (random bytes, scale fields set to finite float16s) decoded
by gguf_quants equal gguf-python's own dequantization exactly. The GEMM: y = x @ W.T against float64
dequantize-then-matmul, for every type, odd shapes and row counts, the AVX2 and the AVX-512 build (the latter
skipped where the CPU lacks it). The kernel quantizes x per block of 32 to int8, so it is checked twice: against
W @ (x as the kernel quantized it), where only float32 rounding may differ, and against W @ x itself, where the
error of each output is at most half a quantization step of x per element times |W| (checked as a bound).
"""
import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from picovllm.kernels.cpu import quant_gemm as qg
from picovllm.kernels.cpu.build import cpu_isas
from picovllm.loader.gguf_quants import BLOCKS, decode_blocks

FLOAT16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}   # byte offsets
ISAS = [pytest.param(name, marks=pytest.mark.skipif(name not in cpu_isas() or qg.library(name) is None,
                                                     reason=f"this CPU or compiler has no {name} build"))
        for name in ("avx2", "avx512")]


def random_blocks(rng, kind: str, n: int, k: int) -> np.ndarray:
    """[n, k] of `kind` as GGUF stores it: random bytes, each float16 field a random finite scale."""
    per, size = BLOCKS[kind]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at in FLOAT16_FIELDS[kind]:
        raw[..., at:at + 2] = rng.uniform(-0.05, 0.05, (n, k // per, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_decoded_blocks_equal_gguf_dequantize(kind):
    rng = np.random.default_rng(1)
    n, k = 7, 512
    raw = random_blocks(rng, kind, n, k)
    want = gguf.quants.dequantize(raw, Q[kind]).astype(np.float64)
    blocks = decode_blocks(kind, raw, n, k)
    assert np.array_equal(blocks.dequantize(), want)
    seg = qg.pack(blocks)                                    # and the panels give back the same weight
    assert np.array_equal(qg.unpack(seg).double().numpy(), want)
    rows = torch.tensor([6, 0, 3])
    assert np.array_equal(qg.unpack(seg, rows).double().numpy(), want[rows.numpy()])


def test_unsupported_type_is_named():
    with pytest.raises(ValueError, match="Q5_K"):
        decode_blocks("Q5_K", np.zeros(176, np.uint8), 1, 256)
    with pytest.raises(ValueError, match="Q4_K.*multiple of its block"):
        decode_blocks("Q4_K", np.zeros(144, np.uint8), 2, 128)


@pytest.mark.parametrize("isa", ISAS)
def test_activation_quantization(isa):
    x = torch.randn(3, 96) * torch.tensor([1e-3, 1.0, 40.0])[:, None]
    x[1, 32:64] = 0                                          # an all-zero block: scale 0, codes 0
    xq, xd, xs = qg.quantize_activations(x, isa)
    blocks = x.view(3, 3, 32).double()
    amax = blocks.abs().amax(-1)
    assert torch.allclose(xd.double(), amax / 127, rtol=1e-6, atol=0)
    assert xq.abs().max() <= 127
    err = (xq.view(3, 3, 32).double() * xd.double()[..., None] - blocks).abs()
    assert (err <= xd.double()[..., None] * (0.5 + 1e-5)).all()
    assert torch.equal(xs, xq.view(3, 3, 2, 16).int().sum(-1))


def _check(qw: qg.QuantizedWeight, w: np.ndarray, x: torch.Tensor, bias: torch.Tensor | None, isa: str) -> None:
    """qw(x) against float64 W (dequantized independently) as the module docstring says."""
    m, k = x.shape
    y = qw(x, bias).double().numpy()
    b = 0 if bias is None else bias.double().numpy()
    xq, xd, _ = qg.quantize_activations(x, isa)
    x_seen = (xq.double().view(m, -1, 32) * xd.double()[..., None]).view(m, k).numpy()
    tight = x_seen @ w.T + b
    scale = np.abs(x_seen) @ np.abs(w).T + np.abs(b)
    assert (np.abs(y - tight) <= 2e-6 * scale + 1e-30).all()
    bound = 0.5 * (np.abs(w).reshape(w.shape[0], -1, 32).sum(-1)[None] * xd.double().numpy()[:, None, :]).sum(-1)
    assert (np.abs(y - (x.double().numpy() @ w.T + b)) <= bound + 2e-6 * scale).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", list(BLOCKS))
@pytest.mark.parametrize("m, n, k", [(1, 37, 256), (5, 16, 512), (7, 50, 768), (13, 3, 256)])
def test_gemm_matches_float64(isa, kind, m, n, k):
    rng = np.random.default_rng([list(BLOCKS).index(kind), m, n, k])
    raw = random_blocks(rng, kind, n, k)
    w = gguf.quants.dequantize(raw, Q[kind]).astype(np.float64)
    qw = qg.QuantizedWeight([qg.pack(decode_blocks(kind, raw, n, k))], isa)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    _check(qw, w, x, None, isa)


@pytest.mark.parametrize("isa", ISAS)
def test_tiny_activations_keep_their_codes(isa):
    """Blocks of x whose scale amax / 127 is a float32 subnormal (amax below ~1.5e-36): 1 / scale overflowed, and
    every code came out -128 (outputs off by 7-18x their size). Codes within half a step of x, and the product
    within the half-step bound of float64's, relative to these tiny rows' own size."""
    rng = np.random.default_rng(11)
    raw = random_blocks(rng, "Q8_0", 16, 64)
    w = gguf.quants.dequantize(raw, Q.Q8_0).astype(np.float64)
    qw = qg.QuantizedWeight([qg.pack(decode_blocks("Q8_0", raw, 16, 64))], isa)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)) * torch.tensor([1e-37, 1e-38, 4e-37])[:, None]
    xq, xd, xs = qg.quantize_activations(x, isa)
    blocks, d = x.view(3, 2, 32).double(), xd.double()[..., None]
    assert (d > 0).all() and xq.abs().max() <= 127
    assert ((xq.view(3, 2, 32).double() * d - blocks).abs() <= d * (0.5 + 1e-5)).all()
    assert torch.equal(xs, xq.view(3, 2, 2, 16).int().sum(-1))
    y, ref = qw(x).double().numpy(), x.double().numpy() @ w.T
    bound = 0.5 * (np.abs(w).reshape(16, 2, 32).sum(-1)[None] * xd.double().numpy()[:, None, :]).sum(-1)
    assert (np.abs(y - ref) <= bound + 1e-3 * (np.abs(x.double().numpy()) @ np.abs(w).T)).all()


@pytest.mark.parametrize("isa", ISAS)
def test_scales_past_float16_stay_exact(isa):
    """Q4_0 with d = 10000 (a valid float16): its offset -8 d is past float16's range, so the segment keeps float32
    scales; they had become -inf, and every output inf."""
    rng = np.random.default_rng(5)
    raw = random_blocks(rng, "Q4_0", 16, 64).reshape(16, 2, 18)
    raw[..., 0:2] = np.full((16, 2, 1), 10000.0, np.float16).view(np.uint8)
    raw = raw.reshape(16, -1)
    w = gguf.quants.dequantize(raw, Q.Q4_0).astype(np.float64)
    qw = qg.QuantizedWeight([qg.pack(decode_blocks("Q4_0", raw, 16, 64))], isa)
    _check(qw, w, torch.randn(3, 64, generator=torch.Generator().manual_seed(1)), None, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_activations_give_non_finite_rows(isa, bad):
    """A NaN or an infinity in a row of x makes that row's outputs non-finite, as the float64 product's are; the
    other rows stay as they were. A NaN had come out as an ordinary number (max dropped it, its int8 code was -128),
    an infinity as -128 too."""
    rng = np.random.default_rng(3)
    raw = random_blocks(rng, "Q8_0", 16, 64)
    w = gguf.quants.dequantize(raw, Q.Q8_0).astype(np.float64)
    qw = qg.QuantizedWeight([qg.pack(decode_blocks("Q8_0", raw, 16, 64))], isa)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    clean = qw(x)
    x[1, 37] = bad
    y, ref = qw(x), x.double().numpy() @ w.T
    assert not np.isfinite(ref[1]).any() and not torch.isfinite(y[1]).any()
    assert torch.equal(y[[0, 2]], clean[[0, 2]])


@pytest.mark.parametrize("isa", ISAS)
def test_segments_of_different_forms_and_a_bias(isa):
    """q, k, v of one layer in three types (rows not a multiple of 16), one output; a bias; 2 threads."""
    rng = np.random.default_rng(7)
    k, parts = 512, [("Q4_K", 40), ("Q6_K", 24), ("Q4_1", 9)]
    raws = [(kind, random_blocks(rng, kind, n, k), n) for kind, n in parts]
    w = np.concatenate([gguf.quants.dequantize(raw, Q[kind]).astype(np.float64) for kind, raw, _ in raws])
    qw = qg.QuantizedWeight([qg.pack(decode_blocks(kind, raw, n, k)) for kind, raw, n in raws], isa)
    assert qw.out_features == 73 and qw.in_features == k
    x, bias = torch.randn(70, k), torch.randn(73)           # 70 rows: many row tiles, prefill-sized
    torch.set_num_threads(2)
    try:
        _check(qw, w, x, bias, isa)
    finally:
        torch.set_num_threads(1)
    assert np.array_equal(qw.dequantize().double().numpy(), w.astype(np.float32))
    rows = torch.tensor([72, 0, 45])
    assert np.array_equal(qw.dequantize(rows).double().numpy(), w[rows.numpy()].astype(np.float32))


@pytest.mark.skipif("avx2" not in cpu_isas(), reason="this CPU has no AVX2")
def test_forced_isa(monkeypatch):
    monkeypatch.setenv("PICOVLLM_CPU_ISA", "avx2")
    assert qg.isa() == "avx2"
    monkeypatch.setenv("PICOVLLM_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="PICOVLLM_CPU_ISA"):
        qg.isa()


@pytest.mark.parametrize("isa", ISAS)
def test_refined_top_logits_are_exact(isa):
    """After a quantized LM head, each row's top logits are recomputed from the float32 hidden state: they equal
    float64 W @ x (the rest keep the int8 activations' error)."""
    rng = np.random.default_rng(3)
    n, k = 300, 256
    raw = random_blocks(rng, "Q8_0", n, k)
    w = gguf.quants.dequantize(raw, Q.Q8_0).astype(np.float64)
    qw = qg.QuantizedWeight([qg.pack(decode_blocks("Q8_0", raw, n, k))], isa)
    x = torch.randn(3, k)
    raw_logits = qw(x)
    top = raw_logits.topk(5, dim=1).indices.numpy()          # the candidates refined
    logits = qg.refine_top_logits(raw_logits.clone(), x, qw, top=5).double().numpy()
    exact = x.double().numpy() @ w.T
    got, want = np.take_along_axis(logits, top, 1), np.take_along_axis(exact, top, 1)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(exact).max())
    rest = np.ones_like(logits, dtype=bool)
    np.put_along_axis(rest, top, False, 1)
    assert np.array_equal(logits[rest], raw_logits.double().numpy()[rest])
