"""The engine core's features together, at random: prefix caching (with cache_salt), recompute preemption (a small
KV cache), chunked prefill (a small token budget), n-gram speculative decoding, overlapped scheduling, priority
scheduling, aborts at random steps, sliding-window block freeing, n > 1 samples sharing prompt blocks, logprobs,
prompt logprobs, min_tokens, stop strings and ids, bad words, penalties, DELTA outputs.

The oracle: the same requests one at a time on an engine with a big cache, no prefix caching, no speculation and
no chunking. Greedy and seeded requests must give its very tokens, text and finish reason, and its logprobs to
1e-3 (README: a request's own seed makes its tokens independent of the batch). After every step the block
bookkeeping must match the live requests' tables, and a block shared by two requests must hold the same salt and
tokens for both; at the end every block is free (conftest) and the prefix cache's counters add up to the
requests' own.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from conftest import assert_engine_clean, build_tiny_checkpoint
from picovllm import LLM, SamplingParams
from picovllm.engine.block_manager import SLID_OUT
from picovllm.engine.cuda_graph import StagedTables
from picovllm.sampling_params import RequestOutputKind
from serving_fixtures import build_tiny_chat_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tiny models on a shared 2-core machine

VOCAB = 384
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
TOL = 1e-3


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("interplay")
    return {"llama": tiny_models["llama"],
            # every layer slides (an 8-token window): blocks behind it are given back as requests go
            "sliding": build_tiny_checkpoint(str(root / "sliding"), "qwen2", use_sliding_window=True,
                                             sliding_window=8, max_window_layers=0),
            "chat": build_tiny_chat_model(str(root / "chat"))}      # a tokenizer: stop strings, bad words


# -- random requests ---------------------------------------------------------------------------------------------
def random_prompt(rng: random.Random, bases: list[list[int]]) -> list[int]:
    """Often a shared base's prefix (prefix-cache hits), often a phrase said again (n-gram drafts), then noise."""
    p = []
    if rng.random() < 0.6:
        b = rng.choice(bases)
        p += b[:rng.randrange(1, len(b) + 1)]
    if rng.random() < 0.4:
        p += [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 6))] * rng.randrange(2, 4)
    return (p + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 12))])[:50]


def looping_params(rng: random.Random, with_text: bool) -> tuple[list[int], dict]:
    """A long run over a few allowed tokens: the model loops, so drafts are kept (and min_tokens holds off a stop
    id that is one of them)."""
    few = rng.sample(range(3, VOCAB), 3) if rng.random() < 0.7 else None
    kw = dict(temperature=0.7, seed=rng.randrange(100)) if rng.random() < 0.3 else dict(temperature=0)
    if few and rng.random() < 0.5:
        kw.update(stop_token_ids=[few[0]], min_tokens=rng.randrange(0, 15))
    if with_text and not few and rng.random() < 0.5:
        kw["bad_words"] = ["e", "a"]
    kw.update(max_tokens=rng.randrange(20, 40), ignore_eos=True, allowed_token_ids=few,
              logprobs=rng.choice([None, 2]), cache_salt=rng.choice([None, "A"]))
    return (few or []) * 2, kw


def mixed_params(rng: random.Random, with_text: bool) -> dict:
    kw = dict(max_tokens=rng.randrange(1, 24), ignore_eos=rng.random() < 0.7)
    if rng.random() < 0.5:
        kw["temperature"] = 0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.5]), seed=rng.randrange(1000), top_p=rng.choice([1.0, 0.9]),
                  top_k=rng.choice([0, 20]))
    maybe = [("logprobs", 0.4, lambda: rng.choice([0, 1, 3])), ("prompt_logprobs", 0.3, lambda: rng.choice([0, 2])),
             ("min_tokens", 0.3, lambda: rng.randrange(0, kw["max_tokens"] + 1)),
             ("stop_token_ids", 0.3, lambda: [rng.randrange(3, VOCAB)]),
             ("cache_salt", 0.4, lambda: rng.choice(["A", "B"])), ("repetition_penalty", 0.2, lambda: 1.3),
             ("presence_penalty", 0.2, lambda: 0.5), ("frequency_penalty", 0.2, lambda: 0.7),
             ("logit_bias", 0.2, lambda: {rng.randrange(3, VOCAB): 5.0}),
             ("output_kind", 0.4, lambda: RequestOutputKind.DELTA)]
    if with_text:
        maybe += [("stop", 0.3, lambda: [rng.choice(["a", "e", " t", "th", "."])]),
                  ("bad_words", 0.3, lambda: [rng.choice(["a", "the", " t", "e", "in"])]),
                  ("include_stop_str_in_output", 0.2, lambda: True)]
    for name, p, value in maybe:
        if rng.random() < p:
            kw[name] = value()
    return kw


