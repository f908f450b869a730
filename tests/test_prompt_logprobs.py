"""SamplingParams.prompt_logprobs against HF transformers' logits on the same weights (fp32, CPU): every
prompt token's logprob, rank and the top-k, through chunked prefill, prefix-cache hits, preemption,
overlapped scheduling, n > 1 and tensor parallelism; and the bound on a step's logit rows that the memory profile
reserves (engine/scheduler.py max_logit_rows), which shrinks the chunks of prompts being scored."""
import random

import pytest
import torch

from conftest import assert_engine_clean
from picovllm import LLM, SamplingParams
from picovllm.engine import kv_cache, scheduler
from test_parity_hf import LOGPROB_ATOL, make_prompts

TOPK = 3


def hf_prompt_logprobs(path, prompts):
    """Per prompt: [(token, its logprob, its rank, top-k ids)] for prompt tokens 1.., from HF's logits."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            logp = model(torch.tensor([p])).logits[0].double().log_softmax(-1)
        rows = []
        for i in range(1, len(p)):
            row = logp[i - 1]
            rows.append((p[i], row[p[i]].item(), int((row > row[p[i]]).sum()) + 1, row.topk(TOPK).indices.tolist()))
        out.append(rows)
    return out


def check(outs, ref):
    for o, rows in zip(outs, ref):
        got = o.prompt_logprobs
        assert got[0] is None and len(got) == len(rows) + 1
        for d, (tok, lp, rank, top) in zip(got[1:], rows):
            assert d[tok].logprob == pytest.approx(lp, abs=LOGPROB_ATOL)
            assert d[tok].rank == rank
            assert sorted(d, key=lambda t: d[t].logprob, reverse=True)[:TOPK] == top or set(top) <= set(d)
            assert {t for t, v in d.items() if v.rank is not None and v.rank <= TOPK} >= set(top)


@pytest.fixture(scope="module")
def reference(tiny_models):
    prompts = make_prompts()
    return prompts, hf_prompt_logprobs(tiny_models["qwen3"], prompts)


def record_logit_rows(engine) -> list[tuple[int, int]]:
    """Wrap the engine's executor: (logit rows, prompt-logprob rows) of every step it runs, in order."""
    seen, ex = [], engine.executor
    real_execute, real_launch = ex.execute, ex.launch

    def execute(step):
        seen.append((step.num_logit_rows, len(step.prompt_indices)))
        return real_execute(step)

    def launch(step, *args):
        seen.append((step.num_logit_rows, len(step.prompt_indices)))
        return real_launch(step, *args)
    ex.execute, ex.launch = execute, launch
    return seen


@pytest.mark.parametrize("kw", [
    dict(block_size=4, max_num_batched_tokens=7, num_kv_blocks=256, async_scheduling=True),   # chunks, overlap
    dict(block_size=16, max_num_batched_tokens=64, num_kv_blocks=9),                           # preemption
    dict(block_size=8, num_kv_blocks=128),                                                     # prefix cache
    # at most 5 prompt positions scored a step: preemptions mid-prompt, re-admitted over cached blocks already scored
    dict(block_size=8, max_num_batched_tokens=32, num_kv_blocks=15, prompt_rows=5, max_tokens=16),
])
def test_prompt_logprobs_match_hf(tiny_models, reference, kw, monkeypatch):
    prompts, ref = reference
    kw = dict(kw)
    if "prompt_rows" in kw:
        monkeypatch.setattr(scheduler, "PROMPT_LOGPROB_ROWS", kw.pop("prompt_rows"))
    max_tokens = kw.pop("max_tokens", 4)
    llm = LLM(tiny_models["qwen3"], device="cpu", **kw)
    seen = record_logit_rows(llm.engine)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=TOPK)
    preempted, real = [], llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda r: (preempted.append(r), real(r))
    check(llm.generate(prompts, sp, use_tqdm=False), ref)
    if kw["num_kv_blocks"] in (9, 15):
        assert preempted, "the cache was meant to force a preemption"
    bound = scheduler.max_logit_rows(llm.engine.config)
    assert max(p for _, p in seen) <= scheduler.PROMPT_LOGPROB_ROWS and max(r for r, _ in seen) <= bound
    if kw["num_kv_blocks"] == 128:
        # again: the prompts' blocks are cached now, and scoring must not skip them
        outs = llm.generate(prompts, sp, use_tqdm=False)
        check(outs, ref)
        plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert max(o.num_cached_tokens for o in plain) > 0 and all(o.prompt_logprobs is None for o in plain)


def test_n_samples_share_one_scoring_and_bad_values_name_the_field(tiny_models, reference):
    prompts, ref = reference
    llm = LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=128)
    outs = llm.generate(prompts[4:6], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3,
                                                     prompt_logprobs=0), use_tqdm=False)
    for o, rows in zip(outs, ref[4:6]):
        assert len(o.outputs) == 2
        assert [d[tok].logprob for d, (tok, *_rest) in zip(o.prompt_logprobs[1:], rows)] == \
            pytest.approx([lp for _, lp, _, _ in rows], abs=LOGPROB_ATOL)
        assert all(len(d) == 1 for d in o.prompt_logprobs[1:])    # top-0: the prompt token alone
    for bad in (-2, 1.5):     # -1 is vLLM's whole vocabulary (True is 1, as vLLM reads it)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="prompt_logprobs must be <= the vocabulary size"):
        llm.generate([prompts[0]], SamplingParams(prompt_logprobs=10**6), use_tqdm=False)
    # (P/D: P scores the prompt and the handover carries it to D, test_disagg_engines.py)


