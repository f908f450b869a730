"""copy_blocks (the cuda_ipc backend's copy) against a per-block loop written out by hand.

Without CUDA the Triton kernel runs under TRITON_INTERPRET=1 (set before the kernel module is
(re)loaded: the interpreter is chosen when the kernel is decorated). With CUDA: compiled (gpu).
"""
import importlib
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from picovllm.disagg.transfer import block_copy  # noqa: E402

block_copy = importlib.reload(block_copy)     # decorate the kernel under the current TRITON_INTERPRET


def caches(n_src, n_dst, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 2, n_src, 4, 2, 8)           # layers, k/v, blocks, block_size, kv heads, head_dim
    src = torch.randn(shape, generator=g).to(dtype).to(device)
    dst = torch.randn((3, 2, n_dst, 4, 2, 8), generator=g).to(dtype).to(device)
    return src, dst


def expected(src, dst, src_ids, dst_ids):
    out = dst.clone()
    for s, d in zip(src_ids, dst_ids):          # the definition, one block at a time
        out[:, :, d] = src[:, :, s]
    return out


CASES = [
    pytest.param("cpu", False, id="torch-cpu"),
    pytest.param("cpu", True, id="kernel-interp", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", True, id="kernel-gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="CUDA")]),
    pytest.param("cuda", False, id="torch-gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="CUDA")]),
]


@pytest.mark.parametrize("device,kernel", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_matches_blockwise_copy(device, kernel, dtype):
    src, dst = caches(11, 7, dtype, device)
    src_ids, dst_ids = [9, 0, 4, 10, 3], [2, 6, 0, 5, 1]      # permuted, sizes differ between caches
    want = expected(src, dst, src_ids, dst_ids)
    block_copy.copy_blocks(src, dst, src_ids, dst_ids, use_kernel=kernel)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst, want)               # a copy: bit-exact, untouched blocks unchanged


def test_copy_blocks_rejects_bad_ids():
    src, dst = caches(4, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="dst_ids"):
        block_copy.copy_blocks(src, dst, [0, 1], [0, 4])
    with pytest.raises(ValueError, match="differ in length|has 2 blocks"):
        block_copy.copy_blocks(src, dst, [0, 1], [0])
    with pytest.raises(ValueError, match="caches differ"):
        block_copy.copy_blocks(src, torch.zeros(3, 2, 4, 4, 2, 4), [0], [0])


@pytest.mark.gpu2
@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernel_reads_a_peer_gpus_cache():
    """src on cuda:0, dst on cuda:1: the kernel (chosen by default when the GPUs are peers) runs on cuda:1 and reads
    cuda:0's blocks over the peer link; the result equals the per-block definition."""
    src, dst = caches(9, 7, torch.bfloat16, "cuda:0", seed=3)
    dst = dst.to("cuda:1")
    want = expected(src.to("cuda:1"), dst, [8, 0, 3, 4], [1, 6, 2, 3])
    assert block_copy._reachable(src.device, dst.device)
    block_copy.copy_blocks(src, dst, [8, 0, 3, 4], [1, 6, 2, 3])
    torch.cuda.synchronize("cuda:1")
    assert torch.equal(dst, want)
