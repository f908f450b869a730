"""How the torch attention backend batches decodes: groups of similar context length.

Decode attention on the CPU gathers each sequence's K/V blocks into a dense [n, L, H, D] tensor
padded to the longest sequence, so its cost is n * L_max token slots. Sorting decodes by length
and splitting them into groups cuts the padding (about a third of the slots on the cpu-small
workload), at the price of a few more calls per group. The grouping, masks and block-id tensors
are built once per step and reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# What one more group costs, in token slots of gathered K/V (a few more tensor ops per layer).
GROUP_OVERHEAD_SLOTS = 256


@dataclass
class DecodeGroup:
    rows: torch.Tensor | None   # [n] which decode rows (None: all of them, in order)
    block_ids: torch.Tensor     # [n, num_blocks] their block tables, cut to the group's longest (-1s as 0)
    mask: torch.Tensor | None   # [n, 1, 1, num_blocks * block_size] additive (-inf past each length and before
                                # its sliding window); None: all valid


def group_by_length(lens: list[int], block_size: int, overhead: int = GROUP_OVERHEAD_SLOTS) -> list[list[int]]:
    """Split row indices into groups minimising sum(group size * its padded length) + overhead per group.

    Exact dynamic programme over the distinct padded lengths (sorted), so at most a few dozen states.
    """
    blocks = [-(-n // block_size) for n in lens]
    sizes = sorted(set(blocks))
    count = {b: 0 for b in sizes}
    for b in blocks:
        count[b] += 1
    prefix = [0]
    for b in sizes:
        prefix.append(prefix[-1] + count[b])
    best, cut = [0.0] + [float("inf")] * len(sizes), [0] * (len(sizes) + 1)
    for j in range(1, len(sizes) + 1):              # groups end at distinct size j, padded to sizes[j-1]
        for i in range(1, j + 1):
            cost = best[i - 1] + (prefix[j] - prefix[i - 1]) * sizes[j - 1] * block_size + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], len(sizes)
    while j:
        bounds.append((sizes[cut[j] - 1], sizes[j - 1]))
        j = cut[j] - 1
    return [[r for r, b in enumerate(blocks) if lo <= b <= hi] for lo, hi in reversed(bounds)]


def plan_decode(seq_lens: list[int], block_tables: torch.Tensor, block_size: int,
                dtype: torch.dtype, window: int | None = None) -> list[DecodeGroup]:
    """seq_lens, block_tables: the decode rows' (the first rows of the batch); window: a row of length n sees
    positions n - window .. n - 1 only."""
    dev = block_tables.device
    groups = group_by_length(seq_lens, block_size)
    plan = []
    for rows in groups:
        lens = [seq_lens[r] for r in rows]
        nblk = -(-max(lens) // block_size)
        width = nblk * block_size
        if len(groups) == 1:
            row_t, tables = None, block_tables[:len(rows), :nblk]
        else:
            row_t = torch.tensor(rows, dtype=torch.long, device=dev)
            tables = block_tables.index_select(0, row_t)[:, :nblk]
        mask = None
        slides = window is not None and max(lens) > window
        if min(lens) < width or slides:
            pos, n = torch.arange(width, device=dev)[None, :], torch.tensor(lens, device=dev)[:, None]
            past = (pos >= n) | (pos < n - window) if slides else pos >= n
            mask = torch.zeros(len(rows), 1, 1, width, dtype=dtype, device=dev)
            mask.masked_fill_(past[:, None, None, :], float("-inf"))
        # every entry up to the group's longest is gathered, then masked: those a row never reads (SLID_OUT before
        # its window, stale ones past its table's end) may be -1, which index_select refuses
        plan.append(DecodeGroup(row_t, tables.clamp(min=0), mask))
    return plan
