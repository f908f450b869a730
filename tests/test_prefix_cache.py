"""Prefix caching: token-identical outputs with the cache on and off, hit counts that the shared
prefixes predict, no eviction of blocks in use, and cheap resumption after preemption."""
import random

import pytest

from picovllm import LLM, SamplingParams
from test_parity_hf import hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 384


def shared_prefix_prompts(seed: int, prefix_lens: list[int], suffix_len: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(max(prefix_lens))]
    return [base[:n] + [rng.randrange(VOCAB) for _ in range(suffix_len + i % 3)] for i, n in enumerate(prefix_lens)]


def params_for(prompts, seeded: bool) -> list[SamplingParams]:
    if not seeded:
        return [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * len(prompts)
    return [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=6, ignore_eos=True)
            for i in range(len(prompts))]


def run_rounds(llm: LLM, rounds, seeded: bool):
    return [[o.outputs[0].token_ids for o in llm.generate(r, params_for(r, seeded), use_tqdm=False)] for r in rounds]


class EvictionWatch:
    """Counts evictions of cached blocks and checks, at every allocation, that the block handed out
    belongs to no live request."""

    def __init__(self, engine) -> None:
        self.evictions = 0
        bm, real = engine.block_manager, engine.block_manager._pop_free

        def pop_free():
            block = next(iter(bm.free_queue))
            assert bm.ref_counts[block] == 0
            live = [r for r in engine.requests.values() if block in r.block_table]
            assert not live, f"block {block} handed out while {live} use it"
            self.evictions += bm.block_hash[block] is not None
            return real()

        bm._pop_free = pop_free


# prefix lengths on and off the block boundaries of block_size 8
PREFIX_LENS = [0, 7, 8, 9, 16, 23, 24, 40]


@pytest.mark.parametrize("seeded", [False, True])
def test_cache_on_equals_cache_off(tiny_models, seeded):
    path = tiny_models["llama"]
    rounds = [shared_prefix_prompts(0, PREFIX_LENS), shared_prefix_prompts(0, PREFIX_LENS[::-1]),
              shared_prefix_prompts(0, [40, 40, 17, 8])]
    off = run_rounds(LLM(path, block_size=8, num_kv_blocks=128, enable_prefix_caching=False), rounds, seeded)
    llm = LLM(path, block_size=8, num_kv_blocks=128)
    on = run_rounds(llm, rounds, seeded)
    assert on == off
    bm = llm.engine.block_manager
    assert bm.hit_tokens > 0 and bm.queried_tokens == sum(len(p) for r in rounds for p in r)
    if not seeded:
        assert on[0] == hf_greedy(path, rounds[0], 6)[0]


@pytest.mark.parametrize("seeded", [False, True])
def test_cache_on_equals_cache_off_under_eviction_chunking_and_preemption(tiny_models, seeded):
    path = tiny_models["llama"]
    rounds = [shared_prefix_prompts(s, [0, 8, 13, 24, 31, 40]) for s in (1, 2, 1, 3, 2, 1)]
    cfg = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=20)
    off = run_rounds(LLM(path, enable_prefix_caching=False, **cfg), rounds, seeded)
    llm = LLM(path, **cfg)
    watch = EvictionWatch(llm.engine)
    preempted = []
    real = llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda r: (preempted.append(r.request_id), real(r))
    on = run_rounds(llm, rounds, seeded)
    assert on == off
    assert watch.evictions > 0, "the cache was meant to be too small to keep every prefix"
    assert preempted, "... and to force preemption"
    assert llm.engine.block_manager.hit_tokens > 0


