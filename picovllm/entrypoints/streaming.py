"""Streaming one request's text as the engine produces it, for the CLI (and anything else that prints)."""
from __future__ import annotations

from typing import Iterator

from picovllm.engine.llm_engine import Engine
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import SamplingParams


class TextStreamer:
    """Turns a request's growing text into deltas that are safe to show.

    A stop string is trimmed from the text once it is complete, so until the request finishes the
    last (longest stop string - 1) characters are held back: they may be the start of a stop string.
    """

    def __init__(self, stop: list[str]) -> None:
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.emitted = 0

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else len(text) - self.holdback
        if end <= self.emitted:
            return ""
        out, self.emitted = text[self.emitted:end], end
        return out


class StreamedRequest:
    """Iterate to run the engine until this request finishes, getting its new text piece by piece.

    `output` holds the final RequestOutput afterwards. Leaving early (an exception, a closed
    generator, Ctrl-C) aborts the request, so its KV blocks go back to the engine.
    """

    def __init__(self, engine: Engine, prompt: str | list[int], params: SamplingParams) -> None:
        self.engine = engine
        self.request_id = engine.add_request(prompt, params)
        self.streamer = TextStreamer(params.stop)
        self.output: RequestOutput | None = None

    def __iter__(self) -> Iterator[str]:
        others: list[RequestOutput] = []      # of requests added beside this one: the next engine.step() returns them
        try:
            while self.output is None or not self.output.finished:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"request {self.request_id} vanished from the engine")
                for out in self.engine.step():
                    if out.request_id != self.request_id:
                        others.append(out)
                        continue
                    self.output = out
                    piece = self.streamer.delta(out.outputs[0].text, out.finished)
                    if piece:
                        yield piece
        finally:
            self.engine.hold_outputs(others)
            if self.output is None or not self.output.finished:
                self.engine.abort(self.request_id)
