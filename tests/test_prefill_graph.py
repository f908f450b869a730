"""CUDA graphs for small prefill steps (engine/prefill_graph.py).

On the CPU the capture cannot run, so a replay stand-in runs the captured forward on the static buffers
(interpreted Triton attention): for a fresh chunk and one after prefix-cached context, the padded bucket gives
the eager step's logits and writes exactly the chunk's slots. On a GPU the engine runs with the graphs on
against HF's greedy tokens."""
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from picovllm.engine.prefill_graph import PrefillGraphRunner, prefill_buckets   # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(384) for _ in range(n)]


def test_buckets():
    assert prefill_buckets(2048) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(100) == [16, 32, 64]
    assert prefill_buckets(8) == [16]


def _replay_stand_in(graphs):
    class Replay:
        def __init__(self, size):
            self.size = size

        def replay(self):
            graphs.logits[self.size] = graphs._forward(self.size)
    graphs.graphs = {s: Replay(s) for s in graphs.sizes}


def run_against_eager(runner, graphs, step, rows: int, cache_atol: float = 1e-6) -> None:
    """graphs.run(step) against the runner's eager step from the same cache: the same logits ([rows, vocab 384])
    and the same cache after, with only the step's slots written (within cache_atol: where the graphs' attention
    is another kernel than the eager step's, the later layers' K/V differ by its rounding)."""
    before = runner.kv_cache.clone()
    with torch.inference_mode():
        got = graphs.run(step).clone()
        written = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        want = runner.compute_logits(step)
    changed = (written != before).flatten(4).any(-1).any(0).any(0).flatten().nonzero()[:, 0]
    assert sorted(changed.tolist()) == sorted(step.slot_mapping), "only the step's slots are written"
    assert torch.allclose(written, runner.kv_cache, atol=cache_atol)
    assert got.shape == want.shape == (rows, 384)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def mixed_steps(llm, score_last: bool = False):
    """Steps of several sequences, prepared for graphs to run against the eager step (engine/mixed_graph.py,
    engine/piecewise_graph.py): two requests decode (prompts of 11 and 20), then beside them a 30-token prompt's
    chunk, then chunks of 9 and 17 tokens (the 17 asking for prompt logprobs when score_last). Yields (step, the
    logit rows it asks for), the cache's slots for the step set to 123 (which it must overwrite); aborts every
    request."""
    from picovllm import SamplingParams
    eng, runner = llm.engine, llm.engine.runner
    decoding = [eng.add_request(_prompt(n, seed=n), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                for n in (11, 20)]
    while any(eng.requests[r].num_computed_tokens < eng.requests[r].num_prompt_tokens for r in decoding):
        eng.step()
    for new in ([_prompt(30, seed=3)], [_prompt(9, seed=4), _prompt(17, seed=5)]):
        scored = score_last and len(new) == 2
        rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                  prompt_logprobs=1 if scored and p is new[-1] else None))
                for p in new]
        step = runner.prepare(eng.scheduler.schedule(), eng.eos_token_ids)
        assert step.num_decodes == 2 and len(step.seq_lens) == 2 + len(new)
        assert len(step.prompt_indices) == (16 if scored else 0)
        kv = runner.kv_cache
        kv.view(*kv.shape[:2], -1, *kv.shape[4:])[:, :, step.slot_mapping] = 123.0
        yield step, step.num_logit_rows
        for r in rids:
            eng.abort(r)
    for r in decoding:
        eng.abort(r)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_static_buffers_give_the_eager_logits(tiny_models, monkeypatch):
    from picovllm import LLM, SamplingParams
    from picovllm.kernels import decode_attention
    # the short chunks go through the decode kernel (kernels/backend.py _short_prefill): at its default split target
    # each row's ~20 keys take 32 splits, ~1,000 mostly empty programs a call, ~15 ms each interpreted; 2 splits here
    monkeypatch.setattr(decode_attention, "SPLIT_TARGET_PROGRAMS", 64)
    llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend="triton", block_size=8, num_kv_blocks=40,
              max_num_batched_tokens=16)
    eng, runner = llm.engine, llm.engine.runner
    first = _prompt(20, seed=1)
    llm.generate([first], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)   # caches 2 blocks
    graphs = PrefillGraphRunner(runner.model, 16, max_blocks_per_seq=8, block_size=8, device="cpu")
    _replay_stand_in(graphs)
    graphs.tokens[0].fill_(7)      # stale state from an earlier, longer chunk
    graphs.tokens[2].fill_(3)
    graphs.meta_i32.fill_(5)
    for prompt, cached in ((first[:16] + _prompt(5, seed=2), 16), (_prompt(11, seed=3), 0)):
        rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        step = runner.prepare(eng.scheduler.schedule(), eng.eos_token_ids)
        assert eng.requests[rid].num_cached_tokens == cached and len(step.input_ids) == len(prompt) - cached
        assert graphs.fits(step)
        run_against_eager(runner, graphs, step, rows=1)
        assert graphs.tokens[2, len(step.input_ids):16].eq(-1).all(), "padding tokens write nowhere"
        eng.abort(rid)


def test_fits_only_one_small_prefill_chunk():
    from picovllm.engine.step_input import StepInput
    graphs = PrefillGraphRunner.__new__(PrefillGraphRunner)
    graphs.max_tokens, graphs.max_blocks = 64, 4

    def step(qlens, nd=0, prompt_rows=()):
        ids = [0] * sum(qlens)
        return StepInput(ids, ids, ids, [0], [8] * len(qlens), [[0]] * len(qlens), nd, [], [],
                         prompt_indices=list(prompt_rows))
    assert graphs.fits(step([5])) and graphs.fits(step([64]))
    assert not graphs.fits(step([65])) and not graphs.fits(step([3, 4])) and not graphs.fits(step([1], nd=1))
    assert not graphs.fits(step([5], prompt_rows=[0]))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA")
def test_engine_with_prefill_graphs_matches_hf(tiny_models):
    from test_kernels import _hf_greedy
    from picovllm import LLM, SamplingParams
    prompts = [_prompt(n, seed=n) for n in (1, 5, 16, 17, 40, 90)]
    prompts.append(prompts[-1][:48] + [3, 4])           # a prefix-cache hit, then a 2-token chunk
    llm = LLM(tiny_models["qwen3"], dtype="float32", block_size=16, num_kv_blocks=64, max_num_batched_tokens=64,
              prefill_cuda_graphs=True)
    graphs = llm.engine.runner.prefill_graphs
    replays, real_run = [], graphs.run
    graphs.run = lambda step: (replays.append(len(step.input_ids)), real_run(step))[1]
    outs = []
    for p in prompts:   # one at a time: each prefill is a one-chunk step
        outs += llm.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(tiny_models["qwen3"], prompts, 8)
    assert 2 in replays and outs[-1].num_cached_tokens == 48
