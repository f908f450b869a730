"""CUDA graphs in pieces around eager attention, for mixed and multi-chunk steps (engine/piecewise_graph.py).

On the CPU the capture cannot run, so a stand-in replays each piece by running the forward again up to its cut
(interpreted Triton attention), the attentions before it answered from the static buffers the step's eager
attention filled: a mixed step and a step of several chunks give the eager step's logits and write exactly its
slots. Also the buckets and which steps fit. On a GPU: an engine whose steps mix prompt chunks and decodes (a small
step budget, prompts arriving together) decodes HF's greedy tokens, with those steps replaying the pieces."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from picovllm.engine.piecewise_graph import PiecewiseGraphRunner, piecewise_buckets   # noqa: E402
from picovllm.engine.step_input import StepInput   # noqa: E402
from test_prefill_graph import _prompt, mixed_steps, run_against_eager   # noqa: E402

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def test_buckets():
    assert piecewise_buckets(2048) == [64, 128, 256, 512, 1024, 2048]
    assert piecewise_buckets(300) == [64, 128, 256, 512]
    assert piecewise_buckets(16384) == [64, 128, 256, 512, 1024, 2048]
    assert piecewise_buckets(8) == [64]


def test_fits_steps_of_at_most_the_budget_without_prompt_logprobs():
    graphs = PiecewiseGraphRunner.__new__(PiecewiseGraphRunner)
    graphs.max_tokens = 300

    def step(qlens, nd=0, prompt_rows=(), blocks=1):
        ids = [0] * sum(qlens)
        return StepInput(ids, ids, ids, [0], [8] * len(qlens), [[0] * blocks] * len(qlens), nd, [], [],
                         prompt_indices=list(prompt_rows))
    assert graphs.fits(step([1, 1, 1, 40], nd=3)) and graphs.fits(step([100, 200])) and graphs.fits(step([300]))
    assert graphs.fits(step([5], blocks=500)), "any context: the pieces read no block table"
    assert not graphs.fits(step([301])) and not graphs.fits(step([1, 300], nd=1))
    assert not graphs.fits(step([1, 5], nd=1, prompt_rows=[1]))


class _Stop(Exception):
    pass


class _ReplayStandIn:
    """Piece j of a bucket, replayed by running the forward again: the attentions before cut j answer with what the
    step's eager attention wrote into the (shared) static output buffer for them, kept as each piece begins; at cut
    j, q (k, v) go to the static buffers and the forward stops; the last piece runs to the end and leaves the
    forward's output in place."""

    def __init__(self, graphs, bucket, j, size, outs):
        self.graphs, self.bucket, self.j, self.size, self.outs = graphs, bucket, j, size, outs

    def replay(self):
        graphs, calls, j, outs = self.graphs, self.bucket.calls, self.j, self.outs
        layers = graphs.model.attention_layers()
        if j:
            outs[j - 1] = calls[j - 1].out.clone()      # attention j - 1's output, before the next one overwrites it

        class Layer:
            def __init__(self, i, real):
                self.i, self.real = i, real

            def __getattr__(self, name):
                return getattr(self.real, name)

            def forward(self, q, k, v, *args, kv_stored=False, **kwargs):
                if self.i < j:
                    return outs[self.i]
                calls[j].q.copy_(q)
                if not kv_stored:
                    calls[j].k.copy_(k)
                    calls[j].v.copy_(v)
                raise _Stop
        try:
            for i, attn in enumerate(layers):
                attn.backend = Layer(i, graphs.backends[i])
            hidden = graphs.model(graphs.tokens[0, :self.size], graphs.tokens[1, :self.size],
                                  graphs._meta(self.size))
            self.bucket.hidden.copy_(hidden)
        except _Stop:
            pass
        finally:
            for attn, backend in zip(layers, graphs.backends):
                attn.backend = backend


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_pieces_give_the_eager_logits(tiny_models, backend):
    from picovllm import LLM
    llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend=backend, block_size=8, num_kv_blocks=48,
              max_num_batched_tokens=64, async_scheduling=False)
    runner = llm.engine.runner
    graphs = PiecewiseGraphRunner(runner.model, 64, block_size=8, device="cpu")
    graphs._begin_piece = lambda: None
    outs = {}
    graphs._end_piece = lambda bucket: bucket.pieces.append(_ReplayStandIn(graphs, bucket, len(bucket.pieces),
                                                                           graphs.sizes[0], outs))
    with torch.inference_mode():
        graphs.buckets[64] = graphs.record(64)
    assert len(graphs.buckets[64].pieces) == len(runner.model.layers) + 1
    # on the CPU rope runs in torch, so the backend stores K/V: k and v go to static buffers too (the GPU test below
    # has the rope kernel store them inside the pieces)
    assert not any(c.kv_stored for c in graphs.buckets[64].calls)
    graphs.tokens[0].fill_(7)           # stale state from an earlier, longer step
    graphs.tokens[2].fill_(3)
    for step, rows in mixed_steps(llm):
        assert graphs.fits(step)
        run_against_eager(runner, graphs, step, rows=rows)
        assert graphs.tokens[2, len(step.input_ids):64].eq(-1).all(), "padding tokens write nowhere"


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
    runner.mixed_graphs = None           # they would take these steps (tests/test_mixed_graph.py)
    pieces = runner.piecewise_graphs
    assert pieces is not None and pieces.sizes == [64, 128]
    kinds, real_run = [], pieces.run
    pieces.run = lambda step, prev=None, staged=None: (kinds.append((step.num_decodes,
                                                                     len(step.seq_lens) - step.num_decodes,
                                                                     len(step.input_ids))),
                                                       real_run(step, prev, staged))[1]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(tiny_models[arch], prompts, 12)
    assert any(d and p for d, p, _ in kinds), "a mixed step (decodes beside a chunk) replayed the pieces"
    assert any(d == 0 and p > 1 for d, p, _ in kinds), "so did a step of several chunks"
    assert any(n <= 64 for *_, n in kinds) and any(n > 64 for *_, n in kinds), "both buckets"
    llm.engine.shutdown()