def test_hit_counts_hand_computed(tiny_models):
    """block_size 4. A = P (10 tokens) + 3 output tokens leaves P + o1 o2 in 3 full cached blocks
    (the last output token is never computed). Later prompts hit whole matching blocks, and never
    their own last token."""
    path = tiny_models["llama"]
    rng = random.Random(5)
    P = [rng.randrange(VOCAB) for _ in range(10)]
    llm = LLM(path, block_size=4, num_kv_blocks=64)
    ref = LLM(path, block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    bm = llm.engine.block_manager
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    a = llm.generate([P], sp, use_tqdm=False)[0]
    o = a.outputs[0].token_ids
    assert a.num_cached_tokens == 0 and (bm.queried_tokens, bm.hit_tokens) == (10, 0)
    cases = [  # prompt, cached tokens
        (P[:9] + [1, 2], 8),          # two blocks; the third differs
        (P + o[:2] + [3], 12),        # the generated tokens' block hits too
        (P + o[:2], 8),               # 12 tokens = 3 blocks, but the last token must be computed
        (P[:8], 4),                   # likewise
        ([P[0] + 1] + P[1:], 0),      # the first block differs: nothing after it can hit
        (P[:3], 0),                   # less than a block
        (P, 8),
    ]
    for prompt, hit in cases:
        q0, h0 = bm.queried_tokens, bm.hit_tokens
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert out.num_cached_tokens == hit, prompt
        assert (bm.queried_tokens - q0, bm.hit_tokens - h0) == (len(prompt), hit)
        assert out.outputs[0].token_ids == ref.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    # identical prompts admitted in the same step cannot share: blocks are cached once computed
    same = [rng.randrange(VOCAB) for _ in range(13)]
    assert [o.num_cached_tokens for o in llm.generate([same, same], sp, use_tqdm=False)] == [0, 0]
    assert llm.generate([same], sp, use_tqdm=False)[0].num_cached_tokens == 12
    assert [o.num_cached_tokens for o in ref.generate([P, P], sp, use_tqdm=False)] == [0, 0]
    assert ref.engine.block_manager.hit_tokens == 0


def test_preempted_request_resumes_from_cache(tiny_models):
    path = tiny_models["llama"]
    prompts = shared_prefix_prompts(7, [0, 10, 19, 25, 30, 33], suffix_len=6)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    cfg = dict(block_size=4, num_kv_blocks=16)
    ref, _ = hf_greedy(path, prompts, 10)
    results = {}
    for caching in (False, True):
        llm = LLM(path, enable_prefix_caching=caching, **cfg)
        eng = llm.engine
        preempted = []
        real = eng.scheduler.preempt
        eng.scheduler.preempt = lambda r: (preempted.append((r, r.num_computed_tokens)), real(r))
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert preempted, "the cache was meant to force preemption"
        results[caching] = (eng.stats.prefill_tokens, preempted)
    prefill_on, preempted = results[True]
    assert prefill_on < results[False][0], "resumed requests should recompute less with the cache on"
    resumed = [r.prefix_hit_tokens for r, computed in preempted if computed > 4]     # at re-admission
    assert any(n > 0 for n in resumed), f"no preempted request resumed from its cached blocks: {resumed}"


def test_block_hashes_are_the_same_in_every_process():
    """Prefill and decode engines run in different processes: a block's hash must not depend on
    the process's string-hash seed."""
    import os
    import subprocess
    import sys

    from picovllm.engine.block_manager import hash_block, prefix_salt

    code = ("from picovllm.engine.block_manager import hash_block, prefix_salt\n"
            "s = prefix_salt('/models/m.gguf', 'torch.float32')\n"
            "print(s, hash_block(s, (1, 2, 3)))")
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"     # not this process's seed
    env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1")
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    salt = prefix_salt("/models/m.gguf", "torch.float32")
    assert other.split() == [str(salt), str(hash_block(salt, (1, 2, 3)))]
    assert prefix_salt("/models/m.gguf", "torch.bfloat16") != salt      # the dtype is part of the identity


def test_abort_of_requests_sharing_blocks(tiny_models):
    """Aborting requests that share cached blocks (mid-prefill, decoding, waiting) frees only their own
    references: the others finish exactly as in a clean run."""
    path = tiny_models["llama"]
    warm, *prompts = shared_prefix_prompts(9, [40, 40, 36, 33, 40, 25, 40])
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cfg = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=10, max_num_seqs=4)
    llm = LLM(path, **cfg)
    llm.generate([warm], sp, use_tqdm=False)            # its blocks are now cached
    eng = llm.engine
    watch = EvictionWatch(eng)
    ids = [eng.add_request(p, sp) for p in prompts]
    by_state = {}
    for _ in range(6):
        eng.step()
        by_state = {}
        for i in ids:
            if i in eng.requests:
                by_state.setdefault(eng.requests[i].status.value, i)
        if len(by_state) == 3:
            break
    assert set(by_state) == {"decoding", "prefill", "waiting"}, by_state
    victims = list(by_state.values())
    for v in victims:
        assert eng.abort(v).outputs[0].finish_reason == "abort"
    final = {}
    while eng.has_unfinished_requests():
        final.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    survivors = [i for i in ids if i not in victims]
    clean = LLM(path, enable_prefix_caching=False, **cfg).generate(
        [prompts[ids.index(i)] for i in survivors], sp, use_tqdm=False)
    assert [final[i] for i in survivors] == [o.outputs[0].token_ids for o in clean]
    assert watch.evictions == 0
