"""POST /v1/completions: one prompt (text or token ids) in, text out, streamed over SSE or not."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response

from picovllm.entrypoints.openai.async_engine import RequestStream
from picovllm.entrypoints.openai.protocol import CompletionRequest
from picovllm.entrypoints.openai.serving import (ENGINE_ERRORS, SSE_DONE, JSONBody, ServingContext, TextDeltas, final_output,
                                                 now, sse, sse_error, sse_response, usage)
from picovllm.outputs import CompletionOutput


class CompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        ctx = self.ctx
        ctx.check_model(req.model)
        prompt = req.single_prompt()
        params = req.sampling_params(req.max_tokens, req.logprobs)
        ids = await ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = await ctx.add(ids, params, rid, arrival)
        if req.stream:
            return sse_response(self._events(req, stream, params.stop))
        out = await final_output(raw, stream)
        if out is None:
            return Response(status_code=499)     # the client is gone; nobody reads this
        c = out.outputs[0]
        choice = {"index": 0, "text": c.text, "logprobs": _logprobs(c, range(len(c.token_ids)), 0)[0]
                  if req.logprobs is not None else None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        return JSONBody(self._body(rid, [choice], usage=usage(out)))

    def _body(self, rid: str, choices: list, **extra) -> dict:
        return {"id": rid, "object": "text_completion", "created": now(), "model": self.ctx.model_name,
                "choices": choices, **extra}

    async def _events(self, req: CompletionRequest, stream: RequestStream, stop: list[str]) -> AsyncIterator[str]:
        deltas, offset, last = TextDeltas(stop), 0, None
        try:
            async for out in stream.outputs():
                last, c = out, out.outputs[0]
                text, toks = deltas.text(c, out.finished), deltas.tokens(c)
                if not (text or out.finished or (req.logprobs is not None and toks)):
                    continue
                lp = None
                if req.logprobs is not None:
                    lp, offset = _logprobs(c, toks, offset)
                choice = {"index": 0, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                yield sse(self._body(stream.request_id, [choice]))
            if req.include_usage and last is not None:
                yield sse(self._body(stream.request_id, [], usage=usage(last)))
        except ENGINE_ERRORS as e:
            yield sse_error(e)
        finally:
            stream.close()
        yield SSE_DONE


def _logprobs(c: CompletionOutput, idx: range, offset: int) -> tuple[dict, int]:
    """OpenAI's completions logprobs for output tokens idx: the chosen token and the top ones."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for i in idx:
        d = c.logprobs[i]
        chosen = d[c.token_ids[i]]
        s = chosen.decoded_token or ""
        tokens.append(s)
        token_lps.append(chosen.logprob)
        tops.append({(lp.decoded_token or ""): lp.logprob for lp in d.values()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset

