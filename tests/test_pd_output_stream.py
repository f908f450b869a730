"""A /pd stream's outputs (disagg.messages.OutputEncoder, OutputDecoder): a step costs what is new in it at both ends.
The encoder takes the last outputs' lists sent as a prefix of the next ones' where both are views of one list
(outputs.ListPrefix, as a D server's engine process hands them); the decoder extends one list a completion in place,
each unfinished output holding its own prefix of it.

Oracle: the cumulative outputs themselves, as the wire carries them (the metrics with a whole output and a final one
only, the KV handover and the embedding with a whole one: a delta's handover goes on its line, pd_http._ndjson_lines).
Compared at every step of a scripted run, fed as an engine loop hands its outputs (new lists each), as lists extended
in place, and as an engine process's ListPrefix views; again once the run is decoded (an output handed out never
changes). No model, no sockets: each line goes through JSON as on the wire.
"""
import dataclasses
import json
from types import SimpleNamespace

import pytest

from picovllm.disagg.fleet_server import FleetChildLoop
from picovllm.disagg.messages import OutputDecoder, OutputEncoder
from picovllm.disagg.pd_http import PDChildLoop
from picovllm.outputs import CompletionOutput, ListPrefix, Logprob, RequestMetrics, RequestOutput


def lps(ids: list[int]) -> list[dict[int, Logprob]]:
    """Each token's logprobs: its own and one runner-up's."""
    return [{t: Logprob(-0.25 * t, 1, f"<{t}>"), t + 1000: Logprob(-9.0, 2, f"<{t + 1000}>")} for t in ids]


def comp(text: str, ids: list[int], logprobs: bool = False, reason: str | None = None, stop=None,
         index: int = 0) -> CompletionOutput:
    return CompletionOutput(index, text, list(ids), -0.5 * len(ids) if logprobs else None,
                            lps(ids) if logprobs else None, reason, stop)


def metrics(n: int, finished: bool = False) -> RequestMetrics:
    return RequestMetrics(1.0, 1.5, 2.0, 2.0 + n if finished else None, [2.0 + j for j in range(n)])


def out(rid: str, comps: list[CompletionOutput], finished: bool = False, error: str | None = None, cached: int = 2,
        scored=None, handover: dict | None = None, done_metrics: bool = True) -> RequestOutput:
    """A cumulative output as an engine makes it: its metrics so far (a final's finished)."""
    n = max(len(c.token_ids) for c in comps)
    m = metrics(n, finished) if done_metrics or not finished else None
    return RequestOutput(rid, "the prompt", [7, 8, 9], comps, finished, m, error, cached, scored, handover)


SCORED = [None, {8: Logprob(-1.5, 2, "p")}, {9: Logprob(-0.5, 1, "q")}]


def scripted() -> list[list[RequestOutput]]:
    """Streams of cumulative outputs, each stream one request's."""
    return [
        # a stop string cuts back text that had gone out (include_stop_str_in_output off); logprobs and the prompt's;
        # a speculative step adds three tokens; a held-back tail leaves the text as it was
        [out("stop", [comp(" a", [10], True)], scored=SCORED),
         out("stop", [comp(" a b", [10, 11], True)], scored=SCORED),
         out("stop", [comp(" a b c d e", [10, 11, 12, 13, 14], True)], scored=SCORED),
         out("stop", [comp(" a b c d e", [10, 11, 12, 13, 14, 15], True)], scored=SCORED),
         out("stop", [comp(" a b c", [10, 11, 12, 13, 14, 15, 16], True, "stop", "d")], True, scored=SCORED)],
        # n = 2 in one output: one sample finishes first; then one completion only (the stream sends it whole)
        [out("n2", [comp("x", [1]), comp("y", [2], index=1)]),
         out("n2", [comp("xx", [1, 1]), comp("yy", [2, 2], index=1)]),
         out("n2", [comp("xxx", [1, 1, 1]), comp("yy", [2, 2], reason="length", index=1)]),
         out("n2", [comp("xxxx", [1, 1, 1, 1])]),
         out("n2", [comp("xxxxx", [1, 1, 1, 1, 1])]),
         out("n2", [comp("xxxxx!", [1, 1, 1, 1, 1, 2], reason="stop", stop=2)], True)],
        # aborted mid-stream, with logprobs, its final without metrics
        [out("abort", [comp("q", [5], True)]),
         out("abort", [comp("qr", [5, 6], True)]),
         out("abort", [comp("qr", [5, 6], True, "abort")], True, done_metrics=False)],
        # failed on D: an error, the cache hits counted anew
        [out("error", [comp("e", [3])]),
         out("error", [comp("ef", [3, 4])], cached=16),
         out("error", [comp("ef", [3, 4], reason="error")], True, "the decode engine failed: RuntimeError: boom")],
        # the wire's general case: token ids, logprobs and text rewritten from the middle, then grown again
        [out("rewrite", [comp("abc", [1, 2, 3], True)]),
         out("rewrite", [comp("abcd", [1, 2, 3, 4], True)]),
         out("rewrite", [comp("abXY", [1, 2, 7, 8], True)]),
         out("rewrite", [comp("abXYZ", [1, 2, 7, 8, 9], True)]),
         out("rewrite", [comp("a", [1], True)]),
         out("rewrite", [comp("a!", [1, 5], True, "length")], True)],
        # a fleet P's: the first token, then the hand-over (finished without a reason, where D pulls the KV from)
        [out("handover", [comp("h", [4])]),
         out("handover", [comp("h", [4])], True, handover={"type": "PublishedKV", "body": {"request_id": "h"}})],
        # not streamed: the final only, whole
        [out("final", [comp("done", [1, 2, 3, 4], True, "length")], True)],
    ]


