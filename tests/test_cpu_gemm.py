"""The small-M CPU GEMM (picovllm/kernels/cpu/small_gemm.c) against a float64 torch reference, and
PackedWeight's dispatch between it and oneDNN."""
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from picovllm.kernels.cpu import small_gemm
from picovllm.layers.packed_linear import PackedWeight, onednn_packing_available

needs_kernel = pytest.mark.skipif(not small_gemm.available(),
                                  reason="small_gemm needs a C compiler, AVX2/FMA and torch's OpenMP runtime")
# fp32 sums over K, relative to the output's scale (the largest |y| of the reference): about
# sqrt(K) * 2^-24 per element for random data; 2e-6 leaves room at K = 576.
RTOL = 2e-6


def test_available_where_it_can_build():
    """Guards against falling back to oneDNN unnoticed (the other tests skip when it is unavailable)."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if shutil.which("cc") is None or not {"avx2", "fma"} <= flags:
        pytest.skip("no C compiler or no AVX2/FMA")
    # A fresh process that, like the engine, first loads sentencepiece, which bundles its own libgomp.
    code = "import sentencepiece, torch; from picovllm.kernels.cpu import small_gemm; assert small_gemm.available()"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)


def reference(x, w, b):
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def check(y, ref):
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < RTOL, err


@pytest.mark.parametrize("n,k", [(17, 7), (49, 33), (200, 576), (16, 1), (64, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(n, k, with_bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    panels = small_gemm.pack_panels(w)
    assert panels.shape == ((n + 15) // 16, k, 16)
    for m in (1, 2, 3, 5, 6, 7, 8, 11, 12, 13, 31, 64, 70):   # every row-block size and remainder
        x = torch.randn(m, k, generator=g)
        check(small_gemm.small_gemm(x, panels, n, b), reference(x, w, b))


@needs_kernel
@pytest.mark.parametrize("n,k", [(17, 7), (49, 33), (200, 576)])
def test_bf16_panels_match_float64_on_the_rounded_weights(n, k):
    """quantization="bf16": the panels hold W rounded to bfloat16 (nearest even), the products and sums stay float32."""
    g = torch.Generator().manual_seed(n + k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    panels = small_gemm.pack_panels(w, torch.bfloat16)
    assert panels.dtype == torch.bfloat16 and panels.shape == ((n + 15) // 16, k, 16)
    rounded = w.to(torch.bfloat16).float()
    assert not torch.equal(rounded, w)
    for m in (1, 4, 6, 7, 13):
        x = torch.randn(m, k, generator=g)
        check(small_gemm.small_gemm(x, panels, n, b), reference(x, rounded, b))


@needs_kernel
def test_threads_give_the_same_result():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(200, 576, generator=g), torch.randn(200, generator=g), torch.randn(13, 576, generator=g)
    panels = small_gemm.pack_panels(w)
    one = small_gemm.small_gemm(x, panels, 200, b, threads=1)
    check(one, reference(x, w, b))
    for threads in (2, 3):   # the panels split differently; each output is computed by one thread either way
        assert torch.equal(small_gemm.small_gemm(x, panels, 200, b, threads=threads), one)


@needs_kernel
def test_non_contiguous_input_and_bad_width():
    w = torch.randn(40, 33)
    x = torch.randn(33, 5).T   # [5, 33], not contiguous
    check(small_gemm.small_gemm(x, small_gemm.pack_panels(w), 40), reference(x, w, None))
    with pytest.raises(ValueError, match="columns"):
        small_gemm.small_gemm(torch.randn(5, 32), small_gemm.pack_panels(w), 40)


@needs_kernel
@pytest.mark.skipif(not onednn_packing_available(), reason="PackedWeight needs oneDNN")
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_weight_dispatch_equals_linear(with_bias):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(49, 33, generator=g)
    b = torch.randn(49, generator=g) if with_bias else None
    packed = PackedWeight(w, small_m=8)
    assert packed.panels is not None
    for shape in [(1, 33), (8, 33), (9, 33), (40, 33), (2, 4, 33), (3, 3, 33)]:   # both sides of small_m = 8
        x = torch.randn(*shape, generator=g)
        y = packed(x, b)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        rows = x.numel() // 33
        if rows <= 8:   # went through small_gemm
            assert torch.equal(y.view(rows, 49), small_gemm.small_gemm(x.reshape(rows, 33), packed.panels, 49, b))
