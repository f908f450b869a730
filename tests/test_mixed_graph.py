"""Whole-step CUDA graphs for steps of several sequences (engine/mixed_graph.py), and the work list their attention
runs on (kernels/work_attention.py).

The work list against hand-made ones and its bound; attention over a padded work list, decodes' keys split in
shares or not, against the torch reference for decodes and chunks in any order, windows and soft-capping. On the
CPU the capture cannot run, so a replay stand-in runs the captured forward on the static buffers (interpreted
Triton attention): a mixed step and a step of two chunks give the eager step's logits and write exactly its slots.
On a GPU: an engine whose steps mix chunks and decodes decodes HF's greedy tokens with those steps replaying the
graphs (decodes split), and a short chunk over a long context goes to the pieces instead."""
import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from picovllm.engine import mixed_graph   # noqa: E402
from picovllm.engine.mixed_graph import MixedGraphRunner   # noqa: E402
from picovllm.engine.step_input import StepInput   # noqa: E402
from picovllm.kernels import work_attention as wa   # noqa: E402
from picovllm.kernels.work_attention import max_work_items, work_attention, work_items, work_tile   # noqa: E402
from picovllm.layers.attention import TorchAttentionBackend   # noqa: E402
from picovllm.layers.attention import store_kv as store_kv_ref   # noqa: E402
from test_kernels import CASES, PagedBatch, rel_err   # noqa: E402
from test_prefill_graph import _prompt, mixed_steps, run_against_eager   # noqa: E402

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def test_work_items_by_hand(monkeypatch):
    assert (work_tile(1), work_tile(2), work_tile(3), work_tile(8)) == (64, 32, 16, 8)
    with pytest.raises(ValueError, match="at most 64 query heads"):
        work_tile(65)
    # contexts of 100 tokens: no split
    items, splits = work_items([1, 1, 130, 64, 65], [100] * 5, 10, 64)
    want = [[0, 0, 0, 1], [1, 0, 0, 1], [2, 0, 0, 1], [2, 1, 0, 1], [2, 2, 0, 1], [3, 0, 0, 1], [4, 0, 0, 1],
            [4, 1, 0, 1], [-1] * 4, [-1] * 4]
    assert items.dtype == np.int32 and items.tolist() == want and splits.tolist() == [1] * 5
    # a decode over 1,100 tokens: three shares of its keys (SPLIT_TOKENS 512); a chunk never splits
    items, splits = work_items([1, 33, 1], [1100, 2000, 512], 7, 16)
    assert items.tolist() == [[0, 0, 0, 3], [0, 0, 1, 3], [0, 0, 2, 3], [1, 0, 0, 1], [1, 1, 0, 1], [1, 2, 0, 1],
                              [2, 0, 0, 1]]
    assert splits.tolist() == [3, 1, 1]
    assert wa.decode_splits([100_000]).tolist() == [wa.MAX_SPLITS]
    monkeypatch.setattr(wa, "SPLIT_BUDGET", 10)
    assert wa.decode_splits([4096] * 4).tolist() == [2] * 4, "8 each: 28 extra, 4 each: 12, 2 each: 4, within 10"


