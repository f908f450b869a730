"""EngineConfig.stream_interval (vLLM's and SGLang's --stream-interval): a running request's output goes out at its
first token, then once that many tokens are new, and always at its end. Oracle: the counts by hand, and the tokens
of the same engine settings with interval 1 (every step's output, as before)."""
import asyncio

import pytest

from picovllm import LLM, SamplingParams
from picovllm.config import EngineConfig
from picovllm.entrypoints.openai.async_engine import AsyncEngine

PROMPTS = [[3, 17, 40, 5], [9, 9, 12, 200, 31, 7, 8], [100]]


def streamed_counts(llm, params):
    """Each request's outputs as token counts, stepping the engine with unfinished outputs (what a server does)."""
    eng = llm.engine
    ids = [eng.add_request(p, params) for p in PROMPTS]
    counts, finals = {i: [] for i in ids}, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            counts[out.request_id].append(len(out.outputs[0].token_ids))
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    return [counts[i] for i in ids], [finals[i] for i in ids]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_outputs_come_at_the_first_token_then_every_interval_and_at_the_end(tiny_models, overlap):
    kw = dict(block_size=4, num_kv_blocks=64, async_scheduling=overlap)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    every, ref = streamed_counts(LLM(tiny_models["llama"], **kw), greedy)
    assert every == [list(range(1, 11))] * 3
    got, finals = streamed_counts(LLM(tiny_models["llama"], stream_interval=3, **kw), greedy)
    assert got == [[1, 4, 7, 10]] * 3
    assert [f.token_ids for f in finals] == [f.token_ids for f in ref]
    assert [f.text for f in finals] == [f.text for f in ref]
    got, _ = streamed_counts(LLM(tiny_models["llama"], stream_interval=4, **kw),
                             SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert got == [[1, 5, 6]] * 3      # the last output whatever the interval


def test_a_stream_through_the_async_engine_adds_up_to_the_same_completion(tiny_models):
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=64, stream_interval=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    ref = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=64).generate(PROMPTS, params, use_tqdm=False)

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            async def one(i, p):
                return [(len(o.outputs[0].token_ids), o) async for o in ae.generate(p, params, f"r{i}")]
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        finally:
            await ae.shutdown()

    for outs, r in zip(asyncio.run(main()), ref):
        counts = [n for n, _ in outs]
        # the engine's outputs are at 1, 6, 11 and 12 tokens; a slow reader may get several as one (the latest)
        assert set(counts) <= {1, 6, 11, 12} and counts == sorted(set(counts)) and counts[-1] == 12
        last = outs[-1][1].outputs[0]
        assert last.token_ids == r.outputs[0].token_ids and last.text == r.outputs[0].text
        assert [d.keys() for d in last.logprobs] == [d.keys() for d in r.outputs[0].logprobs]


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_a_bad_stream_interval_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="stream_interval must be an int >= 1"):
        EngineConfig(stream_interval=bad)
