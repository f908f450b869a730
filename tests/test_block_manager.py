"""BlockManager and Scheduler on hand-computed cases, without a model.

A step is simulated as the engine does it: every scheduled chunk's tokens become computed, full
blocks are registered in the prefix cache, and a chunk that reaches the end of a request's
tokens yields one new token.
"""
from picovllm.engine.block_manager import BlockManager
from picovllm.engine.request import Request, RequestStatus
from picovllm.engine.scheduler import Scheduler
from picovllm.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=100))


def run_step(sched: Scheduler, out, new_token: int = 7) -> None:
    for c in out.chunks:
        samples = c.samples
        c.request.num_computed_tokens += c.num_new_tokens
        sched.block_manager.cache_full_blocks(c.request)
        if samples:
            c.request.output_token_ids.append(new_token)
            c.request.status = RequestStatus.DECODING


def plan(out) -> list[tuple[str, int]]:
    return [(c.request.request_id, c.num_new_tokens) for c in out.chunks]


def compute(bm: BlockManager, r: Request, n: int) -> None:
    """Pretend r's first n tokens were computed into its blocks."""
    assert bm.allocate(r, n)
    r.num_computed_tokens = n
    bm.cache_full_blocks(r)


# -- BlockManager --------------------------------------------------------------------------------
def test_allocate_and_free_without_caching():
    bm = BlockManager(6, 4, enable_prefix_caching=False)
    a, b = req("a", list(range(10))), req("b", list(range(9)))
    assert bm.allocate_prefix(a) == 0
    assert bm.blocks_needed(a, 10) == 3
    assert bm.allocate(a, 10) and a.block_table == [0, 1, 2]
    assert bm.allocate(a, 12) and a.block_table == [0, 1, 2]          # 12 slots fit in 3 blocks
    assert bm.allocate(a, 13) and a.block_table == [0, 1, 2, 3]
    assert not bm.allocate(b, 9) and b.block_table == [] and bm.num_free_blocks == 2  # needs 3, 2 free
    a.num_computed_tokens = 13
    bm.cache_full_blocks(a)
    assert bm.hash_to_block == {} and bm.block_hash == [None] * 6     # caching off: nothing registered
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.ref_counts == [0] * 6 and a.num_computed_tokens == 0
    assert bm.queried_tokens == bm.hit_tokens == 0


