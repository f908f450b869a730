"""The API server's side of a served engine's outputs (output_deltas.OutputsFromDeltas): a request's token ids and
logprobs so far kept in one list each, extended in place by its deltas, each output handed out holding its own
prefix of them (outputs.ListPrefix), where each output had been a new whole, its lists copies.

Oracle: that accumulation as it was (Rebuilt below: each delta applied to copies of the last output's lists), fed
the same messages. Compared at every step; again once every message is decoded (an output a stream still holds
never changes); and as what the chat and completions handlers stream of them, SSE chunk for chunk. No model: the
messages are the pipe's encoding (OutputDeltas) of scripted outputs.
"""
import asyncio
import dataclasses
import json
import pickle
import re
from types import SimpleNamespace

import pytest

from picovllm.entrypoints.openai.engine_client import (AddRequest, CommandAnswer, EngineStats, EngineStepError,
                                                      StepOutputs)
from picovllm.entrypoints.openai.engine_process import PipeEngineClient
from picovllm.entrypoints.openai.output_deltas import OutputDeltas, OutputsFromDeltas
from picovllm.outputs import CompletionOutput, ListPrefix, Logprob, RequestMetrics, RequestOutput
from picovllm.sampling_params import RequestOutputKind


class Rebuilt:
    """The oracle: the API side's accumulation before ListPrefix. Every output a new whole, its text, token ids and
    logprobs the last output's copied with the delta's added."""

    def __init__(self) -> None:
        self.last: dict[str, RequestOutput] = {}

    def decode(self, msg):
        if type(msg) is tuple:
            (rid, new_ids, kept, new_text, new_lps, cum, finish, stop, finished, error, cached, metrics,
             handover) = msg
            last = self.last.pop(rid)
            c = last.outputs[0]
            comp = CompletionOutput(c.index, c.text[:kept] + new_text, c.token_ids + new_ids, cum,
                                    None if new_lps is None else (c.logprobs or []) + new_lps, finish, stop)
            out = RequestOutput(rid, last.prompt, last.prompt_token_ids, [comp], finished, metrics or last.metrics,
                                error, cached, last.prompt_logprobs, handover)
        elif isinstance(msg, RequestOutput):
            out = msg
            self.last.pop(out.request_id, None)
        else:
            if isinstance(msg.error, EngineStepError):
                self.last.pop(msg.request_id, None)
            return msg
        if not out.finished:
            self.last[out.request_id] = out
        return out


def lps(ids: list[int]) -> list[dict[int, Logprob]]:
    """Each token's logprobs: its own and one runner-up's."""
    return [{t: Logprob(-0.25 * t, 1, f"<{t}>"), t + 1000: Logprob(-9.0, 2, f"<{t + 1000}>")} for t in ids]


def out(rid: str, text: str, ids: list[int], logprobs=None, reason: str | None = None, stop=None, prompt=(1, 2, 3),
        scored=None, metrics=None) -> RequestOutput:
    """A cumulative output as an engine makes it (finished with a finish reason)."""
    comp = CompletionOutput(0, text, list(ids), None if logprobs is None else -0.5 * len(ids), logprobs, reason, stop)
    return RequestOutput(rid, None, list(prompt), [comp], reason is not None, metrics, None, 2, scored)


def test_list_prefix_reads_as_a_copy_of_the_list():
    """A ListPrefix is what list(items) was when it was taken, whatever is appended after: its length, items
    (negative indexes too), slices (lists, steps and all), iteration, equality either way round, concatenation,
    repr, and pickling (as a list)."""
    items = [10, 11, 12, 13]
    view, copy = ListPrefix(items), list(items)
    items += [14, 15]
    assert len(view) == 4 and list(view) == copy and view == copy and copy == view and view == ListPrefix(copy)
    assert view != items and items != view and view != tuple(copy) and view != ListPrefix(items)
    assert [view[i] for i in range(-4, 4)] == [copy[i] for i in range(-4, 4)]
    for i in (4, -5):
        with pytest.raises(IndexError):
            view[i]
    for s in (slice(None), slice(1, None), slice(None, -1), slice(2, 99), slice(None, None, 2), slice(None, None, -1),
              slice(3, 0, -2), slice(5, 9)):
        assert view[s] == copy[s] and type(view[s]) is list, s
    assert view + [1] == copy + [1] and [1] + view == [1] + copy and type(view + [1]) is list
    assert 13 in view and 14 not in view and view.index(12) == 2 and view.count(10) == 1
    assert repr(view) == repr(copy) and list(reversed(view)) == copy[::-1]
    assert pickle.loads(pickle.dumps(view)) == copy and type(pickle.loads(pickle.dumps(view))) is list
    assert json.dumps(view[:]) == json.dumps(copy)
    with pytest.raises(TypeError):
        hash(view)


