"""CUDA graphs in pieces around eager attention, for mixed and multi-chunk steps (engine/piecewise_graph.py).

On the CPU: the buckets and which steps fit. On a GPU: an engine whose steps mix prompt chunks and decodes (a small
step budget, prompts arriving together) decodes HF's greedy tokens, with those steps replaying the pieces."""
import random

import pytest
import torch

from picovllm.engine.piecewise_graph import PiecewiseGraphRunner, piecewise_buckets
from picovllm.engine.step_input import StepInput

CUDA = torch.cuda.is_available()


def test_buckets():
    assert piecewise_buckets(2048) == [64, 128, 256, 512, 1024, 2048]
    assert piecewise_buckets(300) == [64, 128, 256, 512]
    assert piecewise_buckets(16384) == [64, 128, 256, 512, 1024, 2048]
    assert piecewise_buckets(8) == [64]


def test_fits_steps_of_at_most_the_budget_without_prompt_logprobs():
    graphs = PiecewiseGraphRunner.__new__(PiecewiseGraphRunner)
    graphs.max_tokens, graphs.max_blocks = 300, 4

    def step(qlens, nd=0, prompt_rows=(), blocks=1):
        ids = [0] * sum(qlens)
        return StepInput(ids, ids, ids, [0], [8] * len(qlens), [[0] * blocks] * len(qlens), nd, [], [],
                         prompt_indices=list(prompt_rows))
    assert graphs.fits(step([1, 1, 1, 40], nd=3)) and graphs.fits(step([100, 200])) and graphs.fits(step([300]))
    assert not graphs.fits(step([301])) and not graphs.fits(step([1, 300], nd=1))
    assert not graphs.fits(step([1, 5], nd=1, prompt_rows=[1])) and not graphs.fits(step([5], blocks=5))


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(384) for _ in range(n)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_mixed_steps_replay_pieces_and_match_hf(tiny_models, arch):
    from test_kernels import _hf_greedy
    from picovllm import LLM, SamplingParams
    prompts = [_prompt(n, seed=n) for n in (3, 17, 40, 70, 90, 130, 9, 33)]
    prompts.append(prompts[4][:64] + [5, 6, 7])           # a prefix-cache hit, then a short chunk
    llm = LLM(tiny_models[arch], dtype="float32", block_size=16, num_kv_blocks=128, max_num_batched_tokens=96)
    runner = llm.engine.runner
    pieces = runner.piecewise_graphs
    assert pieces is not None and pieces.sizes == [64, 128]
    kinds, real_run = [], pieces.run
    pieces.run = lambda step, prev=None: (kinds.append((step.num_decodes, len(step.seq_lens) - step.num_decodes,
                                                        len(step.input_ids))), real_run(step, prev))[1]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(tiny_models[arch], prompts, 12)
    assert any(d and p for d, p, _ in kinds), "a mixed step (decodes beside a chunk) replayed the pieces"
    assert any(d == 0 and p > 1 for d, p, _ in kinds), "so did a step of several chunks"
    assert any(n <= 64 for *_, n in kinds) and any(n > 64 for *_, n in kinds), "both buckets"
    llm.engine.shutdown()