class Fed:
    """A stream's outputs as the D server's /pd stream gets them. "copies": new lists each (an engine loop's, as
    Engine.make_output makes them); "in_place": one list a completion, extended in place (and replaced where an
    output does not extend it), handed out as it is; "views": ListPrefix views of such lists (an engine process's,
    output_deltas.OutputsFromDeltas)."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.lists: dict = {}

    def __call__(self, o: RequestOutput) -> RequestOutput:
        if self.how == "copies":
            return o
        comps = [dataclasses.replace(c, token_ids=self._list((c.index, "ids"), c.token_ids),
                                     logprobs=None if c.logprobs is None else self._list((c.index, "lps"), c.logprobs))
                 for c in o.outputs]
        return dataclasses.replace(o, outputs=comps)

    def _list(self, key, items: list):
        have = self.lists.get(key)
        if have is None or have != items[:len(have)]:
            have = self.lists[key] = list(items)
        else:
            have += items[len(have):]
        return ListPrefix(have) if self.how == "views" else have


def as_sent(o: RequestOutput, whole: RequestOutput, last: RequestOutput | None) -> RequestOutput:
    """What a stream reads back of the cumulative output o, the stream's last whole output being `whole` and its last
    output `last`: all of o, but a delta's metrics are a final's only (else those last read), and its prompt's
    logprobs those of the whole output; its KV handover and embedding go on its line, not in it."""
    if o is whole:
        return o
    m = o.metrics if o.finished and o.metrics is not None else last.metrics
    return dataclasses.replace(o, prompt_logprobs=whole.prompt_logprobs, metrics=m, kv_handover=None, embedding=None)


@pytest.mark.parametrize("how", ["copies", "in_place", "views"])
def test_each_read_output_is_the_cumulative_output(how):
    """Every output read back equals its cumulative output, step by step; a whole line exactly where a stream starts
    or its number of completions changes. An unfinished output read from a delta holds ListPrefix views, each of the
    list the one before it held where its completion extends the last (one list a completion, extended in place), a
    new one where it was rewritten; a whole or final output's lists are its own. Once the run is read, every output
    still equals what it was when read, after the finals' own lists are changed too."""
    held = []
    for stream in scripted():
        enc, dec, feed = OutputEncoder(), OutputDecoder(), Fed(how)
        whole = prev = last = None
        for o in stream:
            line = json.loads(json.dumps(enc.encode(feed(o))))
            assert ("output" in line) == (prev is None or len(prev.outputs) != len(o.outputs)), o
            if "output" in line:
                whole = o
            back = dec.decode(line)
            expect = as_sent(o, whole, last)
            assert back == expect, o
            held.append((back, expect))
            for i, (c, b) in enumerate(zip(o.outputs, back.outputs)):
                views = "delta" in line and not o.finished
                assert isinstance(b.token_ids, ListPrefix) == views
                assert isinstance(b.logprobs, ListPrefix) == (views and c.logprobs is not None)
                if views and isinstance(last.outputs[i].token_ids, ListPrefix):
                    grew = c.token_ids[:len(prev.outputs[i].token_ids)] == prev.outputs[i].token_ids
                    assert last.outputs[i].token_ids.prefix_of(b.token_ids) == grew, o
            prev, last = o, back
    for back, _ in held:
        if back.finished:      # a final's lists are its own: changing them changes no other output
            for c in back.outputs:
                c.token_ids[:] = [-1]
                if c.logprobs is not None:
                    c.logprobs.clear()
    for back, expect in held:
        if not back.finished:
            assert back == expect


