"""Requests that are valid but could exhaust the server's memory or time: what the server holds for a client that
does not read its stream stays bounded; a grammar compiled off the engine's thread is not compiled again on it."""
import asyncio
import gc
import json
import random

import jsonschema
import pytest
import xgrammar as xgr

from picovllm import LLM, SamplingParams
from picovllm.entrypoints.openai.async_engine import AsyncEngine
from picovllm.entrypoints.openai.serving import SampleGroup
from picovllm.entrypoints.openai.serving_completion import _merged
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import StructuredOutputsParams

LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama"], block_size=8, num_kv_blocks=128)


def held_outputs(prefix: str) -> int:
    """RequestOutputs alive in this process whose request id starts with prefix."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, RequestOutput) and o.request_id.startswith(prefix))


async def until_idle(ae: AsyncEngine, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while ae.engine.requests or ae.stats.num_running or ae.stats.num_waiting:
        assert loop.time() < end, "the requests never finished"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)       # the last iteration's outputs reach the streams


class Context:
    """What SampleGroup needs of a ServingContext: add a sample through the engine."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def add(self, ids, params, request_id, arrival, priority=0, prompt_param=None, logprobs_param="logprobs"):
        return await self.engine.add_request(ids, params, request_id, arrival, priority)


def test_a_stream_nobody_reads_holds_its_newest_output_only(llm):
    """A client that stops reading (its TCP window full, the server's send waits) while the engine goes on: the
    request's stream keeps its newest (cumulative) output, not one a step (each a copy of the tokens so far); the
    reader then gets the last output whole. Oracle: the RequestOutput objects alive, counted by the garbage
    collector, and LLM.generate's tokens."""
    prompt = [random.Random(1).randrange(384) for _ in range(9)]
    ref = llm.generate([prompt], LONG, use_tqdm=False)[0].outputs[0].token_ids

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            stream = await ae.add_request(prompt, LONG, "unread")
            outputs = stream.outputs()
            first = await outputs.__anext__()
            await until_idle(ae)            # every later output has arrived, none was read
            held = held_outputs("unread")
            rest = [out async for out in outputs]
            return first, held, rest
        finally:
            await ae.shutdown()

    first, held, rest = asyncio.run(main())
    assert not first.finished
    assert held <= 3, f"the unread stream holds {held} outputs"      # the first (still referenced here), the last
    assert len(rest) == 1 and rest[0].finished and rest[0].outputs[0].token_ids == ref


def test_samples_nobody_reads_hold_a_bounded_number_of_outputs(llm):
    """n samples (SampleGroup: a pump a sample into one queue) whose reader stops after the first output: the pumps
    wait for the reader instead of queueing every output of every sample; the reader then gets each sample's last
    output whole. Oracle: the RequestOutputs alive, and LLM.generate's tokens for the greedy samples."""
    prompt = [random.Random(2).randrange(384) for _ in range(11)]
    ref = llm.generate([prompt], LONG, use_tqdm=False)[0].outputs[0].token_ids
    n = 4

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            group = await SampleGroup(Context(ae), prompt, [LONG] * n, "group", 0.0).start()
            outputs = group.outputs()
            await outputs.__anext__()
            await asyncio.sleep(0.1)        # the siblings are added (after sample 0's first output)
            await until_idle(ae)
            held = held_outputs(group._engine_id)
            last = {}
            async for i, out in outputs:
                last[i] = out
            return held, last
        finally:
            await ae.shutdown()

    held, last = asyncio.run(main())
    assert held <= 4 * n, f"the unread samples hold {held} outputs"
    assert sorted(last) == list(range(n))
    assert all(out.finished and out.outputs[0].token_ids == ref for out in last.values())


def test_merged_prompt_streams_wait_for_their_reader():
    """A streamed completion of several prompts merges their choice streams (serving_completion._merged): a reader
    that stops holds the pumps back, so the items (and the outputs behind them) are not all pulled into a queue.
    Oracle: how many items the sources were asked for."""
    pulled = [0, 0]

    async def source(k):
        for j in range(1000):
            pulled[k] += 1
            yield k, j

    async def main():
        merged = _merged([source(0), source(1)])
        first = await merged.__anext__()
        await asyncio.sleep(0.05)
        held = sum(pulled)
        rest = [item async for item in merged]
        return first, held, rest

    first, held, rest = asyncio.run(main())
    assert held <= 6, f"the sources were pulled {held} items ahead of the reader"
    assert sorted([first, *rest]) == [(k, j) for k in range(2) for j in range(1000)]


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    """The tiny llama with a tokenizer: grammars need one."""
    from serving_fixtures import build_tiny_chat_model
    return LLM(build_tiny_chat_model(str(tmp_path_factory.mktemp("grammar") / "m")), block_size=8, num_kv_blocks=64)


def test_a_schema_compiled_ahead_is_not_converted_again_on_the_engines_thread(chat_llm, monkeypatch):
    """A served request's grammar compiles on a thread of its own (Engine.compile_grammar, AsyncEngine), then the
    request is added on the engine's thread: the add must not convert the JSON schema to its grammar again (xgrammar's
    from_json_schema: seconds for a deep schema, 5.6 s of every stream stalled at 500 nested arrays), nor a second
    sample's add. Oracle: the conversions counted at xgrammar's call, and the outputs' tokens within the grammar."""
    real, calls = xgr.Grammar.from_json_schema, []

    def counted(*a, **kw):
        calls.append(a[0])
        return real(*a, **kw)

    monkeypatch.setattr(xgr.Grammar, "from_json_schema", counted)
    inner = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}
    schema = {"type": "array", "items": inner, "maxItems": 2}     # at most [[1,2],[1,2]]: it ends within max_tokens
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    engine = chat_llm.engine
    engine.compile_grammar(params)
    assert len(calls) == 1
    engine.add_request([5, 6, 7], params, "first")
    engine.add_request([5, 6, 8], params, "second")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(calls) == 1, "the schema was converted again"
    assert sorted(outs) == ["first", "second"]
    for out in outs.values():
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