def test_tp2_scores_the_prompt_like_tp1(tiny_models, reference):
    prompts, ref = reference
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOPK)
    with LLM(tiny_models["qwen3"], device="cpu", tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16,
             num_kv_blocks=256, async_scheduling=True) as llm:
        check(llm.generate(prompts, sp, use_tqdm=False), ref)


LONG = 300          # prompt tokens (the tiny models' context is 512)
ROWS = 5            # prompt positions a step may score in the bounded engines


@pytest.fixture(scope="module")
def long_reference(tiny_models):
    rng = random.Random(7)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (LONG, 40)]
    return prompts, hf_prompt_logprobs(tiny_models["qwen3"], prompts)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_long_prompt_scored_within_the_profiled_rows(tiny_models, long_reference, monkeypatch, async_scheduling):
    """A step scores at most PROMPT_LOGPROB_ROWS prompt positions and computes at most max_logit_rows logits (what the
    memory profile reserves): a long prompt's chunks shrink to fit, and its logprobs are the unbounded engine's and
    HF's. A request behind it that scores its prompt too waits for rows in its place; plain requests do not wait."""
    prompts, ref = long_reference
    path = tiny_models["qwen3"]
    kw = dict(device="cpu", block_size=8, max_num_batched_tokens=64, num_kv_blocks=128, max_num_seqs=4,
              async_scheduling=async_scheduling)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOPK)
    unbounded = LLM(path, **kw).generate(prompts, sp, use_tqdm=False)    # 256 rows: more than the step budget

    monkeypatch.setattr(scheduler, "PROMPT_LOGPROB_ROWS", ROWS)
    eng = LLM(path, **kw).engine
    bound = scheduler.max_logit_rows(eng.config)
    assert bound == 4 + ROWS          # a sampled row a sequence, and the prompt rows
    seen = record_logit_rows(eng)
    steps, real_schedule = [], eng.scheduler.schedule

    def schedule():
        out = real_schedule()
        steps.append({c.request.request_id: c.num_new_tokens for c in out.chunks})
        return out
    eng.scheduler.schedule = schedule
    plain = [5, 6, 7, 8, 9, 10, 11]
    eng.add_request(prompts[0], sp, request_id="long")
    eng.add_request(prompts[1], sp, request_id="second")
    eng.add_request(plain, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), request_id="plain")
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)

    assert max(p for _, p in seen) == ROWS and max(r for r, _ in seen) <= bound
    check([done["long"], done["second"]], ref)
    for got, want in zip((done["long"], done["second"]), unbounded):
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
        for d, e in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert d.keys() == e.keys() and all(d[t].rank == e[t].rank for t in d)
            assert [d[t].logprob for t in d] == pytest.approx([e[t].logprob for t in d], abs=1e-5)
    assert [o.token_ids for o in done["long"].outputs] == [o.token_ids for o in unbounded[0].outputs]
    # the long prompt went ROWS positions a step; the plain request, admitted beside it at once (past "second", which
    # waited for rows: it comes in with the rows the long prompt's last chunk leaves), had its whole prompt in one
    # chunk and finished long before the long prompt's first token
    assert steps[0] == {"long": ROWS, "plain": len(plain)}
    first_second = next(i for i, s in enumerate(steps) if "second" in s)
    last_plain = max(i for i, s in enumerate(steps) if "plain" in s)
    last_long_prompt = max(i for i, s in enumerate(steps) if s.get("long", 1) > 1)
    assert last_plain < last_long_prompt <= first_second and last_long_prompt >= LONG // ROWS - 1
    assert len(done["plain"].outputs[0].token_ids) == 12
    assert_engine_clean(eng)


def test_memory_profile_computes_the_most_logit_rows_a_step_has(tiny_models, monkeypatch):
    """The profile forward (a GPU's, run here on the CPU) computes max_logit_rows logits, then the float32 scoring
    of PROMPT_LOGPROB_ROWS of them at the largest top-k a request may ask: the scheduler's bound and the profile's
    are one."""
    llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend="torch", max_num_batched_tokens=512,
              max_num_seqs=4, max_logprobs=7, num_kv_blocks=64)
    runner = llm.engine.executor.runner
    model, rows, scored = runner.model, [], []
    real_logits, real_scoring = model.compute_logits, kv_cache.prompt_logprob_tensors

    def compute_logits(hidden):
        rows.append(hidden.shape[0])
        return real_logits(hidden)

    def scoring(logits, targets, topk):
        scored.append((logits.shape[0], len(targets), topk))
        return real_scoring(logits, targets, topk)
    monkeypatch.setattr(model, "compute_logits", compute_logits)
    monkeypatch.setattr(kv_cache, "prompt_logprob_tensors", scoring)
    kv_cache._profile_forward(model, llm.engine.config, runner.device, runner.max_model_len)
    assert rows == [scheduler.max_logit_rows(llm.engine.config)] == [4 + scheduler.PROMPT_LOGPROB_ROWS]
    assert scored == [(scheduler.PROMPT_LOGPROB_ROWS, scheduler.PROMPT_LOGPROB_ROWS, 7)]