def scripted_steps() -> list[list]:
    """Each step's engine outputs (and answers) for four requests, cumulative: a stop string that cuts the text
    back ("a"), prompt logprobs over two prefill chunks then logprobs that stop and start again, as the pipe's
    decoding has them ("b"), an output with fewer tokens than the last (sent whole), a failed step and a new request
    under the id ("c"), an abort ("d"); the finished ones with their metrics."""
    scored = [None, {2: Logprob(-1.0, 1, "b")}, {3: Logprob(-2.0, 1, "c")}]
    done = RequestMetrics(1.0, 1.1, 1.2, 2.0, [1.2, 1.5, 2.0])
    return [
        [out("a", "Hel", [1], lps([1])), out("b", "", [], scored=scored[:2]), out("d", "x", [50])],
        [out("a", "Hello", [1, 2], lps([1, 2])), out("b", "", [], scored=scored), out("d", "xy", [50, 51])],
        [out("a", "Hello wo", [1, 2, 3], lps([1, 2, 3])), out("b", "B", [7], lps([7]), scored=scored),
         out("c", "c1", [9])],
        [out("a", "Hello w", [1, 2, 3, 4], lps([1, 2, 3, 4])), out("b", "BB", [7, 8], lps([7, 8]), scored=scored),
         out("c", "c1c2", [9, 10]), out("d", "xyz", [50, 51, 52])],
        [out("a", "Hello world", [1, 2, 3, 4, 5], lps([1, 2, 3, 4, 5]), "stop", "ld", metrics=done),
         out("b", "BBB", [7, 8, 9], None, scored=scored), out("c", "c1", [9]),
         out("d", "xyz", [50, 51, 52], reason="abort", metrics=done)],
        [out("b", "BBBB", [7, 8, 9, 10], lps([7, 8, 9, 10]), scored=scored), out("c", "c1c3", [9, 11]),
         CommandAnswer("c", EngineStepError("the step failed"))],
        [out("c", "new", [42], prompt=(5,)), out("b", "BBBB!", [7, 8, 9, 10, 11], lps([7, 8, 9, 10, 11]), "length",
                                                 scored=scored, metrics=done)],
        [out("c", "new one", [42, 43], prompt=(5,))],
        [out("c", "new one.", [42, 43, 44], prompt=(5,), reason="stop", metrics=done)],
    ]


def test_decoded_outputs_equal_the_rebuilt_ones_and_stay_as_they_were():
    """Every message of the scripted steps decoded both ways: equal outputs at every step (the text, the token ids,
    the logprobs, None where the oracle has None, every other field), and equal again once all are decoded, though
    the deltas after an output extended the lists its token ids and logprobs are prefixes of; nothing kept for
    requests that ended."""
    enc, dec, ref = OutputDeltas(), OutputsFromDeltas(), Rebuilt()
    held, deltas = [], 0
    for step in scripted_steps():
        for item in step:
            msg = enc.encode(item)
            deltas += type(msg) is tuple
            got, want = dec.decode(msg), ref.decode(msg)
            assert got == want, (got, want)
            if isinstance(got, RequestOutput):
                c, w = got.outputs[0], want.outputs[0]
                assert (c.logprobs is None) == (w.logprobs is None) and c.text == w.text
                held.append((got, want))      # (the oracle's lists are never extended)
    assert deltas >= 10
    assert all(got == want for got, want in held)
    assert not dec._so_far and not ref.last


def test_outputs_sent_whole_are_handed_out_as_they_are_and_copied_only_at_a_delta():
    """A DELTA request's outputs all go whole (each holds what is new): each is handed out as it came, and the
    decoder keeps no copy of its lists (it had copied each one's, unused); a request whose first output went whole
    gets its lists copied once, at its first delta, which then extends the copy, not the output handed out."""
    enc, dec = OutputDeltas(), OutputsFromDeltas()
    params = SimpleNamespace(output_kind=RequestOutputKind.DELTA)
    enc.track(AddRequest("d", [1, 2, 3], params, 0.0))
    enc.encode(CommandAnswer("d", None))
    for k in range(5):
        o = out("d", "x" * 100, list(range(100 * k, 100 * k + 100)), lps(range(100)))
        msg = enc.encode(o)
        assert msg is o and dec.decode(msg) is o
        assert dec._so_far["d"].token_ids is None and dec._so_far["d"].logprobs is None
    first = out("c", "ab", [1, 2], lps([1, 2]))
    assert dec.decode(enc.encode(first)) is first and dec._so_far["c"].token_ids is None
    second = dec.decode(enc.encode(out("c", "abc", [1, 2, 3], lps([1, 2, 3]))))
    assert second.outputs[0].token_ids == [1, 2, 3] and second.outputs[0].logprobs == lps([1, 2, 3])
    assert first.outputs[0].token_ids == [1, 2] and len(first.outputs[0].logprobs) == 2     # unchanged


