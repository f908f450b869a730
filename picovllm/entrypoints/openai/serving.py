"""What the completion and chat handlers share: admission, streaming deltas, usage, SSE, disconnects."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from picovllm.entrypoints.openai.async_engine import AsyncEngine, EngineDeadError, EngineStepError, RequestStream
from picovllm.entrypoints.openai.metrics import ServerMetrics
from picovllm.entrypoints.openai.protocol import APIError, error_body
from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from picovllm.outputs import CompletionOutput, Logprob, RequestOutput
from picovllm.sampling_params import SamplingParams

ENGINE_ERRORS = (EngineStepError, EngineDeadError)


class JSONBody(JSONResponse):
    """ASCII-escaped JSON, as the SSE events: a lone surrogate a client sent can never make encoding fail."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


@dataclass
class ServingContext:
    engine: AsyncEngine
    tokenizer: TokenizerWorker
    metrics: ServerMetrics
    model_name: str

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(400, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def add(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                  arrival_time: float) -> RequestStream:
        try:
            return await self.engine.add_request(prompt_token_ids, params, request_id, arrival_time)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except ENGINE_ERRORS as e:
            raise APIError(503, str(e), type="service_unavailable") from None


class TextDeltas:
    """Turns cumulative outputs into deltas. While a stop string could still trim the text, the last
    len(longest stop) - 1 characters are held back, so the streamed pieces always add up to the final text."""

    def __init__(self, stop: list[str]) -> None:
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent_chars = 0
        self.sent_tokens = 0

    def text(self, c: CompletionOutput, finished: bool) -> str:
        end = len(c.text) if finished else max(self.sent_chars, len(c.text) - self.hold)
        delta, self.sent_chars = c.text[self.sent_chars:end], end
        return delta

    def tokens(self, c: CompletionOutput) -> range:
        new, self.sent_tokens = range(self.sent_tokens, len(c.token_ids)), len(c.token_ids)
        return new


def usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def top_logprobs(d: dict[int, Logprob], k: int) -> list[Logprob]:
    return sorted((lp for lp in d.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)[:k]


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse_error(e: Exception) -> str:
    return sse(error_body(str(e), "internal_error"))


async def final_output(raw: Request, stream: RequestStream) -> RequestOutput | None:
    """Wait for the request's last output; None if the client disconnected first (the request is aborted)."""
    async def last() -> RequestOutput | None:
        out = None
        async for out in stream.outputs():
            pass
        return out

    task = asyncio.ensure_future(last())
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        stream.close()
    if not task.done() or task.cancelled():
        return None
    try:
        return task.result()
    except ENGINE_ERRORS as e:
        raise APIError(500, str(e), type="internal_error") from None


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def now() -> int:
    return int(time.time())