class Counted(list):
    """A list that counts the items read from it, through indexing, slices and iteration."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self.reads = 0

    def __getitem__(self, i):
        got = super().__getitem__(i)
        self.reads += len(got) if isinstance(i, slice) else 1
        return got

    def __iter__(self):
        for item in super().__iter__():
            self.reads += 1
            yield item


def test_the_encoder_reads_only_what_is_new_of_views():
    """Fed an engine process's outputs (ListPrefix views of one list a completion), the encoder reads each step's
    new token ids and logprobs only, however many came before (it had copied and compared them all)."""
    ids, logprobs = Counted(range(1000)), Counted(lps(list(range(1000))))
    enc = OutputEncoder()

    def output() -> RequestOutput:
        c = CompletionOutput(0, "w" * len(ids), ListPrefix(ids), -1.0, ListPrefix(logprobs))
        return RequestOutput("r", None, [1, 2], [c], False)

    enc.encode(output())
    for t in range(1000, 1005):
        ids.reads = logprobs.reads = 0
        ids.append(t)
        logprobs += lps([t])
        delta = enc.encode(output())["delta"]["outputs"][0]
        assert (delta["token_start"], delta["token_ids"], delta["logprobs_start"]) == (t, [t], t)
        assert (ids.reads, logprobs.reads) == (1, 1)


@pytest.mark.parametrize("field, value", [("token_start", 3), ("text_start", -1), ("logprobs_start", "0"),
                                          ("token_start", 1.0)])
def test_a_delta_that_does_not_fit_its_stream_is_refused_naming_the_field(field, value):
    """A delta whose part begins past what the stream has, or not at an int, is refused (ValueError: a /pd stream's
    reader takes it for a broken stream), naming the field; it had been cut to fit, or raised a TypeError."""
    enc, dec = OutputEncoder(), OutputDecoder()
    dec.decode(json.loads(json.dumps(enc.encode(out("r", [comp("ab", [1, 2], True)])))))
    line = json.loads(json.dumps(enc.encode(out("r", [comp("abc", [1, 2, 3], True)]))))
    line["delta"]["outputs"][0][field] = value
    with pytest.raises(ValueError, match=f"an output delta's {field} must be an int from 0 to 2, got {value!r}"):
        dec.decode(line)


@pytest.mark.parametrize("loop", [PDChildLoop, FleetChildLoop])
def test_a_decode_servers_engine_process_makes_delta_outputs_a_prefill_servers_does_not(loop):
    """A D server's engine makes its outputs as deltas (Engine.stream_deltas), as a colocated engine process's does;
    a P's stay cumulative (a linked P re-sends a request's last output when D takes it over)."""
    for role, deltas in (("d", True), ("p", False)):
        ends = loop.__new__(loop)
        ends.engine = SimpleNamespace(config=SimpleNamespace(role=role))
        assert ends.stream_deltas is deltas


def test_a_streaming_session_hands_its_user_plain_lists():
    """DisaggLLM's session(stream=True) gives its user every output: their token ids and logprobs are lists, as
    LLM.generate's (json.dumps takes them, a user may append), not the decoder's ListPrefix views, and equal what was
    sent; the final's too."""
    from picovllm.disagg.messages import Output
    from picovllm.disagg.session import DisaggSession
    session = DisaggSession.__new__(DisaggSession)      # only what _on_message reads
    session.stream, session._wire, session.results = True, {}, {}
    enc, ids, seen = OutputEncoder(), [], []
    for step in range(4):
        ids.append(10 + step)                  # extended in place: the decoder hands out views of its own lists
        sent = out("r", [comp("ab"[:step], ids, logprobs=True)], finished=step == 3)
        (got,) = session._on_message("d", Output(json.loads(json.dumps(enc.encode(sent)))))
        seen.append(got)
        c = got.outputs[0]
        assert type(c.token_ids) is list and type(c.logprobs) is list, step
        assert json.loads(json.dumps(c.token_ids)) == ids
    assert [o.outputs[0].token_ids for o in seen] == [[10], [10, 11], [10, 11, 12], [10, 11, 12, 13]]
