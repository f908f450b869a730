"""A tensor-parallel engine's KV blocks as full-head tensors: how heads are re-split between TP sizes.

Each rank of a TP engine holds KV heads [kv_head_start, kv_head_start + num_kv_heads) of every block
(QKVParallelLinear's rule: an uneven split when tp does not divide the KV heads, one replicated head
per rank when there are fewer KV heads than ranks); every rank uses the same block ids. A P<->D link
between engines of different TP sizes speaks full heads only, and only the engines' rank 0s talk
over it: rank 0's FullHeadKV reads a request's blocks from all ranks (GatherKV) or writes them to
all ranks (ScatterKV), each rank keeping its own slice. Both go over the engine's gloo control group.

Costs, per request handed over: P's workers each send their shard of the blocks to rank 0 (host
memory: GPU shards are staged through the CPU), rank 0 assembles one full-head payload of the
request's blocks (a transient buffer); D's rank 0 broadcasts the whole payload to every D rank,
which keeps its slice (tp - 1 payloads sent instead of one: simple rather than minimal). The gather
and the scatter run synchronously between two steps of the engine; the P<->D wire stays async.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from picovllm.engine.kv_cache import wire_view
from picovllm.engine.messages import GatherKV, ScatterKV


def local_kv_heads(runner) -> tuple[int, int]:
    """(kv_head_start, num_kv_heads) of this rank's cache, as its attention projections were built."""
    for m in runner.model.modules():
        if hasattr(m, "kv_head_start") and hasattr(m, "total_kv_heads"):
            return m.kv_head_start, m.num_kv_heads
    raise ValueError("the model has no QKVParallelLinear: cannot tell which KV heads this rank holds")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 CPU view (gloo moves bytes of any dtype this way, bfloat16 included)."""
    return t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)


def _cache(runner) -> torch.Tensor:
    """This rank's cache as the link moves it (fp8: its bytes, kv_cache.wire_view)."""
    return wire_view(runner.kv_cache)


def _full_shape(runner, n: int) -> tuple[int, ...]:
    c = runner.kv_cache
    return (c.shape[0], 2, n, c.shape[3], runner.model_config.num_key_value_heads, c.shape[5])


def gather_blocks(runner, group, dst: int, block_ids: list[int]) -> torch.Tensor | None:
    """Every rank calls this; rank `dst` (global rank) gets the full-head blocks on the CPU, others None."""
    start, count = local_kv_heads(runner)
    meta = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(meta, torch.tensor([start, count], dtype=torch.int64), group=group)
    width = max(int(m[1]) for m in meta)
    cache = _cache(runner)
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    shard = cache.index_select(2, idx).to("cpu")
    if count < width:     # shards must be one size for gloo's gather: pad the head dimension
        pad = torch.zeros(*shard.shape[:4], width - count, shard.shape[5], dtype=shard.dtype)
        shard = torch.cat([shard, pad], dim=4)
    mine = _as_bytes(shard)
    if dist.get_rank() != dst:
        dist.gather(mine, None, dst=dst, group=group)
        return None
    parts = [torch.empty_like(mine) for _ in meta]
    dist.gather(mine, parts, dst=dst, group=group)
    full = torch.empty(_full_shape(runner, len(block_ids)), dtype=cache.dtype)
    covered = torch.zeros(full.shape[4], dtype=torch.bool)
    for m, part in zip(meta, parts):
        s, c = int(m[0]), int(m[1])
        part = part.view(cache.dtype).view(*shard.shape)
        full[:, :, :, :, s:s + c] = part[:, :, :, :, :c]
        covered[s:s + c] = True
    if not bool(covered.all()):
        raise RuntimeError(f"KV heads {(~covered).nonzero().flatten().tolist()} are held by no rank")
    return full


def scatter_blocks(runner, group, src: int, block_ids: list[int], full: torch.Tensor | None) -> None:
    """Every rank calls this; rank `src` passes the full-head blocks, and each rank writes its head slice."""
    cache = _cache(runner)
    shape = _full_shape(runner, len(block_ids))
    if full is None:
        data = torch.empty(shape, dtype=cache.dtype)
    else:
        if tuple(full.shape) != shape:
            raise ValueError(f"full-head KV blocks: expected shape {shape}, got {tuple(full.shape)}")
        data = full.to("cpu", cache.dtype).contiguous()
    dist.broadcast(data.view(-1).view(torch.uint8), src=src, group=group)
    start, count = local_kv_heads(runner)
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    cache.index_copy_(2, idx, data[:, :, :, :, start:start + count].to(cache.device))


def serve(runner, channel, msg) -> bool:
    """A worker's side of GatherKV / ScatterKV; False when msg is neither."""
    if isinstance(msg, GatherKV):
        gather_blocks(runner, channel.group, channel.src, msg.block_ids)
    elif isinstance(msg, ScatterKV):
        scatter_blocks(runner, channel.group, channel.src, msg.block_ids, None)
    else:
        return False
    return True


class FullHeadKV:
    """Rank 0's access to a TP engine's KV blocks as full heads (a transfer backend reads and writes them).
    executor: the engine's TPExecutor, which runs the gather or scatter on every rank."""

    def __init__(self, executor) -> None:
        self.executor = executor

    def read(self, block_ids: list[int]) -> torch.Tensor:
        """[layers, 2, n, block_size, total_kv_heads, head_dim] on the CPU, from every rank's shard."""
        return self.executor.gather_kv(block_ids)

    def write(self, block_ids: list[int], full: torch.Tensor) -> None:
        """Write full-head blocks into every rank's cache, each rank its own heads."""
        self.executor.scatter_kv(block_ids, full)