def test_prefix_hits_hand_computed():
    bm = BlockManager(8, 4)
    a = req("a", list(range(10)))                 # blocks [0 1 2 3] [4 5 6 7] [8 9 . .]
    assert bm.allocate_prefix(a) == 0
    compute(bm, a, 10)
    assert a.block_table == [0, 1, 2]
    assert bm.block_hash[0] is not None and bm.block_hash[1] is not None and bm.block_hash[2] is None
    bm.free(a)
    # unhashed tail block first in line for eviction, then untouched blocks, then the chain tail-first
    assert list(bm.free_queue) == [2, 3, 4, 5, 6, 7, 1, 0]

    cases = [  # prompt -> tokens served from cache
        (list(range(8)) + [100, 101], 8),          # both full blocks shared
        (list(range(8)), 4),                       # exactly two blocks: the last token must be computed
        (list(range(4)) + [5, 5, 5, 5, 1], 4),     # second block differs
        ([99] + list(range(1, 10)), 0),            # first block differs, nothing after it counts
        ([50, 51, 52, 53, 4, 5, 6, 7, 1], 0),      # same second block after another first: chained hash
        (list(range(3)), 0),                       # shorter than a block
    ]
    held = []
    for i, (tokens, hit) in enumerate(cases):
        r = req(f"r{i}", tokens)
        assert bm.allocate_prefix(r) == hit, tokens
        assert r.num_computed_tokens == r.prefix_hit_tokens == hit
        assert r.block_table == [0, 1][:hit // 4]
        held.append(r)
    assert bm.ref_counts[0] == 3 and bm.ref_counts[1] == 1          # shared, not copied
    assert 0 not in bm.free_queue and 1 not in bm.free_queue
    assert bm.queried_tokens == 10 + sum(len(t) for t, _ in cases)
    assert bm.hit_tokens == sum(h for _, h in cases)
    for r in held:
        bm.free(r)
    assert bm.ref_counts == [0] * 8 and bm.num_free_blocks == 8


def test_block_in_use_is_never_evicted():
    bm = BlockManager(4, 2)
    a = req("a", [1, 2, 3, 4, 5])
    bm.allocate_prefix(a)
    compute(bm, a, 5)                             # a keeps running: blocks 0, 1 hashed, 2 partial
    assert a.block_table == [0, 1, 2] and list(bm.free_queue) == [3]
    b = req("b", [1, 2, 3, 4, 9])
    assert bm.allocate_prefix(b) == 4 and b.block_table == [0, 1]
    assert bm.allocate(b, 5) and b.block_table == [0, 1, 3] and bm.num_free_blocks == 0
    c = req("c", [7, 7, 7, 7, 7])
    assert bm.allocate_prefix(c) == 0
    assert not bm.allocate(c, 5)                  # no free block: fails, steals nothing
    hashes = {h: blk for h, blk in bm.hash_to_block.items()}
    assert sorted(hashes.values()) == [0, 1]
    bm.free(b)
    assert bm.ref_counts[:2] == [1, 1] and list(bm.free_queue) == [3]   # a still holds 0 and 1
    assert not bm.allocate(c, 5)
    assert bm.hash_to_block == hashes
    bm.free(a)
    assert list(bm.free_queue) == [2, 3, 1, 0]
    assert bm.allocate(c, 5) and c.block_table == [2, 3, 1]     # evicts the chain's tail (block 1) only
    assert list(bm.hash_to_block.values()) == [0] and bm.block_hash[1] is None
    d = req("d", [1, 2, 3, 4, 5])
    assert bm.allocate_prefix(d) == 2 and d.block_table == [0]
    bm.free(c)
    bm.free(d)
    assert bm.num_free_blocks == bm.num_blocks


def test_eviction_is_least_recently_used():
    bm = BlockManager(4, 2)
    a, b = req("a", [1, 1, 9]), req("b", [2, 2, 9])
    for r in (a, b):
        bm.allocate_prefix(r)
        compute(bm, r, 2)                        # one full hashed block each: a -> 0, b -> 1
    bm.free(a)
    bm.free(b)                                   # a's block is now older than b's
    a2 = req("a2", [1, 1, 5])
    assert bm.allocate_prefix(a2) == 2           # a hit touches block 0 ...
    bm.free(a2)                                  # ... so b's block 1 is now the least recent
    assert list(bm.free_queue) == [2, 3, 1, 0]
    filler = req("f", [3] * 6)
    assert bm.allocate(filler, 6) and filler.block_table == [2, 3, 1]
    assert bm.allocate_prefix(req("b2", [2, 2, 5])) == 0   # b's block was evicted
    a3 = req("a3", [1, 1, 5])
    assert bm.allocate_prefix(a3) == 2           # a's survived
    bm.free(a3)
    bm.free(filler)


# -- Scheduler -----------------------------------------------------------------------------------
def test_chunked_prefill_budget_and_max_num_seqs():
    bm = BlockManager(100, 4, enable_prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=10)
    r1, r2, r3 = req("r1", [1] * 7), req("r2", [2] * 6), req("r3", [3] * 3)
    for r in (r1, r2, r3):
        s.add(r)
    expected = [
        [("r1", 7), ("r2", 3)],      # r2's prompt is chunked to fit the budget; r3 waits (max_num_seqs)
        [("r1", 1), ("r2", 3)],      # decodes first, then the rest of r2's prompt
        [("r1", 1), ("r2", 1)],
    ]
    for want in expected:
        out = s.schedule()
        assert plan(out) == want
        run_step(s, out)
    s.finish(r1)
    out = s.schedule()
    assert plan(out) == [("r2", 1), ("r3", 3)]
    run_step(s, out)
    s.finish(r2)
    s.finish(r3)
    assert not s.has_unfinished() and bm.num_free_blocks == 100


def test_decodes_are_never_starved_by_prefills():
    bm = BlockManager(100, 4, enable_prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=4)
    short, long_ = req("s", [1, 2]), req("l", [5] * 30)
    s.add(short)
    out = s.schedule()
    assert plan(out) == [("s", 2)]
    run_step(s, out)
    s.add(long_)
    for _ in range(5):                        # the long prompt gets only what the decode leaves
        out = s.schedule()
        assert plan(out) == [("s", 1), ("l", 3)]
        run_step(s, out)
    s.finish(short)
    s.finish(long_)


def test_preempted_request_resumes_from_its_cached_blocks():
    bm = BlockManager(4, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    r1 = req("r1", list(range(8)))             # 2 blocks
    r2 = req("r2", list(range(20, 27)))        # 7 tokens, 2 blocks
    s.add(r1)
    s.add(r2)
    out = s.schedule()
    assert plan(out) == [("r1", 8), ("r2", 7)] and r1.block_table == [0, 1] and r2.block_table == [2, 3]
    run_step(s, out)                           # r2's first block (tokens 20..23) is now cached
    out = s.schedule()                         # r1 needs a third block: r2, admitted last, is preempted
    assert out.preempted == [r2] and plan(out) == [("r1", 1)]
    assert r2.status == RequestStatus.WAITING and r2.block_table == [] and list(s.waiting) == [r2]
    assert r1.block_table == [0, 1, 3]         # r2's unhashed tail block went first
    run_step(s, out)
    s.finish(r1)                               # r1 finishes
    queried, hit = bm.queried_tokens, bm.hit_tokens
    out = s.schedule()
    # r2 = 7 prompt + 1 output token; its first block comes back from the cache, 4 tokens remain
    assert plan(out) == [("r2", 4)] and r2.num_cached_tokens == 4 and r2.block_table[0] == 2
    assert (bm.queried_tokens - queried, bm.hit_tokens - hit) == (8, 4)
    run_step(s, out)
    s.finish(r2)
    assert bm.num_free_blocks == bm.num_blocks


def test_hit_rate_counts_each_admission_once():
    """A request that waits for blocks across several steps is one prefix-cache query, not one per step."""
    bm = BlockManager(5, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    warm = req("warm", list(range(9)))
    s.add(warm)
    run_step(s, s.schedule())
    s.finish(warm)                             # blocks 0, 1 cached
    big = req("big", [50] * 9)                 # holds the 3 other blocks, room for 3 decode steps
    s.add(big)
    run_step(s, s.schedule())
    late = req("late", list(range(8)) + [60] * 3)   # 8 cached tokens, needs 1 more block: none free
    s.add(late)
    before = (bm.queried_tokens, bm.hit_tokens)
    for _ in range(3):
        out = s.schedule()
        assert plan(out) == [("big", 1)]
        run_step(s, out)
    assert (bm.queried_tokens, bm.hit_tokens) == before     # not admitted: nothing counted yet
    s.finish(big)
    out = s.schedule()
    assert plan(out) == [("late", 3)] and late.num_cached_tokens == 8
    assert (bm.queried_tokens - before[0], bm.hit_tokens - before[1]) == (11, 8)
    run_step(s, out)
    s.finish(late)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_mean_pooling_request_given_back_leaves_the_lookup_counts_alone():
    """Mean pooling is never looked up in the prefix cache (every token's hidden state is needed), so giving such
    a request back (cancel_prefix: it could not be admitted) takes nothing off the counts; it had subtracted its
    tokens from queried_tokens (negative after one refusal), which /metrics reports."""
    from picovllm.engine.pooling import Pooling
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    other = req("a", list(range(9)))
    assert bm.allocate_prefix(other) == 0
    r = req("mean", list(range(9)))
    r.pooling = Pooling(mean=True, normalize=True)
    assert bm.allocate_prefix(r) == 0
    bm.cancel_prefix(r)
    assert (bm.queried_tokens, bm.hit_tokens) == (9, 0)      # other's lookup only
    bm.free(other)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_head_without_room_is_looked_up_again_only_when_something_changed():
    """The queue's head that found no room is not looked up again (its prefix hashed, its cached blocks taken and
    given back) at every step while the others decode: only once more blocks are cached or free. By hand: lookups a
    step, and the admission once the running request gives its blocks back."""
    bm = BlockManager(4, 4)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    lookups = []
    real = bm.allocate_prefix
    bm.allocate_prefix = lambda r: (lookups.append(r.request_id), real(r))[1]
    big = req("big", [50] * 8)                   # blocks 0, 1
    s.add(big)
    run_step(s, s.schedule())
    late = req("late", list(range(9)))           # needs 3 blocks
    s.add(late)
    per_step = []
    for step in range(6):
        n = len(lookups)
        out = s.schedule()
        per_step.append(len(lookups) - n)
        run_step(s, out)
        if step == 4:
            s.finish(big)
    # step 0: big takes a third block, 1 left: late looked up, no room; steps 1-3: nothing changed; step 3 fills
    # big's third block (cached), so step 4 looks again (big has taken the last block: no room); step 5 after big
    # finished: admitted
    assert per_step == [1, 0, 0, 0, 1, 1] and plan(out) == [("late", 9)]
    run_step(s, out)
    s.finish(late)
    assert bm.num_free_blocks == bm.num_blocks


def test_staged_tables_write_what_changed_and_cut_at_the_width():
    """The graph runners' StagedTables (a kept host array, each row writing only what its table gained since the row
    held it): by hand, a row that grew, one given a new list of the same length, rows that moved up when one left,
    and a table longer than the array, cut at its width."""
    import torch

    from picovllm.engine.cuda_graph import StagedTables
    staged, dst = StagedTables(4, 3), torch.full((4, 3), -1, dtype=torch.int32)
    a, b, c = [1], [2, 3], [4, 5, 6, 7]
    for step in range(4):          # each version twice: the second upload writes nothing
        if step == 2:
            a.append(8)            # grown in place
            b = [9, 10]            # replaced: same length, other entries
        staged.upload([a, b, c], 3, dst)
        assert [dst[0, :len(a)].tolist(), dst[1, :2].tolist(), dst[2].tolist()] == \
            [[1] if step < 2 else [1, 8], [2, 3] if step < 2 else [9, 10], [4, 5, 6]]
    for _ in range(2):
        staged.upload([b, c], 2, dst)      # a left: b and c move up a row
        assert dst[:2, :2].tolist() == [[9, 10], [4, 5]]


def test_eager_step_tensors_stage_tables_as_converted_anew():
    """The eager steps' block tables (step_tensors with a runner's StagedTables) against each table converted anew
    (the path without one): 60 random steps of rows that grow in place, get new lists, leave, come back in another
    order, outnumber the kept rows or outgrow its width (then converted anew). Entries past a row's end may differ."""
    import random

    import torch

    from picovllm.engine.cuda_graph import StagedTables
    from picovllm.engine.step_input import StepInput, step_tensors
    rng = random.Random(7)
    staged, cpu = StagedTables(6, 8), torch.device("cpu")
    pool = [[rng.randrange(100) for _ in range(rng.randint(1, 4))] for _ in range(10)]
    for k in range(60):
        if k == 30:    # tables of one entry: the staged rows' one column is a strided view
            pool[:3] = [[1], [2], [3]]
        for i, t in enumerate(pool if k != 30 else ()):
            r = rng.random()
            if r < 0.3:
                t.extend(rng.randrange(100) for _ in range(rng.randint(1, 2 if len(t) < 8 else 3)))
            elif r < 0.4:
                pool[i] = [rng.randrange(100) for _ in range(rng.randint(1, 8))]
        tables = rng.sample(pool, rng.randint(1, 8)) if k != 30 else pool[:3]
        n = len(tables)
        step = StepInput([0] * n, [0] * n, [0] * n, list(range(n + 1)), [1] * n, tables, n, list(range(n)), [],
                         [], [], [], [], [])
        got = step_tensors(step, cpu, staged=staged)[2].block_tables
        want = step_tensors(step, cpu)[2].block_tables
        assert got.shape == want.shape == (n, max(len(t) for t in tables))
        for row, t in enumerate(tables):
            assert got[row, :len(t)].tolist() == want[row, :len(t)].tolist() == t
