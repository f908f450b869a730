"""POST /v1/completions: one prompt (text or token ids) in, n (or the best n of best_of) texts out, streamed
over SSE or not."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request, Response

from picovllm.entrypoints.openai.protocol import APIError, CompletionRequest
from picovllm.entrypoints.openai.serving import (ENGINE_ERRORS, SSE_DONE, JSONBody, SampleGroup, ServingContext,
                                                 TextDeltas, check_room, final_output, now, prompt_logprobs_json, sse,
                                                 sse_error, sse_response, token_name, truncated, usage, with_usage)
from picovllm.entrypoints.openai.serving_beam import serve_beam_search
from picovllm.entrypoints.parallel_sampling import best_of, merge_samples
from picovllm.outputs import CompletionOutput, Logprob, json_logprob


class CompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        ctx = self.ctx
        ctx.check_model(req.model)
        ctx.check_special_token_spaces(req.spaces_between_special_tokens)
        prompts = req.prompts()
        # max_tokens 0 with echo: the prompt back, with its logprobs if asked, nothing generated (OpenAI's legacy
        # prompt scoring, as vLLM answers it); the engine samples one token, which is dropped
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise APIError(400, "max_tokens: must be >= 1 (0 only with echo: the prompt scored, nothing generated)",
                           param="max_tokens")
        if len(prompts) > 1 and req.use_beam_search:
            raise APIError(400, f"prompt: a list of {len(prompts)} prompts is not taken by beam search: send one "
                                f"a request", param="prompt")
        params = req.sampling_params(1 if echo_only else req.max_tokens, req.logprobs, ctx.sampling_defaults)
        samples = req.samples(params)
        jobs = [await self._prepared(req, prompt) for prompt in prompts]     # every prompt checked before any runs
        if req.use_beam_search:
            return await self._beams(req, raw, jobs[0][0])
        rid = req.response_id("cmpl")      # a batch's prompt i runs as rid-i
        rids = [rid] if len(jobs) == 1 else [f"{rid}-{i}" for i in range(len(jobs))]
        if req.stream:
            groups = []
            try:
                for (ids, _, _), group_id in zip(jobs, rids):
                    groups.append(await SampleGroup(ctx, ids, samples, group_id, arrival, req.priority).start())
            except BaseException:
                for g in groups:     # a later prompt refused: the earlier ones' requests are aborted
                    g.close()
                raise
            streamed = [(g, echo, first) for g, (_, echo, first) in zip(groups, jobs)]
            if echo_only:
                return sse_response(self._echo_only_events(req, raw, rid, streamed, params.n))
            return sse_response(self._events(req, rid, streamed, params.n))
        bodies = await asyncio.gather(*(self._answer(req, raw, job, group_id, params, samples, echo_only, arrival)
                                        for job, group_id in zip(jobs, rids)))
        if any(b is None for b in bodies):
            return Response(status_code=499)     # the client is gone; nobody reads this
        if len(bodies) == 1:
            return JSONBody(bodies[0])
        # OpenAI's batched prompts: prompt i's choices are i * n .. i * n + n - 1; usage summed over the prompts
        choices = [dict(c, index=i * params.n + c["index"]) for i, b in enumerate(bodies) for c in b["choices"]]
        return JSONBody(self._body(rid, choices, usage=_summed([b["usage"] for b in bodies])))

    async def _prepared(self, req: CompletionRequest, prompt: str | list[int]) -> tuple[list[int], str, str | None]:
        """One prompt's ids (truncated, checked against the context: a 400 naming the field), the text echo returns
        and the first token's text its logprobs lead with."""
        ctx = self.ctx
        ids = await ctx.tokenizer.encode(prompt, req.add_special_tokens) if isinstance(prompt, str) else prompt
        kept = truncated(ids, req.truncate_prompt_tokens, ctx)
        cut, ids = len(kept) < len(ids), kept
        check_room(ids, req.max_tokens, "max_tokens", ctx)
        # echo: the prompt as sent (text), or its ids (what is left of them) decoded as /detokenize does
        echo = (prompt if isinstance(prompt, str) and not cut else await ctx.tokenizer.decode(ids)) if req.echo else ""
        # echo with logprobs: the prompt's tokens come first in logprobs (the first has no logprob)
        first_token = await ctx.tokenizer.decode(ids[:1]) if req.echo and req.logprobs is not None else None
        return ids, echo, first_token

    async def _answer(self, req: CompletionRequest, raw: Request, job: tuple, group_id: str, params, samples: list,
                      echo_only: bool, arrival: float) -> dict | None:
        """One prompt's completion body (None: the client went away)."""
        ids, echo, first_token = job
        group = await SampleGroup(self.ctx, ids, samples, group_id, arrival, req.priority).start()
        if echo_only:
            return await self._echo_only_body(req, raw, group, echo, first_token, params.n)
        out = await final_output(raw, group)
        if out is None:
            return None
        chosen = best_of(out, params.n) if len(samples) > params.n else out.outputs
        choices = []
        for c in chosen:
            choice = {"index": c.index, "text": echo + c.text, "logprobs": None,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.logprobs is not None:
                as_ids = req.return_tokens_as_token_ids
                head, offset = _echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, first_token, req.logprobs,
                                              as_ids)
                choice["logprobs"] = _joined(head, _logprobs(c, range(len(c.token_ids)), offset, as_ids)[0])
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, req.prompt_logprobs,
                                                                 out.prompt_token_ids)
            if req.return_token_ids:
                choice.update(prompt_token_ids=list(out.prompt_token_ids), token_ids=list(c.token_ids))
            choices.append(choice)
        return self._body(group.request_id, choices, usage=usage(out))   # usage: every sample run

    async def _echo_only_events(self, req: CompletionRequest, raw: Request, rid: str,
                                jobs: list[tuple[SampleGroup, str, str | None]], n: int) -> AsyncIterator[str]:
        """_echo_only_body streamed: one chunk a choice (prompt i's at indexes i * n ..), each with its prompt's usage
        if continuous usage is asked, then the usage if asked."""
        bodies = []
        try:
            for i, (group, echo, first_token) in enumerate(jobs):
                body = await self._echo_only_body(req, raw, group, echo, first_token, n)
                if body is None:
                    return
                bodies.append(body)
                for choice in body["choices"]:
                    chunk = self._body(rid, [dict(choice, index=i * n + choice["index"])])
                    yield sse(with_usage(chunk, body["usage"]["prompt_tokens"], 0) if req.continuous_usage else chunk)
        except ENGINE_ERRORS as e:
            yield sse_error(e)
            yield SSE_DONE
            return
        finally:
            for group, _, _ in jobs:
                group.close()
        if req.include_usage:
            yield sse(self._body(rid, [], usage=_summed([b["usage"] for b in bodies])))
        yield SSE_DONE

    async def _echo_only_body(self, req: CompletionRequest, raw: Request, group: SampleGroup, echo: str,
                              first_token: str | None, n: int) -> dict | None:
        """max_tokens 0 with echo: each of the n choices is the prompt (its logprobs, when asked, the prompt's),
        finish length; usage counts no completion token (the one sampled is dropped). None: the client is gone."""
        out = await final_output(raw, group)
        if out is None:
            return None     # the client is gone
        lp = None
        if req.logprobs is not None:
            head, offset = _echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, first_token, req.logprobs,
                                          req.return_tokens_as_token_ids)
            lp = _joined(head, _completion_logprobs([], offset)[0])
        choices = [{"index": i, "text": echo, "logprobs": lp, "finish_reason": "length", "stop_reason": None}
                   for i in range(n)]
        if req.return_token_ids:       # nothing generated
            for choice in choices:
                choice.update(prompt_token_ids=list(out.prompt_token_ids), token_ids=[])
        if req.prompt_logprobs is not None:
            for choice in choices:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, req.prompt_logprobs,
                                                                 out.prompt_token_ids)
        use = {**usage(out), "completion_tokens": 0, "total_tokens": len(out.prompt_token_ids)}
        return self._body(group.request_id, choices, usage=use)

    async def _beams(self, req: CompletionRequest, raw: Request, ids: list[int]) -> Response:
        rid = req.response_id("cmpl")
        done = await serve_beam_search(self.ctx, req, raw, ids, req.max_tokens, rid)
        if done is None:
            return Response(status_code=499)     # the client is gone; nobody reads this
        choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": b.finish_reason, "stop_reason": None}
                   for i, (text, b) in enumerate(done[0])]
        return JSONBody(self._body(rid, choices, usage=done[1]))

    def _body(self, rid: str, choices: list, **extra) -> dict:
        return {"id": rid, "object": "text_completion", "created": now(), "model": self.ctx.model_name,
                "choices": choices, **extra}

    async def _events(self, req: CompletionRequest, rid: str, jobs: list[tuple[SampleGroup, str, str | None]],
                      n: int) -> AsyncIterator[str]:
        """The prompts' choices streamed as their samples advance (prompt i's at indexes i * n ..), interleaved
        across prompts under the response's id rid; then the usage summed over every prompt, if asked."""
        finals = []
        try:
            async for item in _merged([self._choices(req, g, echo, first, i * n)
                                       for i, (g, echo, first) in enumerate(jobs)]):
                if isinstance(item, list):      # a prompt's final outputs, one a sample
                    finals.append(item)
                    continue
                choice, prompt_tokens, completion_tokens = item
                chunk = self._body(rid, [choice])
                yield sse(with_usage(chunk, prompt_tokens, completion_tokens) if req.continuous_usage else chunk)
            if req.include_usage and len(finals) == len(jobs):
                use = [usage(merge_samples(rid, outs)) for outs in finals]
                yield sse(self._body(rid, [], usage=_summed(use)))
        except ENGINE_ERRORS as e:
            yield sse_error(e)
        finally:
            for g, _, _ in jobs:
                g.close()
        yield SSE_DONE

    async def _choices(self, req: CompletionRequest, group: SampleGroup, echo: str, first_token: str | None,
                       base: int) -> AsyncIterator[tuple | list]:
        """One prompt's streamed choices, (choice, prompt tokens, its completion tokens so far), its samples' indexes
        counted from base; then, once every sample has finished, the list of their final outputs."""
        k = len(group.samples)
        deltas, offsets, last = [TextDeltas() for _ in range(k)], [0] * k, {}
        new_ids: list[list[int]] = [[] for _ in range(k)]    # return_token_ids: each choice's tokens not yet sent
        unechoed = set(range(k)) if echo else set()   # choices whose first chunk (it carries the prompt) is to come
        started: set[int] = set()                      # choices whose first chunk went out
        scored = None                                  # the prompt's logprobs, once sample 0 has them
        async for i, out in group.outputs():
            last[i], c = out, out.outputs[0]
            text, toks = deltas[i].text(c, out.finished), deltas[i].tokens(c)
            new_ids[i] += c.token_ids[toks.start:toks.stop]
            if not (text or out.finished or (req.logprobs is not None and toks)):
                continue
            lp, head, first = None, None, i not in started
            started.add(i)
            scored = out.prompt_logprobs or scored     # sample 0's, which comes first
            if first and req.logprobs is not None:
                head, offsets[i] = _echo_logprobs(out.prompt_token_ids, scored, first_token, req.logprobs,
                                                  req.return_tokens_as_token_ids)
            if req.logprobs is not None:
                lp, offsets[i] = _logprobs(c, toks, offsets[i], req.return_tokens_as_token_ids)
                lp = _joined(head, lp)
            if i in unechoed:
                text = echo + text
                unechoed.discard(i)
            choice = {"index": base + i, "text": text, "logprobs": lp,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if first and req.prompt_logprobs is not None:   # with the choice's first chunk
                choice["prompt_logprobs"] = prompt_logprobs_json(scored, req.prompt_logprobs, out.prompt_token_ids)
            if req.return_token_ids:    # the prompt's with the choice's first chunk (vLLM puts them in the choice)
                if first:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choice["token_ids"], new_ids[i] = new_ids[i], []
            yield choice, len(out.prompt_token_ids), len(c.token_ids)
        if len(last) == k:
            yield [last[i] for i in range(k)]


async def _merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async iterators as each comes; an exception in one is raised here, and leaving early
    (or an exception) closes them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))    # a slow reader holds the pumps back (SampleGroup)
    done = object()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(done)
        except Exception as e:
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _summed(uses: list[dict]) -> dict:
    """Usage summed over a batch's prompts."""
    out = {k: sum(u[k] for u in uses) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    out["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in uses)}
    return out


def _echo_logprobs(prompt_ids: list[int], scored: list | None, first_token: str | None,
                   k: int, as_ids: bool) -> tuple[dict | None, int]:
    """The echoed prompt's part of logprobs (None without echo), and the text offset after it.
    scored: the prompt's RequestOutput.prompt_logprobs (sample 0 scores it for all samples); k: the request's
    logprobs (-1: every token). as_ids: tokens named "token_id:<id>" (return_tokens_as_token_ids)."""
    if first_token is None:
        return None, 0
    entries = [(token_name(prompt_ids[0], None, as_ids) if as_ids else first_token, first_token, None, None)]
    for tok, d in zip(prompt_ids[1:], (scored or [None] * len(prompt_ids))[1:]):
        if d is None:     # not scored (a sample that is not the first, before the first's output)
            d = {tok: Logprob(None, None, "")}
        top = {token_name(t, lp, as_ids): json_logprob(lp.logprob) for t, lp in d.items()
               if t == tok or (lp.rank is not None and (k == -1 or lp.rank <= k))}
        entries.append((token_name(tok, d[tok], as_ids), d[tok].decoded_token or "", json_logprob(d[tok].logprob), top))
    return _completion_logprobs(entries, 0)


def _joined(head: dict | None, tail: dict) -> dict:
    return tail if head is None else {key: head[key] + tail[key] for key in tail}


def _logprobs(c: CompletionOutput, idx: range, offset: int, as_ids: bool) -> tuple[dict, int]:
    """OpenAI's completions logprobs for output tokens idx: the chosen token and the top ones (named by their
    ids with as_ids: return_tokens_as_token_ids)."""
    entries = []
    for i in idx:
        d, t = c.logprobs[i], c.token_ids[i]
        entries.append((token_name(t, d[t], as_ids), d[t].decoded_token or "", json_logprob(d[t].logprob),
                        {token_name(u, lp, as_ids): json_logprob(lp.logprob) for u, lp in d.items()}))
    return _completion_logprobs(entries, offset)


def _completion_logprobs(entries: list[tuple[str, str, float | None, dict | None]],
                         offset: int) -> tuple[dict, int]:
    """OpenAI's completions logprobs of (token's name, its text, its logprob, the top ones) entries, their
    offsets in the text counted from `offset`; and the offset after them."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for name, text, logprob, top in entries:
        out["tokens"].append(name)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset
