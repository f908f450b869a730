"""Copy KV blocks from one cache into another: dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]].

Both caches are [num_layers, 2, num_blocks, block_size, kv_heads, head_dim] (their num_blocks may
differ). copy_blocks_reference is the torch version (a gather into a temporary, then a scatter)
and the test oracle; on a GPU, when both caches sit on the same device or on peers (another GPU of the host whose
memory dst's GPU can read), a Triton kernel on dst's GPU copies each block straight from src to dst with no
temporary.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from picovllm.engine.step_input import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path is used
    triton = None


def copy_blocks_reference(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
    src_idx = to_device(src_ids, torch.long, src.device)     # pinned: no wait for the stream (see copy_blocks)
    dst_idx = to_device(dst_ids, torch.long, dst.device)
    dst.index_copy_(2, dst_idx, src.index_select(2, src_idx).to(dst.device))


def check_block_ids(name: str, ids: list[int], num_blocks: int) -> None:
    if any(not isinstance(b, int) or b < 0 or b >= num_blocks for b in ids):
        raise ValueError(f"{name} must be block ids in [0, {num_blocks}), got {ids!r}")


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int],
                use_kernel: bool | None = None) -> None:
    """Copy blocks src_ids of src into blocks dst_ids of dst (asynchronously on CUDA: current stream)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"src_ids has {len(src_ids)} blocks but dst_ids has {len(dst_ids)}")
    if src.shape[:2] != dst.shape[:2] or src.shape[3:] != dst.shape[3:] or src.dtype != dst.dtype:
        raise ValueError(f"caches differ beyond num_blocks: {tuple(src.shape)} {src.dtype} vs "
                         f"{tuple(dst.shape)} {dst.dtype}")
    check_block_ids("src_ids", src_ids, src.shape[2])
    check_block_ids("dst_ids", dst_ids, dst.shape[2])
    if not src_ids:
        return
    if use_kernel is None:
        use_kernel = triton is not None and src.is_cuda and dst.is_cuda and _reachable(src.device, dst.device)
    if not use_kernel:
        return copy_blocks_reference(src, dst, src_ids, dst_ids)
    if triton is None:
        raise RuntimeError("copy_blocks(use_kernel=True) needs triton")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_blocks' kernel needs contiguous caches")
    if src.device == dst.device or not dst.is_cuda:
        return _kernel_copy(src, dst, src_ids, dst_ids, dst.device)
    # another GPU's src: read over the peer link by dst's GPU in one pass; else written by src's GPU. Triton checks
    # each pointer from the launching GPU first, and memory that another process mapped on a peer may be out of a
    # kernel's reach there (cuda_ipc between processes); each pair keeps the first way that launches.
    pair = (src.device, dst.device)
    for on in _launch_on.get(pair, (dst.device, src.device)):
        try:
            _kernel_copy(src, dst, src_ids, dst_ids, on)
        except ValueError:
            continue
        _launch_on[pair] = (on,)
        return
    _launch_on[pair] = ()
    copy_blocks_reference(src, dst, src_ids, dst_ids)


def _kernel_copy(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int],
                 on: torch.device) -> None:
    """The copy kernel on `on`'s GPU (dst's, or src's writing to its peer), ordered after dst's current stream's work
    and before its later work. Raises ValueError (Triton's) if a cache is out of that GPU's reach."""
    block_numel = src[0, 0, 0].numel()
    planes = src.shape[0] * src.shape[1]
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (len(src_ids), planes, triton.cdiv(block_numel, chunk))
    here = on == dst.device
    stream = None if here else _push_stream(on)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(dst.device))
    with contextlib.ExitStack() as ctx:
        if on.type == "cuda":
            ctx.enter_context(torch.cuda.device(on))
        if stream is not None:
            ctx.enter_context(torch.cuda.stream(stream))
        # through pinned memory: from pageable memory the driver may wait for the stream, and D's copy stream
        # waits for the step in flight (cuda_ipc's PeerCopies.start), so every arrival would stall D's host
        ids = to_device([src_ids, dst_ids], torch.int64, on)
        _copy_blocks_kernel[grid](src, dst, ids[0], ids[1], src.shape[2] * block_numel, dst.shape[2] * block_numel,
                                  block_numel, CHUNK=chunk)
    if stream is not None:
        torch.cuda.current_stream(dst.device).wait_stream(stream)


@functools.cache
def _push_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream on src's GPU for copies it writes into a peer's cache."""
    return torch.cuda.Stream(device)


def _reachable(src: torch.device, dst: torch.device) -> bool:
    """Whether a kernel on dst's GPU can read src's memory: the same GPU, or a peer (NVLink or PCIe P2P) with access
    enabled. torch enables it on a first copy between the two devices, so _peer_access makes one one-element copy; the
    staged index_select / copy / index_copy it replaces passed over the bytes three times (43% of NCCL's
    bandwidth between two H200s, BENCHMARKS.md)."""
    return src == dst or (_launch_on.get((src, dst)) != () and _peer_access(src.index, dst.index))


# (src, dst) -> the GPU whose copy kernel launched, once one has; () when neither could (the staged copy then)
_launch_on: dict[tuple[torch.device, torch.device], tuple[torch.device, ...]] = {}


@functools.cache      # once a pair of devices: access, once enabled, lasts the process
def _peer_access(src: int, dst: int) -> bool:
    if not torch.cuda.can_device_access_peer(dst, src):
        return False
    # a copy each way: which of the two GPUs torch enables for the other depends on the GPU it runs the copy on
    torch.empty(1, device=dst).copy_(torch.zeros(1, device=src))
    torch.empty(1, device=src).copy_(torch.zeros(1, device=dst))
    torch.cuda.synchronize(dst)
    torch.cuda.synchronize(src)
    return True


if triton is not None:
    @triton.jit
    def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, src_plane_stride, dst_plane_stride,
                            block_numel, CHUNK: tl.constexpr):
        pair = tl.program_id(0)          # which (src block, dst block) pair
        plane = tl.program_id(1)         # which (layer, k/v) plane
        part = tl.program_id(2)          # which CHUNK of the block
        s = tl.load(src_ids_ptr + pair)
        d = tl.load(dst_ids_ptr + pair)
        offs = part * CHUNK + tl.arange(0, CHUNK)
        mask = offs < block_numel
        p = plane.to(tl.int64)           # int64 offsets: a large cache exceeds 2**31 elements
        x = tl.load(src_ptr + p * src_plane_stride + s * block_numel + offs, mask=mask)
        tl.store(dst_ptr + p * dst_plane_stride + d * block_numel + offs, x, mask=mask)
