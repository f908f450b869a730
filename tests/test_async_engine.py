"""AsyncEngine in-process: outputs equal LLM.generate's, rejects and aborts leave the engine clean, and a
failing step fails only the requests in flight while the loop keeps serving."""
import asyncio
import random

import pytest

from picovllm import LLM, SamplingParams
from picovllm.entrypoints.openai.async_engine import AsyncEngine
from picovllm.entrypoints.openai.engine_client import EngineStepError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.fixture(params=[False, True], ids=["sync", "overlapped"])
def llm(tiny_models, request):
    return LLM(tiny_models["llama"], block_size=8, num_kv_blocks=64, async_scheduling=request.param)


async def collect(ae, ids, params, rid):
    last = None
    async for out in ae.generate(ids, params, rid):
        last = out
    return last


def test_concurrent_outputs_match_llm_generate(llm):
    ps = prompts(6)
    ref = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            outs = await asyncio.gather(*(collect(ae, p, GREEDY, f"r{i}") for i, p in enumerate(ps)))
        finally:
            await ae.shutdown()
        return outs

    outs = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_reject_and_abort_leave_engine_clean(llm):
    bm = llm.engine.block_manager

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            with pytest.raises(ValueError, match="max_model_len"):
                await ae.add_request([5] * 600, GREEDY, "too-long")
            with pytest.raises(ValueError, match=r"token ids must be in \[0, 384\)"):
                await ae.add_request([1, 2, 999], GREEDY, "bad-id")
            with pytest.raises(ValueError, match="stop_token_ids"):   # would index past the logits
                await ae.add_request([1, 2], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[999]), "bad-stop")
            # a long request, left after its first output: leaving the iteration aborts it
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            stream = await ae.add_request(prompts(1)[0], long, "leaver")
            async for out in stream.outputs():
                assert not out.finished
                break
            await stream_closed_and_idle(ae)
            assert ae.stats.num_free_blocks == bm.num_blocks
            # the engine still serves
            out = await collect(ae, prompts(1, seed=3)[0], GREEDY, "after")
            assert len(out.outputs[0].token_ids) == 10
        finally:
            await ae.shutdown()

    asyncio.run(main())
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