def test_max_work_items_bounds_every_layout():
    rng = random.Random(0)
    for _ in range(300):
        tokens, seqs, tile = rng.choice([64, 128, 2048]), rng.randint(1, 300), rng.choice([8, 32, 64])
        cuts = sorted(rng.sample(range(1, tokens), min(seqs, tokens) - 1))
        lens = [b - a for a, b in zip([0] + cuts, cuts + [tokens])]
        ctx = [rng.choice([1, 600, 40_000]) + n for n in lens]
        bound = max_work_items(tokens, seqs, tile)
        assert len(lens) <= seqs and (work_items(lens, ctx, bound, tile)[0][:, 0] >= 0).sum() <= bound
    assert max_work_items(128, 6, 64) == 8 + wa.SPLIT_BUDGET


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize("ctx,qlen,hq,hkv,window,softcap", [
    ([7, 30, 0, 5, 40], [1, 1, 70, 3, 1], 4, 2, None, None),   # decodes, a 3-tile chunk, a chunk on context, a decode
    ([3, 70, 0, 21], [1, 1, 37, 19], 6, 2, 9, 1.0),    # group 3 (a masked head row), a short window, soft-capping
    ([12, 0], [1, 65], 2, 2, None, None),              # no grouping: 64-token tiles
])
@pytest.mark.parametrize("split_tokens", [512, 8])   # 8: the decodes' keys in shares of 8-16 tokens, then merged
def test_work_list_attention_matches_torch(device, dtype, tol, ctx, qlen, hq, hkv, window, softcap, split_tokens,
                                           monkeypatch):
    monkeypatch.setattr(wa, "SPLIT_TOKENS", split_tokens)
    b = PagedBatch(ctx, qlen, 8, hq, hkv, 16, dtype, device, seed=5)
    b.q *= 3
    k_cache, v_cache = b.caches()
    store_kv_ref(b.k, b.v, k_cache, v_cache, b.meta.slot_mapping)
    ref = TorchAttentionBackend().forward(b.q.float(), b.k.float(), b.v.float(), k_cache.float(), v_cache.float(),
                                          b.meta, 0.2, window, softcap)
    tile = work_tile(hq // hkv)
    seq_lens = [c + q for c, q in zip(ctx, qlen)]
    items, splits = work_items(qlen, seq_lens, max_work_items(sum(qlen), len(qlen), tile), tile)
    assert (splits > 1).any() == (split_tokens == 8)
    to = dict(dtype=torch.int32, device=device)
    out = torch.full_like(b.q, float("nan"))
    work_attention(b.q, k_cache, v_cache, b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc,
                   torch.tensor(items, **to), torch.tensor(list(splits) + [0, 1], **to), 0.2, out, block_n=16,
                   window=window, softcap=softcap)
    assert not out.isnan().any(), "every row is some item's"
    assert rel_err(out, ref) < tol


def test_fits_steps_of_several_sequences_but_short_chunks_over_long_contexts():
    graphs = MixedGraphRunner.__new__(MixedGraphRunner)
    graphs.max_tokens, graphs.max_seqs, graphs.max_context, graphs.max_decode_context = 300, 8, 100, 10_000

    def step(qlens, nd=0, prompt_rows=(), ctx=0):
        ids = [0] * sum(qlens)
        qsl = [sum(qlens[:i]) for i in range(len(qlens) + 1)]
        return StepInput(ids, ids, ids, qsl, [q + ctx for q in qlens], [[0]] * len(qlens), nd, [], [],
                         prompt_indices=list(prompt_rows))
    assert graphs.fits(step([1, 1, 1, 40], nd=3)) and graphs.fits(step([100, 20])) and graphs.fits(step([1] * 8))
    assert graphs.fits(step([1, 5], nd=1, prompt_rows=[1, 2])), "prompt logprobs: the LM head is eager"
    assert graphs.fits(step([1, 16], nd=1, ctx=84)) and graphs.fits(step([1, 17], nd=1, ctx=5000))
    assert graphs.fits(step([1, 1], nd=2, ctx=4999)), "decodes at any context: their keys split"
    assert not graphs.fits(step([1, 1], nd=2, ctx=5000)), "decodes whose contexts sum past max_decode_context"
    assert not graphs.fits(step([1, 16], nd=1, ctx=85)), "a short chunk over a context past max_context"
    assert not graphs.fits(step([1] * 9, nd=9)), "more sequences than max_num_seqs"
    assert not graphs.fits(step([301]))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_static_buffers_give_the_eager_logits(tiny_models, monkeypatch):
    from picovllm import LLM
    monkeypatch.setattr(wa, "SPLIT_TOKENS", 8)      # the decodes' keys (12-21 tokens) in shares
    llm = LLM(tiny_models["qwen3"], device="cpu", attention_backend="triton", block_size=8, num_kv_blocks=48,
              max_num_batched_tokens=64, async_scheduling=False)
    runner = llm.engine.runner
    graphs = MixedGraphRunner(runner.model, 64, max_num_seqs=8, max_blocks_per_seq=8, block_size=8, device="cpu")

    class Replay:        # what the capture records: the forward on the static buffers
        def __init__(self, size):
            self.size = size

        def replay(self):
            graphs.hidden[self.size] = graphs._forward(self.size)
    graphs.graphs = {s: Replay(s) for s in graphs.sizes}
    graphs.tokens.fill_(7)               # stale state from an earlier, longer step
    graphs.meta_i32.fill_(3)
    graphs.block_tables.fill_(5)
    for step, rows in mixed_steps(llm, score_last=True):     # the last step scores a prompt's 16 tokens too
        assert graphs.fits(step)
        # decodes go through the prefill kernel here, the decode kernel eagerly: their rounding differs
        run_against_eager(runner, graphs, step, rows=rows, cache_atol=1e-5)
        assert graphs.tokens[2, len(step.input_ids):64].eq(-1).all(), "padding tokens write nowhere"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_mixed_steps_replay_the_graphs_and_match_hf(tiny_models, arch, monkeypatch):
    from test_kernels import _hf_greedy
    from picovllm import LLM, SamplingParams
    monkeypatch.setattr(mixed_graph, "MAX_CONTEXT", 48)
    monkeypatch.setattr(wa, "SPLIT_TOKENS", 32)        # decodes past 32 tokens split their keys
    prompts = [_prompt(n, seed=n) for n in (3, 17, 40, 70, 90, 130, 9, 33, 200)]
    llm = LLM(tiny_models[arch], dtype="float32", block_size=16, num_kv_blocks=128, max_num_batched_tokens=96)
    runner = llm.engine.runner
    graphs, pieces = runner.mixed_graphs, runner.piecewise_graphs
    assert graphs is not None and graphs.sizes == [64, 128] and graphs.max_context == 48
    kinds, pieced = [], []
    real_run, real_pieces = graphs.run, pieces.run
    graphs.run = lambda step, prev=None: (kinds.append((step.num_decodes, len(step.seq_lens) - step.num_decodes,
                                                        len(step.input_ids))), real_run(step, prev))[1]
    pieces.run = lambda step, prev=None, staged=None: (pieced.append(max(step.seq_lens)),
                                                       real_pieces(step, prev, staged))[1]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    short = [_prompt(n, seed=100 + n) for n in (5, 9, 20, 30)]        # a first step of 64 tokens
    cached = [prompts[4][:64] + [5, 6, 7], _prompt(40, seed=7)]      # a 3-token chunk over 64 cached tokens
    for batch in (prompts, short, cached):
        outs = llm.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(tiny_models[arch], batch, 12)
    assert any(d and p for d, p, _ in kinds), "a mixed step (decodes beside a chunk) replayed the graphs"
    assert any(d == 0 and p > 1 for d, p, _ in kinds), "so did a step of several chunks"
    assert any(n <= 64 for *_, n in kinds) and any(n > 64 for *_, n in kinds), "both buckets"
    assert pieced and min(pieced) > 48, "the short chunk over a longer context went to the pieces"
    llm.engine.shutdown()
