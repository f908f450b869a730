"""Paged KV-cache bookkeeping: a free list, one block table per request, and prefix caching.

A block is either referenced (ref_count > 0, in some request's block table) or free. Free blocks
sit in an LRU queue; a free block that still holds a full, hashed block of tokens is a cached
block: a later request whose prompt starts with the same tokens takes it back instead of
recomputing it. Only when the free queue is drained is a cached block's content overwritten.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

from picovllm.engine.request import Request

SLID_OUT = -1   # a block-table entry whose block slid out of every layer's window and was given back


def hash_block(prev_hash: int, token_ids: tuple[int, ...]) -> int:
    # Python's hash of int tuples is deterministic across processes (no string hashing involved).
    return hash((prev_hash, token_ids))


def prefix_salt(*identity: object) -> int:
    """The seed of every block-hash chain, from what changes KV (model, dtype). Not hash() of a str:
    that differs per process (PYTHONHASHSEED), and PD engines in two processes must agree."""
    digest = hashlib.sha256("\0".join(map(str, identity)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 salt: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt                      # folds model identity and dtype into every chain
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.num_registered = 0               # blocks ever entered in hash_to_block (the scheduler's _no_room reads it)
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.queried_tokens = 0
        self.hit_tokens = 0
        # of those, the lookups of requests admitted again after a preemption (vLLM's metrics leave them out)
        self.requeried_tokens = 0
        self.rehit_tokens = 0

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(req.block_table))

    # -- allocation ----------------------------------------------------------------------------
    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # evict: its content is about to be overwritten
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def allocate_prefix(self, req: Request) -> int:
        """Give a request with no blocks the longest run of cached blocks matching its tokens.

        Called by the scheduler when a request is first admitted (or re-admitted after
        preemption). At least one token is always left to compute, so the step that finishes
        the prompt has logits to sample from. Returns the number of tokens taken from cache.
        """
        assert not req.block_table and req.num_computed_tokens == 0
        if not self._looks_up(req):
            return 0
        tokens = req.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        if req.prompt_logprobs is not None:   # cached positions have no logits: only those already taken
            max_blocks = min(max_blocks, (len(req.prompt_logprobs) - 1) // self.block_size)
        self.queried_tokens += len(tokens)
        h = self._chain_start(req)
        hashes, blocks = [], []
        for i in range(max_blocks):
            h = hash_block(h, tuple(tokens[i * self.block_size:(i + 1) * self.block_size]))
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hashes.append(h)
            blocks.append(block)
        for block in blocks:
            self._take(block)
        req.block_table = blocks
        req.block_hashes = hashes
        req.num_computed_tokens = req.prefix_hit_tokens = len(blocks) * self.block_size
        self.hit_tokens += req.prefix_hit_tokens
        if req.metrics.first_scheduled_time is not None:     # scheduled before: preempted since
            self.requeried_tokens += len(tokens)
            self.rehit_tokens += req.prefix_hit_tokens
        return req.prefix_hit_tokens

    def _looks_up(self, req: Request) -> bool:
        """Whether allocate_prefix looks req up in the prefix cache (and counts it): not for mean pooling, which
        needs every prompt token's hidden state (engine/pooling.py), nor for prompt_logprobs while no full block of
        its prompt is scored (cached positions have no logits: it could take none; vLLM counts no lookup there)."""
        if req.prompt_logprobs is not None and len(req.prompt_logprobs) <= self.block_size:
            return False
        return self.enable_prefix_caching and not (req.pooling is not None and req.pooling.mean)

    def cancel_prefix(self, req: Request) -> None:
        """Give back what allocate_prefix took for a request that could not be admitted after all.

        Its lookup is not counted in the hit rate: a request that waits for blocks over many
        steps is looked up again, and counted once, when it is admitted.
        """
        if self._looks_up(req):
            self.queried_tokens -= req.num_tokens
            self.hit_tokens -= req.prefix_hit_tokens
            if req.metrics.first_scheduled_time is not None:
                self.requeried_tokens -= req.num_tokens
                self.rehit_tokens -= req.prefix_hit_tokens
        req.prefix_hit_tokens = 0
        self.free(req)

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Make req's block table cover num_tokens slots. False (and no change) if out of blocks."""
        need = -(-num_tokens // self.block_size) - len(req.block_table)
        if need <= 0:        # most calls: a decode whose block has room
            return True
        if need > len(self.free_queue):
            return False
        req.block_table.extend(self._pop_free() for _ in range(need))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register the hashes of req's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens, req.num_known_tokens) // self.block_size   # ids of pending tokens unknown
        if num_full <= len(req.block_hashes):
            return
        h = req.block_hashes[-1] if req.block_hashes else self._chain_start(req)
        for i in range(len(req.block_hashes), num_full):
            h = hash_block(h, tuple(req.token_ids(i * self.block_size, (i + 1) * self.block_size)))
            req.block_hashes.append(h)
            block = req.block_table[i]
            if block != SLID_OUT and self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.hash_to_block[h] = block
                self.num_registered += 1

    def _chain_start(self, req: Request) -> int:
        """The hash a request's chain of block hashes starts from: the model's salt, the rotary offset of a
        request whose keys are rotated otherwise (LongRoPE's long factors), and the request's cache_salt (its
        blocks match only those of requests with the same one)."""
        salt = getattr(req.params, "cache_salt", None)
        if not req.position_offset and salt is None:
            return self.salt
        return hash((self.salt, req.position_offset, salt))

    def free(self, req: Request) -> None:
        """Drop req's references. Tail blocks go first in line for eviction, hashed ones last."""
        for block in reversed(req.block_table):
            if block != SLID_OUT:
                self._release(block)
        req.block_table = []
        req.num_slid_out_blocks = 0
        req.block_hashes = []
        req.num_computed_tokens = 0

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} freed twice"
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None
            if self.block_hash[block] is None:
                self.free_queue.move_to_end(block, last=False)

    def free_slid_out(self, req: Request, window: int) -> int:
        """Give back req's blocks that no later token will attend to: with every layer attending to its last
        `window` positions at most, the next token (position num_computed_tokens) sees keys from
        num_computed_tokens - window + 1 on, so the blocks wholly before that go. Their table entries become
        SLID_OUT (the table keeps its length: positions still index it; the attention paths start at the window
        and never read them); hashed ones stay in the prefix cache until evicted. Returns how many went."""
        before = min(max(0, req.num_computed_tokens - window + 1) // self.block_size, len(req.block_table))
        start = req.num_slid_out_blocks         # the table's entries before it are SLID_OUT already
        if before > start:
            table = req.block_table.copy()      # a new list: entries are never changed in place (Request.block_table)
            for i in range(start, before):
                self._release(table[i])
                table[i] = SLID_OUT
            req.block_table = table
        req.num_slid_out_blocks = max(start, before)
        return max(0, before - start)

    def reset_prefix_cache(self) -> None:
        for block in self.free_queue:
            self.block_hash[block] = None
        self.hash_to_block = {h: b for h, b in self.hash_to_block.items() if self.ref_counts[b] > 0}