def test_a_refused_add_of_an_id_in_use_leaves_the_running_request_as_it_was():
    """The pipe's encoder: a DELTA request's outputs go whole once its add is answered; another add under its id,
    refused (a ValueError), changes nothing for it (it had been forgotten as DELTA, its outputs then encoded as
    deltas of themselves); a refused DELTA add is never taken for one; a failed request is forgotten."""
    enc = OutputDeltas()
    delta = SimpleNamespace(output_kind=RequestOutputKind.DELTA)
    cumulative = SimpleNamespace(output_kind=RequestOutputKind.CUMULATIVE)
    enc.track(AddRequest("a", [1, 2, 3], delta, 0.0))
    enc.encode(CommandAnswer("a", None))
    first = out("a", "x", [7])
    assert enc.encode(first) is first
    for params in (cumulative, delta):
        enc.track(AddRequest("a", [4], params, 0.0))
        enc.encode(CommandAnswer("a", ValueError("request_id 'a' is already in use")))
        o = out("a", "y", [8])
        assert enc.encode(o) is o
    enc.track(AddRequest("b", [4], delta, 0.0))
    enc.encode(CommandAnswer("b", ValueError("max_tokens: too many")))
    enc.encode(out("b", "z", [9]))
    assert type(enc.encode(out("b", "zz", [9, 10]))) is tuple          # b, a CUMULATIVE request added later
    enc.encode(CommandAnswer("a", EngineStepError("the step failed")))
    assert not enc._whole and not enc._adding


class FedClient(PipeEngineClient):
    """A served engine's client with no engine behind it: every add accepted at once (its engine id kept), each
    step's messages handed to it by the test as the reader thread hands them (decoded by `decoder`)."""

    def __init__(self, decoder) -> None:
        super().__init__(self, None)      # (its commands' pipe: send below)
        self._outputs = decoder
        self.added: list[str] = []

    def send(self, cmd) -> None:
        if isinstance(cmd, AddRequest):
            self.added.append(cmd.request_id)
            self._loop.call_soon(self._answer, CommandAnswer(cmd.request_id, None))

    @property
    def is_running(self) -> bool:
        return True

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()


def sample_script(k: int) -> list[RequestOutput]:
    """Sample k's cumulative outputs (ids from 100 * k): a reasoning block, content, a tool call (hermes) whose
    block spans several tokens, a text cut back by a stop string, then the finish. Sample 0's carry the prompt's
    logprobs (the siblings' none, as the engine scores the prompt once)."""
    pieces = ["<think>", "let me", " see</think>", "Sure", f" {k}: ", "<tool_call>", '{"name": "f", ',
              '"arguments": {"x": 1}}', "</tool_call>", " byx", "e", " done"]
    outs, text, ids = [], "", []
    for i, piece in enumerate(pieces):
        text, ids = (text[:-1] if piece == "e" else text) + piece, ids + [100 * k + i]
        last = i == len(pieces) - 1
        outs.append(out("?", text, ids, lps(ids), "stop" if last else None, "\n" if last else None,
                        scored=[None, {2: Logprob(-1.0, 1, "b")}, {3: Logprob(-2.0, 1, "c")}] if k == 0 else None,
                        metrics=RequestMetrics(1.0, 1.1, 1.2, 2.0) if last else None))
    return outs


class Disconnect:
    """A client that never hangs up (final_output's watch for it)."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()


async def served(decoder, handlers: list, lag: bool) -> list[list[str]]:
    """What each handler answers (its SSE events, or its body as one), fed the scripted samples one output a step,
    the outputs decoded by decoder: every output read before the next step, or (lag) the next step decoded while
    the readers of this one's outputs have yet to run, as the reader thread may. Handler j's request is r{j}: its
    samples' engine ids are r{j}-TAG and r{j}-TAG-{k} (serving.engine_request_id)."""
    from picovllm.entrypoints.openai.serving import ServingContext
    client = FedClient(decoder)
    client.start()
    ctx = ServingContext(client, SimpleNamespace(tokenizer=None), None, "m")     # (no harmony)
    tasks = [asyncio.ensure_future(h.answer(ctx, f"r{j}")) for j, h in enumerate(handlers)]
    encoder, script = OutputDeltas(), [sample_script(k) for k in range(3)]
    for step in range(len(script[0])):
        await asyncio.sleep(0)
        items = []
        for rid in client.added:
            if rid in client._streams:
                k = int(rid.split("-")[2]) if rid.count("-") == 2 else 0
                items.append(encoder.encode(dataclasses.replace(script[k][step], request_id=rid)))
        client._take(StepOutputs(items, EngineStats()))
        for _ in range(1 if lag else 20):   # the outputs handed to the streams (and every reader takes its own)
            await asyncio.sleep(0)
    return [[re.sub(r'"created": ?\d+', '"created":0', a) for a in answer] for answer in await asyncio.gather(*tasks)]