def random_requests(rng: random.Random, n: int, with_text: bool) -> list[tuple[list[int], SamplingParams, int]]:
    """n (prompt, params, priority)."""
    bases = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    reqs = []
    for _ in range(n):
        prompt = random_prompt(rng, bases)
        if rng.random() < 0.25:
            extra, kw = looping_params(rng, with_text)
            prompt = prompt + extra
        else:
            kw = mixed_params(rng, with_text)
        reqs.append((prompt, SamplingParams(**kw), rng.randrange(0, 3)))
    return reqs


def random_config(seed: int, kind: str) -> dict:
    rng = random.Random(seed * 7 + 1)
    cfg = dict(block_size=rng.choice([1, 2, 4, 8]), max_num_batched_tokens=rng.choice([1, 2, 3, 8, 16, 64]),
               max_model_len=rng.choice([None, 60, 70]), max_num_seqs=rng.choice([2, 4, 256]),
               async_scheduling=rng.random() < 0.5, scheduling_policy=rng.choice(["fcfs", "priority"]),
               enable_prefix_caching=rng.random() < 0.85)
    # 112 tokens: preemptions; a sliding model: its window, a chunk and a few blocks
    tokens = 8 + cfg["max_num_batched_tokens"] + 3 * cfg["block_size"] if kind == "sliding" else 112
    cfg["num_kv_blocks"] = -(-tokens // cfg["block_size"])
    if rng.random() < 0.6:
        cfg["speculative_config"] = dict(SPEC, num_speculative_tokens=rng.choice([1, 3, 5, 9]))
    return cfg


# -- the oracle and the checks -----------------------------------------------------------------------------------
def one_at_a_time(path: str, reqs, max_model_len: int | None = None) -> list:
    llm = LLM(path, block_size=16, num_kv_blocks=256, enable_prefix_caching=False, max_num_batched_tokens=4096,
              max_model_len=max_model_len, async_scheduling=False)
    return [llm.generate([p], sp, use_tqdm=False)[0] for p, sp, _ in reqs]


def reproducible(sp: SamplingParams) -> bool:
    return sp.temperature == 0 or sp.seed is not None


def assert_same(ref, got, tag) -> None:
    """got's (prompt) logprobs, tokens, text and finish reason are ref's; both (RequestOutput, CompletionOutput)."""
    (ref_out, r), (got_out, g) = ref, got
    assert list(g.token_ids) == list(r.token_ids), tag
    assert (g.finish_reason, g.text) == (r.finish_reason, r.text), tag
    if r.logprobs is not None:
        assert len(g.logprobs) == len(r.logprobs), tag
        for a, b in zip(r.logprobs, g.logprobs):
            assert all(abs(a[t].logprob - b[t].logprob) < TOL for t in a if t in b), (tag, a, b)
            first = next(iter(a))        # the sampled token's
            assert first in b and abs(a[first].logprob - b[first].logprob) < TOL, (tag, a, b)
    if ref_out.prompt_logprobs is not None:
        assert len(got_out.prompt_logprobs) == len(ref_out.prompt_logprobs), tag
        for a, b in zip(ref_out.prompt_logprobs[1:], got_out.prompt_logprobs[1:]):
            assert all(t in b and abs(a[t].logprob - b[t].logprob) < TOL for t in a), (tag, a, b)


class BlockWatch:
    """After each step: the ref counts are the live requests' table entries, the free queue the unreferenced
    blocks, and a cached block in a request's table holds what that request's hash for it says: the salt and all
    the tokens up to the block's end of the request that registered it."""

    def __init__(self, engine) -> None:
        self.engine, self.owner = engine, {}
        self.tables: dict[str, tuple[list[int], tuple[int, ...]]] = {}   # by request: its table and entries then
        self.staged, self.dst = StagedTables(256, 1024), torch.full((256, 1024), -7, dtype=torch.int32)
        bm = engine.block_manager
        real = bm.cache_full_blocks

        def cache_full_blocks(req):
            before = list(bm.block_hash)
            real(req)
            for i, b in enumerate(req.block_table):
                if b != SLID_OUT and bm.block_hash[b] is not None and before[b] is None:
                    self.owner[b] = self.content(req, i)
        bm.cache_full_blocks = cache_full_blocks

    def content(self, req, i: int) -> tuple:
        bs = self.engine.block_manager.block_size
        return req.params.cache_salt, req.position_offset, tuple(req.token_ids(0, (i + 1) * bs))

    def check(self) -> None:
        bm = self.engine.block_manager
        refs = [0] * bm.num_blocks
        for req in self.engine.requests.values():
            for i, b in enumerate(req.block_table if not req.is_finished else []):
                if b == SLID_OUT:
                    continue
                refs[b] += 1
                if bm.block_hash[b] is not None and i < len(req.block_hashes):
                    assert bm.block_hash[b] == req.block_hashes[i], (req, i, b)
                    assert self.owner[b] == self.content(req, i), f"{req} shares block {b} of other tokens or salt"
        assert refs == bm.ref_counts
        assert set(bm.free_queue) == {b for b in range(bm.num_blocks) if refs[b] == 0}
        assert all(bm.block_hash[b] == h for h, b in bm.hash_to_block.items())
        self.check_tables()

    def check_tables(self) -> None:
        """A table is only appended to in place (Request.block_table's rule, which the graph runners' StagedTables
        rely on); the live tables staged in engine order (rows shift as requests leave) land whole in dst."""
        live = [r for r in self.engine.requests.values() if not r.is_finished]
        for req in live:
            table, then = self.tables.get(req.request_id, (None, ()))
            if req.block_table is table:
                assert tuple(table[:len(then)]) == then, f"{req}'s table was changed in place"
        self.tables = {r.request_id: (r.block_table, tuple(r.block_table)) for r in live}
        tables = [r.block_table for r in live]
        width = max([len(t) for t in tables] + [1])
        self.staged.upload(tables, width, self.dst)
        for row, table in zip(self.dst, tables):
            assert row[:len(table)].tolist() == table


class Collected:
    """A request's outputs as a client sees them: DELTA ones added up, cumulative ones never taking anything back."""

    def __init__(self, params: SamplingParams) -> None:
        self.delta = params.output_kind == RequestOutputKind.DELTA
        self.text, self.token_ids, self.logprobs, self.prompt_logprobs = "", [], None, None
        self.final = None

    def add(self, out) -> None:
        c = out.outputs[0]
        if self.delta:
            self.text, self.token_ids = self.text + c.text, self.token_ids + list(c.token_ids)
        else:
            assert c.text.startswith(self.text) and list(c.token_ids[:len(self.token_ids)]) == self.token_ids
            self.text, self.token_ids = c.text, list(c.token_ids)
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(c.logprobs) if self.delta else list(c.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.final = out

    def as_output(self):
        comp = dataclasses.replace(self.final.outputs[0], text=self.text, token_ids=self.token_ids,
                                   logprobs=self.logprobs)
        return dataclasses.replace(self.final, prompt_logprobs=self.prompt_logprobs), comp


def drive(engine, reqs, rng: random.Random, abort_p: float) -> tuple[dict[int, Collected], set[int]]:
    """Add the requests a few at a time in random order, step, abort a live one now and then."""
    watch, ids, seen, aborted = BlockWatch(engine), {}, {}, set()
    todo = list(enumerate(reqs))
    rng.shuffle(todo)
    by_priority = engine.config.scheduling_policy == "priority"
    for _ in range(5000):
        if not (todo or engine.has_unfinished_requests()):
            break
        for _ in range(rng.randrange(0, 4)):
            if todo:
                i, (prompt, sp, priority) = todo.pop()
                ids[engine.add_request(prompt, sp, priority=priority if by_priority else 0)] = i
                seen[i] = Collected(sp)
        for out in engine.step():
            seen[ids[out.request_id]].add(out)
        watch.check()
        live = [rid for rid in engine.requests if not engine.requests[rid].is_finished]
        if live and rng.random() < abort_p:
            rid = rng.choice(live)
            aborted.add(ids[rid])
            out = engine.abort(rid)
            if out is not None:
                seen[ids[rid]].add(out)
    assert not todo and not engine.has_unfinished_requests()
    return seen, aborted


def assert_cache_counters(engine, finals, params) -> None:
    """The hit and query counters, less preempted requests' lookups, are the admitted requests' own numbers (finals
    and their params in the same order); a prompt_logprobs request's first admission reads no cached block and is no
    lookup (as vLLM's skip_reading_prefix_cache)."""
    bm = engine.block_manager
    admitted = [(o, sp) for o, sp in zip(finals, params) if o.metrics.first_scheduled_time is not None]
    if bm.enable_prefix_caching:
        assert bm.queried_tokens - bm.requeried_tokens == sum(len(o.prompt_token_ids) for o, sp in admitted
                                                              if sp.prompt_logprobs is None)
    assert bm.hit_tokens - bm.rehit_tokens == sum(o.num_cached_tokens for o, _ in admitted)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("kind", ["llama", "sliding", "chat"])
def test_random_mix_matches_one_at_a_time(models, kind, seed):
    rng = random.Random(seed)
    reqs = random_requests(rng, 24, with_text=kind == "chat")
    cfg = random_config(seed, kind)
    want = one_at_a_time(models[kind], reqs, cfg["max_model_len"])
    llm = LLM(models[kind], **cfg)
    seen, aborted = drive(llm.engine, reqs, rng, abort_p=0.03)
    for i, (_, sp, _) in enumerate(reqs):
        assert seen[i].final is not None and seen[i].final.finished, i
        if i not in aborted and reproducible(sp):
            assert_same((want[i], want[i].outputs[0]), seen[i].as_output(), (kind, seed, i, sp))
    assert_engine_clean(llm.engine)
    assert_cache_counters(llm.engine, [seen[i].final for i in range(len(reqs))], [sp for _, sp, _ in reqs])


@pytest.mark.parametrize("seed", range(3))
def test_parallel_samples_match_one_at_a_time(models, seed):
    """LLM.generate with n > 1 (siblings take the first sample's prompt blocks), cache_salt from the prompt dicts,
    priorities: sample j of a seeded request is the request alone with seed + j; greedy samples are all the same."""
    rng = random.Random(100 + seed)
    reqs = [(p, dataclasses.replace(sp, n=rng.choice([1, 2, 3]), output_kind=RequestOutputKind.CUMULATIVE), pr)
            for p, sp, pr in random_requests(rng, 16, with_text=False)]
    cfg = random_config(100 + seed, "llama")
    llm = LLM(models["llama"], **cfg)
    watch = BlockWatch(llm.engine)
    step = llm.engine.step
    llm.engine.step = lambda *a: (step(*a), watch.check())[0]
    prompts = [{"prompt_token_ids": p, **({"cache_salt": sp.cache_salt} if sp.cache_salt else {})} for p, sp, _ in reqs]
    priority = [pr for *_, pr in reqs] if cfg["scheduling_policy"] == "priority" else None
    outs = llm.generate(prompts, [dataclasses.replace(sp, cache_salt=None) for _, sp, _ in reqs], use_tqdm=False,
                        priority=priority)
    samples = [dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + j,
                                   prompt_logprobs=sp.prompt_logprobs if j == 0 else None)
               for _, sp, _ in reqs for j in range(sp.n)]
    sample_prompts = [p for p, sp, _ in reqs for _ in range(sp.n)]
    want = iter(one_at_a_time(models["llama"], [(p, s, 0) for p, s in zip(sample_prompts, samples)],
                              cfg["max_model_len"]))
    for i, ((_, sp, _), out) in enumerate(zip(reqs, outs)):
        assert len(out.outputs) == sp.n
        for j, comp in enumerate(out.outputs):
            ref = next(want)
            if reproducible(sp):
                assert_same((ref, ref.outputs[0]), (out, comp), (seed, i, j))
    assert_engine_clean(llm.engine)


def test_cache_salt_hits_only_within_its_salt(models):
    """A prompt cached under one salt is a hit under the same salt only: not under another, nor without one (and
    an unsalted one not under a salt); n > 1 siblings hit their first sample's blocks under its salt."""
    llm = LLM(models["llama"], block_size=4, num_kv_blocks=64)
    prompt = list(range(10, 30))

    def cached(salt, n=1):
        out = llm.generate([{"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}],
                           SamplingParams(temperature=0, max_tokens=3, n=n), use_tqdm=False)[0]
        return out.num_cached_tokens
    assert [cached(s) for s in ("A", "A", "B", None, None, "B")] == [0, 16, 0, 0, 16, 16]
    before = llm.engine.block_manager.hit_tokens
    assert cached("C", n=3) == 0
    assert llm.engine.block_manager.hit_tokens - before == 2 * 16       # the two siblings'
    assert_engine_clean(llm.engine)


def test_pooling_cache_salt_keeps_prefix_caches_apart(models):
    """An embedding request's cache_salt (PoolingParams', the /v1/embeddings field) keeps its prefix-cache hits
    within its salt, as a generating request's does. It was dropped: the pooling request's blocks were hashed
    unsalted, so another tenant's (or an unsalted) prompt hit them."""
    llm = LLM(models["llama"], runner="pooling", block_size=4, num_kv_blocks=64)
    prompt = list(range(10, 30))

    def cached(salt):
        return llm.embed([{"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}],
                         use_tqdm=False)[0].num_cached_tokens
    assert [cached(s) for s in ("A", "A", "B", None, "B", None)] == [0, 16, 0, 0, 16, 16]
    assert_engine_clean(llm.engine)