def test_an_id_given_up_is_reused_only_once_its_abort_is_in(llm):
    """A client that leaves and sends the same request_id at once (the same event-loop tick): the id is still the
    old request's until its abort's output comes back, so the new one is refused (it had been accepted, then ended
    by the old one's abort output, its acceptance sent to no one: add_request never returned); once it is in, the
    id serves a new request in full."""
    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            old = await ae.add_request(prompts(1)[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                       "R")
            gen = old.outputs()
            await gen.__anext__()       # one output, then the client leaves: its stream closes, the abort goes out
            old.close()
            with pytest.raises(ValueError, match="already in use"):
                await asyncio.wait_for(ae.add_request([8, 9], GREEDY, "R"), 5)
            await stream_closed_and_idle(ae)
            while "R" in ae._streams:
                await asyncio.sleep(0.01)
            out = await asyncio.wait_for(collect(ae, [8, 9], GREEDY, "R"), 30)
            assert out.finished and len(out.outputs[0].token_ids) == 10
        finally:
            await ae.shutdown()

    asyncio.run(main())
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


async def stream_closed_and_idle(ae, timeout=10.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while ae.engine.requests or ae.stats.num_running or ae.stats.num_waiting:
        assert loop.time() < end, "the aborted request was never freed"
        await asyncio.sleep(0.01)


def test_failing_step_fails_inflight_requests_only(llm, monkeypatch):
    runner = llm.engine.runner
    real = runner.launch         # execute() = resolve(launch()); overlapped steps call launch() alone
    calls = {"n": 0}

    def flaky(step, *a):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real(step, *a)

    monkeypatch.setattr(runner, "launch", flaky)
    ps = prompts(3, seed=5)

    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        try:
            results = await asyncio.gather(*(collect(ae, p, GREEDY, f"f{i}") for i, p in enumerate(ps)),
                                           return_exceptions=True)
            assert all(isinstance(r, EngineStepError) for r in results), results
            assert ae.is_running
            return await collect(ae, ps[0], GREEDY, "after-failure")
        finally:
            await ae.shutdown()

    out = asyncio.run(main())
    monkeypatch.setattr(runner, "launch", real)
    ref = llm.generate([ps[0]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_shutdown_aborts_inflight(llm):
    async def main():
        ae = AsyncEngine(llm.engine)
        ae.start()
        stream = await ae.add_request(prompts(1)[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                      "inflight")
        await ae.shutdown()
        outs = [o async for o in stream.outputs()]
        return outs[-1]

    last = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks



@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    """The tiny llama with a tokenizer: grammars need one."""
    from serving_fixtures import build_tiny_chat_model
    return LLM(build_tiny_chat_model(str(tmp_path_factory.mktemp("grammar") / "m")), block_size=8, num_kv_blocks=64)


async def until(condition, timeout=10.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not condition():
        assert loop.time() < end, "never came"
        await asyncio.sleep(0.005)


def held_compiles(monkeypatch, which=lambda p: True):
    """StructuredOutputCompiler.compile held, for the params `which` picks, until the returned event is set (30 s at
    most); the list says, for each held compile, whether the event released it (True) or the wait ran out (False)."""
    from picovllm.layers.structured_output import StructuredOutputCompiler
    release, released = __import__("threading").Event(), []
    real = StructuredOutputCompiler.compile

    def held(self, p):
        if which(p):
            released.append(release.wait(30))
        return real(self, p)

    monkeypatch.setattr(StructuredOutputCompiler, "compile", held)
    return release, released


async def leave_while_compiling(ae, ids, params, rid):
    """Add a request and, while its grammar compiles (held_compiles), go away before the add is answered: its
    stream sends an abort, which the compiling add takes."""
    adding = asyncio.ensure_future(ae.add_request(ids, params, rid))
    await until(lambda: rid in ae._compiling)
    adding.cancel()
    with pytest.raises(asyncio.CancelledError):
        await adding
    await until(lambda: ae._compiling[rid].aborted)


def test_a_compiling_grammar_holds_back_no_other_request(chat_llm, monkeypatch):
    """A grammar compiles off the loop's thread: while one is held compiling, a plain request runs to its end (it
    waited the whole compile out on the loop's thread); the constrained request then answers within its grammar,
    and a grammar that cannot compile is still refused naming the field. The oracle for the plain request's tokens:
    LLM.generate."""
    from picovllm.sampling_params import StructuredOutputsParams
    ps = prompts(1, seed=7)
    ref = chat_llm.generate(ps, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    release, released = held_compiles(monkeypatch)
    choice = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))

    async def main():
        ae = AsyncEngine(chat_llm.engine)
        ae.start()
        try:
            constrained = asyncio.ensure_future(collect(ae, [5, 6, 7], choice, "constrained"))
            plain = await asyncio.wait_for(collect(ae, ps[0], GREEDY, "plain"), 20)
            release.set()          # the plain request is done: the compile may go on
            bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
            with pytest.raises(ValueError, match="structured_outputs.regex"):
                await ae.add_request([5, 6], bad, "bad")
            return plain, await asyncio.wait_for(constrained, 30)
        finally:
            release.set()
            await ae.shutdown()

    plain, constrained = asyncio.run(main())
    assert released[0] is True, "the plain request waited the compile out"
    assert plain.outputs[0].token_ids == ref
    assert constrained.outputs[0].text in ("yes", "no")
    assert not chat_llm.engine.requests
    assert chat_llm.engine.block_manager.num_free_blocks == chat_llm.engine.block_manager.num_blocks


def test_a_request_aborted_while_its_grammar_compiles_is_never_run(chat_llm, monkeypatch):
    """The client leaves while its grammar compiles: once compiled the request is added and aborted at once, so no
    step runs it and every block stays free; the engine serves on."""
    from picovllm.sampling_params import StructuredOutputsParams
    release, released = held_compiles(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    engine = chat_llm.engine
    before = engine.stats.prefill_tokens

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            await leave_while_compiling(ae, [5, 6, 7], params, "leaver")
            release.set()
            await until(lambda: not ae._compiling and "leaver" not in ae._streams)
            await stream_closed_and_idle(ae)
            return await collect(ae, [8, 9], GREEDY, "after")
        finally:
            release.set()
            await ae.shutdown()

    after = asyncio.run(main())
    assert released and all(released) and len(after.outputs[0].token_ids) == 10
    assert engine.stats.prefill_tokens - before == 2        # only "after"'s prompt ran
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_compiling_grammar_holds_back_no_other_grammar(chat_llm, monkeypatch):
    """Grammars compile side by side: while a choice list is held compiling, a regex request is compiled, runs and
    answers within its regex (it waited behind the first on a lone compile thread)."""
    from picovllm.sampling_params import StructuredOutputsParams
    release, released = held_compiles(monkeypatch, lambda p: p.choice is not None)
    choice = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    regex = SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))

    async def main():
        ae = AsyncEngine(chat_llm.engine)
        ae.start()
        try:
            held = asyncio.ensure_future(collect(ae, [5, 6, 7], choice, "held"))
            await until(lambda: "held" in ae._compiling)
            other = await asyncio.wait_for(collect(ae, [8, 9], regex, "other"), 20)
            release.set()
            return other, await asyncio.wait_for(held, 30)
        finally:
            release.set()
            await ae.shutdown()

    other, held = asyncio.run(main())
    assert released[0] is True, "the regex waited the choice list's compile out"
    assert __import__("re").fullmatch("[0-9]{3}", other.outputs[0].text) and held.outputs[0].text in ("yes", "no")
    assert not chat_llm.engine.requests


def test_an_id_let_go_while_its_grammar_compiles_serves_the_next_request(chat_llm, monkeypatch):
    """The caller leaves while its grammar compiles (its stream gone, the id free on the client's side) and a new
    request comes under the same id: the new one runs to its end; the old one, compiled meanwhile, neither refuses
    nor aborts it (it was added under the id, refused as a duplicate into the new one's stream, then aborted)."""
    from picovllm.sampling_params import StructuredOutputsParams
    release, _ = held_compiles(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    engine = chat_llm.engine
    LONGER = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)     # still running when the compile ends

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            await leave_while_compiling(ae, [5, 6, 7], params, "again")
            stream = await ae.add_request([8, 9], LONGER, "again")
            release.set()
            await until(lambda: not ae._compiling)      # the old one's compile ends while the new one runs
            return [out async for out in stream.outputs()][-1]
        finally:
            release.set()
            await ae.shutdown()

    last = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 400
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_all_while_a_grammar_compiles_ends_that_request_too(chat_llm, monkeypatch):
    """AbortAll (a shutdown's, an API server's leaving) while a request's grammar compiles: once compiled the request
    is added and aborted at once, its stream ending with finish_reason "abort" and no step run for it (else it ran
    to its end, AbortAll having found nothing of it in the engine)."""
    from picovllm.sampling_params import StructuredOutputsParams
    release, _ = held_compiles(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    engine = chat_llm.engine
    before = engine.stats.prefill_tokens

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            adding = asyncio.ensure_future(ae.add_request([5, 6, 7], params, "all"))
            await until(lambda: "all" in ae._compiling)
            ae.abort_all()
            await until(lambda: ae._compiling["all"].aborted)
            release.set()
            stream = await asyncio.wait_for(adding, 20)
            return [out async for out in stream.outputs()]
        finally:
            release.set()
            await ae.shutdown()

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort" and not outs[-1].outputs[0].token_ids
    assert engine.stats.prefill_tokens == before
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_grammar_params_changed_after_they_were_built_are_refused_naming_the_field(chat_llm):
    """structured_outputs set after SamplingParams was built, to something that is none: refused as add_request
    refuses it (a ValueError naming the field: a 400), not an error of the compile's thread (a 500)."""
    params = SamplingParams(max_tokens=4)
    params.structured_outputs = ["not", "params"]

    async def main():
        ae = AsyncEngine(chat_llm.engine)
        ae.start()
        try:
            with pytest.raises(ValueError, match="SamplingParams.structured_outputs"):
                await asyncio.wait_for(ae.add_request([5, 6], params, "changed"), 20)
        finally:
            await ae.shutdown()

    asyncio.run(main())
    assert not chat_llm.engine.requests


# -- DELTA outputs and a slow reader -------------------------------------------------------------------------------
def delta_params(kind):
    from picovllm.sampling_params import RequestOutputKind
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                          stop=["\u2603\u2603"], output_kind=getattr(RequestOutputKind, kind))


def test_a_slow_reader_of_a_delta_stream_gets_every_delta(chat_llm):
    """A DELTA request's outputs hold only what is new: a reader that reads nothing until the request has finished
    gets what every output held, merged, not only the last delta. Oracle: the same greedy request FINAL_ONLY (and
    CUMULATIVE, whose slow reader gets the final output alone, as before). A reader that keeps up gets the same."""
    prompt = [5, 6, 7, 8]

    async def slow(ae, kind, rid):
        stream = await ae.add_request(prompt, delta_params(kind), rid)
        await until(lambda: rid not in ae._streams, 60)       # its last output is in: the request has finished
        return [out async for out in stream.outputs()]

    async def main():
        ae = AsyncEngine(chat_llm.engine)
        ae.start()
        try:
            final = [out async for out in ae.generate(prompt, delta_params("FINAL_ONLY"), "final")]
            cumulative = await slow(ae, "CUMULATIVE", "cumulative")
            deltas = await slow(ae, "DELTA", "delta")
            fast = [out async for out in ae.generate(prompt, delta_params("DELTA"), "fast")]
        finally:
            await ae.shutdown()
        return final, cumulative, deltas, fast

    final, cumulative, deltas, fast = asyncio.run(main())
    assert len(final) == 1 and final[0].finished and len(cumulative) == 1
    want = final[0].outputs[0]
    assert len(want.token_ids) == 24 and want.text and want.finish_reason == "length"
    assert cumulative[0].outputs[0].token_ids == want.token_ids
    for outs in (deltas, fast):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        pieces = [o.outputs[0] for o in outs]
        assert [t for p in pieces for t in p.token_ids] == want.token_ids
        assert "".join(p.text for p in pieces) == want.text
        assert [lp for p in pieces for lp in p.logprobs] == want.logprobs
        assert pieces[-1].cumulative_logprob == pytest.approx(want.cumulative_logprob)
        assert (pieces[-1].finish_reason, pieces[-1].stop_reason) == (want.finish_reason, want.stop_reason)
        assert outs[0].prompt_logprobs == final[0].prompt_logprobs and len(outs[0].prompt_logprobs) == len(prompt)
        assert all(o.prompt_logprobs is None for o in outs[1:])
    assert not chat_llm.engine.requests


def test_merge_deltas_joins_each_completion_by_index():
    """merge_deltas on hand-made outputs: n > 1 completions joined by index (one that only one output has kept),
    the newer one's totals and state, the older one's prompt logprobs; neither output changed."""
    from picovllm.outputs import CompletionOutput, Logprob, RequestOutput, merge_deltas
    lp = [{1: Logprob(-0.5)}, {2: Logprob(-0.25)}, {3: Logprob(-1.0)}]
    older = RequestOutput("r", "p", [9], [CompletionOutput(0, "ab", [1, 2], -0.75, lp[:2]),
                                          CompletionOutput(1, "x", [7], None, None)], False,
                          num_cached_tokens=1, prompt_logprobs=[None])
    newer = RequestOutput("r", "p", [9], [CompletionOutput(2, "z", [8], None, None, "length"),
                                          CompletionOutput(0, "c", [3], -1.75, lp[2:], "stop", "c")], True,
                          num_cached_tokens=1)
    merged = merge_deltas(older, newer)
    assert [c.index for c in merged.outputs] == [0, 1, 2]
    a, b, c = merged.outputs
    assert (a.text, a.token_ids, a.logprobs, a.cumulative_logprob, a.finish_reason, a.stop_reason) == \
        ("abc", [1, 2, 3], lp, -1.75, "stop", "c")
    assert b is older.outputs[1] and c is newer.outputs[0]
    assert merged.finished and merged.prompt_logprobs == [None] and merged.error is None
    assert older.outputs[0].token_ids == [1, 2] and newer.outputs[1].token_ids == [3] and not older.finished


# -- compiles: one aborted before it starts, one that never ends --------------------------------------------------
def test_an_add_aborted_while_queued_for_its_compile_is_never_compiled(chat_llm, monkeypatch):
    """One compile thread, held by a choice list: a regex add queued behind it whose caller leaves is answered at
    once, its grammar never compiled (it had waited for the thread, then compiled for nothing); AbortAll likewise
    ends an add queued so with finish_reason "abort". Neither runs a step; the held one runs once released."""
    from picovllm.entrypoints.openai import async_engine
    from picovllm.layers.structured_output import StructuredOutputCompiler
    from picovllm.sampling_params import StructuredOutputsParams
    monkeypatch.setattr(async_engine, "COMPILE_THREADS", 1)
    release, compiled = __import__("threading").Event(), []
    real = StructuredOutputCompiler.compile

    def recorded(self, p):
        compiled.append(p.kind)
        if p.choice is not None:
            release.wait(30)
        return real(self, p)

    monkeypatch.setattr(StructuredOutputCompiler, "compile", recorded)
    choice = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    regex = SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))
    engine = chat_llm.engine
    before = engine.stats.prefill_tokens

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            held = asyncio.ensure_future(collect(ae, [5, 6, 7], choice, "held"))
            await until(lambda: compiled == ["choice"])
            leaver = asyncio.ensure_future(ae.add_request([8, 9], regex, "leaver"))
            await until(lambda: "leaver" in ae._compiling)
            leaver.cancel()         # its stream goes, with an abort
            with pytest.raises(asyncio.CancelledError):
                await leaver
            await until(lambda: "leaver" not in ae._compiling)     # answered while the thread is still held
            stays = asyncio.ensure_future(ae.add_request([8, 9, 10], regex, "stays"))
            await until(lambda: "stays" in ae._compiling)
            ae.abort_all()
            stream = await asyncio.wait_for(stays, 20)
            ended = [out async for out in stream.outputs()]
            assert "held" in ae._compiling          # AbortAll marked it: aborted once compiled
            release.set()
            held_out = await asyncio.wait_for(held, 30)
            return ended, held_out
        finally:
            release.set()
            await ae.shutdown()

    ended, held_out = asyncio.run(main())
    assert "regex" not in compiled, "an aborted add's grammar was compiled"
    assert len(ended) == 1 and ended[0].finished and ended[0].outputs[0].finish_reason == "abort"
    assert ended[0].outputs[0].token_ids == [] and ended[0].prompt_token_ids == [8, 9, 10]
    assert held_out.finished and held_out.outputs[0].finish_reason == "abort"
    assert engine.stats.prefill_tokens == before
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


EXIT_WHILE_COMPILING = r"""
import asyncio, sys, threading
from picovllm import LLM, SamplingParams, StructuredOutputsParams
from picovllm.entrypoints.openai.async_engine import AsyncEngine

llm = LLM(sys.argv[1], block_size=8, num_kv_blocks=64)
started = threading.Event()
def never_ends(params):         # a compile that outlives the server (a 50,000-value choice list takes minutes)
    started.set()
    threading.Event().wait()
llm.engine.compile_grammar = never_ends

async def main():
    ae = AsyncEngine(llm.engine)
    ae.start()
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    adding = asyncio.ensure_future(ae.add_request([5, 6], params, "forever"))
    while not started.is_set():
        await asyncio.sleep(0.01)
    await ae.shutdown()
    try:
        await adding
    except Exception as e:
        print("refused:", type(e).__name__, flush=True)

asyncio.run(main())
print("shut down", flush=True)
"""


def test_a_compile_still_running_does_not_hold_up_the_process_exit(chat_llm, tmp_path):
    """A server shut down while a grammar compiles exits: the compile's thread is a daemon (it was a
    concurrent.futures thread, which Python joins at exit: the process waited the compile out, here forever)."""
    import subprocess
    import sys
    script = tmp_path / "exit_while_compiling.py"
    script.write_text(EXIT_WHILE_COMPILING)
    try:
        done = subprocess.run([sys.executable, str(script), chat_llm.engine.config.model], capture_output=True,
                              text=True, timeout=120, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the process did not exit: {e.stdout}") from None
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: EngineDeadError" in done.stdout and done.stdout.rstrip().endswith("shut down")


def test_thread_outputs_are_the_engines_cumulative_ones_as_views(chat_llm):
    """The loop's requests make delta outputs in the engine (add_request's stream_deltas), which the loop adds up:
    each CUMULATIVE output it hands its streams is the whole output so far, holding views of one list a request
    (ListPrefix) after its first, and an output a reader holds never changes afterwards. Oracle: LLM.generate's
    outputs of the same greedy requests on the same engine (which stay plain lists: the flag is the loop's requests'
    only), with a stop string taken from the middle of the text (held back, then cut) and logprobs."""
    from picovllm.outputs import ListPrefix, RequestOutput
    from picovllm.sampling_params import RequestOutputKind

    ps = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    free = chat_llm.generate(ps, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    stops = [o.outputs[0].text[12:15] for o in free]
    assert all(len(s) == 3 for s in stops)

    def params(i, kind="CUMULATIVE"):
        return SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                              stop=[stops[i]], output_kind=getattr(RequestOutputKind, kind))

    ref = chat_llm.generate(ps, [params(i) for i in range(3)], use_tqdm=False)
    assert type(ref[0].outputs[0].token_ids) is list          # the offline API's outputs: plain lists

    delivered = {f"c{i}": [] for i in range(3)}

    class Loop(AsyncEngine):
        def _deliver(self, outputs):
            """Every output as the loop hands it to the streams (a slow reader's stream keeps the latest alone),
            with copies of what it held then."""
            for out in outputs:
                if isinstance(out, RequestOutput) and out.request_id in delivered:
                    c = out.outputs[0]
                    delivered[out.request_id].append((out, list(c.token_ids), c.text, list(c.logprobs),
                                                      c.finish_reason))
            super()._deliver(outputs)

    async def read(ae, i, rid, kind="CUMULATIVE"):
        return [out async for out in ae.generate(ps[i], params(i, kind), rid)]

    async def main():
        ae = Loop(chat_llm.engine)
        ae.start()
        try:
            return await asyncio.gather(*(read(ae, i, f"c{i}") for i in range(3)), read(ae, 0, "d", "DELTA"))
        finally:
            await ae.shutdown()

    *streamed, delta = asyncio.run(main())
    for i, got in enumerate(delivered.values()):
        assert streamed[i][-1] is got[-1][0]
        want = ref[i].outputs[0]
        assert want.finish_reason == "stop" and want.stop_reason == stops[i] and stops[i] not in want.text
        last, ids, text, logprobs, reason = got[-1]
        assert (ids, text, logprobs, reason) == (want.token_ids, want.text, want.logprobs, "stop")
        assert last.prompt_logprobs == ref[i].prompt_logprobs
        assert len(got) > 3 and not any(o.finished for o, *_ in got[:-1]) and last.finished
        assert all(any(o is out for out, *_ in got) for o in streamed[i])
        for k, (out, ids, text, logprobs, _) in enumerate(got):
            c = out.outputs[0]
            if k:       # the first goes as the engine made it
                assert type(c.token_ids) is ListPrefix and type(c.logprobs) is ListPrefix
            # unchanged since it came, and a prefix of the final output
            assert (c.token_ids, c.text, c.logprobs) == (ids, text, logprobs)
            assert ids == want.token_ids[:len(ids)] and want.text.startswith(text)
            assert logprobs == want.logprobs[:len(logprobs)]
    pieces = [o.outputs[0] for o in delta]          # a DELTA request's outputs still hold only what is new
    assert [t for p in pieces for t in p.token_ids] == ref[0].outputs[0].token_ids
    assert "".join(p.text for p in pieces) == ref[0].outputs[0].text
    engine = chat_llm.engine
    assert not engine.requests and not engine.stream_deltas
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    again = chat_llm.generate(ps[:1], params(0), use_tqdm=False)[0].outputs[0]
    assert type(again.token_ids) is list and again.token_ids == ref[0].outputs[0].token_ids


def test_an_add_refused_for_its_id_leaves_the_running_delta_request_as_it_was(chat_llm):
    """An add under the id of a running DELTA request is refused (the id is in use); the running request's outputs
    still hold only what is new, one token each (the refusal's answer had made the loop take it for a new request
    and add its outputs up). The commands go to the loop as EngineClient would not send them (it refuses an id in
    use itself), as another client of the loop could."""
    from picovllm.entrypoints.openai.engine_client import AddRequest, CommandAnswer
    from picovllm.outputs import RequestOutput
    from picovllm.sampling_params import RequestOutputKind

    got, answers = [], []

    class Loop(AsyncEngine):
        def _deliver(self, outputs):
            got.extend(o for o in outputs if isinstance(o, RequestOutput))
            answers.extend(o for o in outputs if isinstance(o, CommandAnswer))

    loop = Loop(chat_llm.engine)
    delta = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    loop._commands.put(AddRequest("a", [5, 6, 7, 8], delta, 0.0))
    for i in range(20):
        if i == 2:
            for params in (SamplingParams(max_tokens=2), delta):
                loop._commands.put(AddRequest("a", [9, 10], params, 0.0))
        loop._iteration()
        if i > 2 and not chat_llm.engine.requests:
            break
    assert [a.error is None for a in answers] == [True, False, False]
    assert "already in use" in str(answers[1].error)
    assert [len(o.outputs[0].token_ids) for o in got] == [1] * 8 and got[-1].finished
    assert not loop._adding_up[0]._whole and not loop._adding_up[0]._adding and not loop._adding_up[1]._so_far
