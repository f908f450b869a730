"""POST /v1/completions: one prompt (text or token ids) in, n (or the best n of best_of) texts out, streamed
over SSE or not."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response

from picovllm.entrypoints.openai.protocol import CompletionRequest
from picovllm.entrypoints.openai.serving import (ENGINE_ERRORS, SSE_DONE, JSONBody, SampleGroup, ServingContext,
                                                 TextDeltas, final_output, now, sse, sse_error, sse_response, usage)
from picovllm.entrypoints.parallel_sampling import best_of, merge_samples
from picovllm.outputs import CompletionOutput


class CompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        ctx = self.ctx
        ctx.check_model(req.model)
        prompt = req.single_prompt()
        req.check_echo()
        params = req.sampling_params(req.max_tokens, req.logprobs)
        samples = req.samples(params)
        ids = await ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        # echo: the prompt as sent (text), or its ids decoded as /detokenize does
        echo = (prompt if isinstance(prompt, str) else await ctx.tokenizer.decode(ids)) if req.echo else ""
        group = await SampleGroup(ctx, ids, samples, f"cmpl-{uuid.uuid4().hex}", arrival).start()
        if req.stream:
            return sse_response(self._events(req, group, params.stop, echo))
        out = await final_output(raw, group)
        if out is None:
            return Response(status_code=499)     # the client is gone; nobody reads this
        chosen = best_of(out, params.n) if len(samples) > params.n else out.outputs
        choices = [{"index": c.index, "text": echo + c.text,
                    "logprobs": _logprobs(c, range(len(c.token_ids)), 0)[0] if req.logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in chosen]
        return JSONBody(self._body(group.request_id, choices, usage=usage(out)))   # usage: every sample run

    def _body(self, rid: str, choices: list, **extra) -> dict:
        return {"id": rid, "object": "text_completion", "created": now(), "model": self.ctx.model_name,
                "choices": choices, **extra}

    async def _events(self, req: CompletionRequest, group: SampleGroup, stop: list[str],
                      echo: str) -> AsyncIterator[str]:
        k = len(group.samples)
        deltas, offsets, last = [TextDeltas(stop) for _ in range(k)], [0] * k, {}
        unechoed = set(range(k)) if echo else set()   # choices whose first chunk (it carries the prompt) is to come
        try:
            async for i, out in group.outputs():
                last[i], c = out, out.outputs[0]
                text, toks = deltas[i].text(c, out.finished), deltas[i].tokens(c)
                if not (text or out.finished or (req.logprobs is not None and toks)):
                    continue
                lp = None
                if req.logprobs is not None:
                    lp, offsets[i] = _logprobs(c, toks, offsets[i])
                if i in unechoed:
                    text = echo + text
                    unechoed.discard(i)
                choice = {"index": i, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                yield sse(self._body(group.request_id, [choice]))
            if req.include_usage and len(last) == k:
                yield sse(self._body(group.request_id, [], usage=usage(merge_samples(group.request_id,
                                                                                     [last[i] for i in range(k)]))))
        except ENGINE_ERRORS as e:
            yield sse_error(e)
        finally:
            group.close()
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