async def events_of(gen) -> list[str]:
    return [event async for event in gen]


@dataclasses.dataclass
class Chat:
    """A streamed chat request (ChatHandler._events), with tools (hermes) or not, a reasoning split (opened)."""
    body: dict
    opened: bool | None = None

    async def answer(self, ctx, request_id: str) -> list[str]:
        from picovllm.entrypoints.openai.protocol import ChatCompletionRequest
        from picovllm.entrypoints.openai.serving import SampleGroup
        from picovllm.entrypoints.openai.serving_chat import ChatHandler
        from picovllm.entrypoints.parallel_sampling import sample_params
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True, **self.body)
        samples = sample_params(req.sampling_params(None, req.num_logprobs))
        group = await SampleGroup(ctx, [1, 2, 3], samples, request_id, 0.0).start()
        policy = req.tool_policy()
        policy.id_style = "kimi"        # call ids that are the same in both runs
        return await events_of(ChatHandler(ctx)._events(req, group, req.num_logprobs, policy, self.opened, False))


@dataclasses.dataclass
class Completion:
    """A completions request, streamed (CompletionHandler._events) or not (its body); echo: the prompt "abc"
    (its first token "a")."""
    body: dict

    async def answer(self, ctx, request_id: str) -> list[str]:
        from picovllm.entrypoints.openai.protocol import CompletionRequest
        from picovllm.entrypoints.openai.serving import SampleGroup
        from picovllm.entrypoints.openai.serving_completion import CompletionHandler
        req = CompletionRequest(prompt="abc", **self.body)
        params = req.sampling_params(req.max_tokens, req.logprobs)
        job = ([1, 2, 3], "abc" if req.echo else "", "a" if req.echo and req.logprobs is not None else None)
        handler = CompletionHandler(ctx)
        if not req.stream:
            body = await handler._answer(req, Disconnect(), job, request_id, params, req.samples(params), False, 0.0)
            return [json.dumps(body)]
        group = await SampleGroup(ctx, job[0], req.samples(params), request_id, 0.0).start()
        return await events_of(handler._events(req, request_id, [(group, *job[1:])], params.n))


def handlers() -> list:
    usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    return [Chat({"n": 2, "logprobs": True, "top_logprobs": 1, "return_token_ids": True, **usage}),
            Chat({"tools": tools}, opened=False),
            Chat({"tools": tools, "tool_choice": "required", "logprobs": True}),
            Chat({}, opened=False),
            Completion({"stream": True, "n": 2, "logprobs": 1, "echo": True, "return_token_ids": True,
                        "max_tokens": 20, **usage}),
            Completion({"n": 2, "best_of": 3, "logprobs": 1, "echo": True, "return_token_ids": True,
                        "max_tokens": 20, "prompt_logprobs": 1})]


@pytest.mark.parametrize("lag", [False, True], ids=["readers-keep-up", "readers-lag"])
def test_the_handlers_answer_the_same(lag):
    """Chat and completions, streamed (n samples, logprobs, return_token_ids, continuous usage, echo with the
    prompt's logprobs, a reasoning split, tool calls auto and required) and not (best_of, echo, logprobs, token ids,
    prompt logprobs), over the decoded outputs: the same SSE events, in the same order, and the same body as over
    the rebuilt ones; also where the next step is decoded before the readers of the last one's outputs run."""
    got = asyncio.run(served(OutputsFromDeltas(), handlers(), lag))
    want = asyncio.run(served(Rebuilt(), handlers(), lag))
    assert got == want
    assert all(len(events) > 5 and events[-1] == "data: [DONE]\n\n" for events in got[:-1])
    assert '"tool_calls"' in "".join(got[1]) and '"reasoning"' in "".join(got[1]) and '"token_ids"' in "".join(got[0])
    body = json.loads(got[-1][0])
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 36, body
