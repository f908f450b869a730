"""An all-reduce for small messages between the GPUs of one host, in one kernel with one flag exchange.

Every rank's buffer (torch symmetric memory: each rank maps every other's over NVLink) holds
    flags [MAX_CHUNKS][WORLD] int64 | data [2 slots][WORLD][max_bytes]
The message is cut into CHUNK_BYTES pieces, one program each. Program p on rank r:
  1. takes its epoch, the number of calls so far that had a chunk p, plus one (a counter on the device,
     so a replayed CUDA graph counts on);
  2. pushes its chunk into every peer's data[epoch % 2][r] (remote stores), then, after a CTA barrier,
     writes epoch into the peer's flags[p][r] with a system-scope release;
  3. waits until its own flags[p][j] >= epoch for every peer j (system-scope acquire), and sums the chunks
     in rank order (so every rank gets the same bits) in float32.
One flag exchange is enough because of the two slots: a peer can write slot (epoch % 2) again only at epoch
+ 2, which needs this rank's epoch + 1 signal, sent only after this call has read its data (same stream).
Chunk p always covers the same bytes, whatever the message size, so that argument holds per program.
Programs wait only on the same program of the peers; the grid is capped (MAX_CHUNKS) below the number of
SMs so that all of them are resident and a wait cannot starve a peer's program of an SM.
"""
from __future__ import annotations

import triton
import triton.language as tl

CHUNK_BYTES = 8192
MAX_CHUNKS = 128        # <= 1 MiB messages; an H200 has 132 SMs
FLAG_BYTES = MAX_CHUNKS * 8 * 8   # flags for up to 8 ranks


@triton.jit
def _one_flag_all_reduce(x_ptr, out_ptr, bufs_ptr, epoch_ptr, n, max_bytes,
                         RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                         FLAG_OFF: tl.constexpr):
    p = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    epoch = tl.load(epoch_ptr + p) + 1
    slot = (epoch % 2).to(tl.int64)
    offs = p * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    mine = tl.load(x_ptr + offs, mask=mask, other=0.0)
    # data[slot][src] begins FLAG_OFF + (slot * WORLD + src) * max_bytes bytes into a buffer
    push_off = FLAG_OFF + (slot * WORLD + RANK) * max_bytes
    for j in tl.static_range(WORLD):
        if j != RANK:
            peer = (tl.load(bufs_ptr + j) + push_off).to(tl.pointer_type(dtype))
            tl.store(peer + offs, mine, mask=mask)
    tl.debug_barrier()          # every thread's pushes precede the release below
    for j in tl.static_range(WORLD):
        if j != RANK:
            flag = tl.load(bufs_ptr + j).to(tl.pointer_type(tl.int64)) + p * WORLD + RANK
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    own = tl.load(bufs_ptr + RANK)
    for j in tl.static_range(WORLD):
        if j != RANK:
            flag = own.to(tl.pointer_type(tl.int64)) + p * WORLD + j
            while tl.atomic_add(flag, 0, sem="acquire", scope="sys") < epoch:
                pass
    tl.debug_barrier()          # the acquire above precedes every thread's reads below
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(WORLD):
        if j == RANK:
            acc += mine.to(tl.float32)
        else:
            src = (own + FLAG_OFF + (slot * WORLD + j) * max_bytes).to(tl.pointer_type(dtype))
            acc += tl.load(src + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + offs, acc.to(dtype), mask=mask)
    tl.store(epoch_ptr + p, epoch)


def one_flag_all_reduce(x, out, bufs, epochs, max_bytes: int, rank: int, world: int) -> None:
    """out = the sum of x over the ranks; x and out contiguous, x.nbytes <= max_bytes <= MAX_CHUNKS chunks.
    bufs: int64 [world] device addresses of every rank's symmetric buffer (laid out as the module says);
    epochs: int64 [MAX_CHUNKS] zeros at first, this rank's own; every rank calls with the same sizes."""
    block = CHUNK_BYTES // x.element_size()
    grid = (triton.cdiv(x.numel(), block),)
    _one_flag_all_reduce[grid](x, out, bufs, epochs, x.numel(), max_bytes,
                               RANK=rank, WORLD=world, BLOCK=block, FLAG_OFF=FLAG_BYTES, num_warps=8)
