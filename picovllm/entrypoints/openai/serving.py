"""What the completion and chat handlers share: admission, streaming deltas, usage, SSE, disconnects."""
from __future__ import annotations

import asyncio
import functools
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from picovllm.entrypoints.chat_template import resolved_template
from picovllm.entrypoints.openai.engine_client import (EngineClient, EngineDeadError, EngineStepError, RequestStream,
                                                      checked)
from picovllm.entrypoints.openai.harmony import HarmonyTokens, harmony_template_messages, speaks_harmony
from picovllm.entrypoints.openai.metrics import ServerMetrics
from picovllm.entrypoints.openai.protocol import APIError, error_body
from picovllm.entrypoints.openai.request_log import RequestLogger
from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from picovllm.entrypoints.openai.tool_calls import TOOLS_SOURCES, detect_tool_parser
from picovllm.entrypoints.parallel_sampling import merge_samples
from picovllm.outputs import CompletionOutput, Logprob, RequestOutput, json_logprob
from picovllm.reasoning import HARMONY_PARSER, ThinkTags
from picovllm.pooling_params import PoolingParams
from picovllm.sampling_params import SamplingParams

ENGINE_ERRORS = (EngineStepError, EngineDeadError)


class JSONBody(JSONResponse):
    """ASCII-escaped JSON, as the SSE events: a lone surrogate a client sent can never make encoding fail."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


@dataclass
class ServingContext:
    engine: EngineClient
    tokenizer: TokenizerWorker
    metrics: ServerMetrics
    model_name: str
    # the model's generation config: sampling defaults for fields a request leaves unset (generation_config.py)
    sampling_defaults: dict = field(default_factory=dict)
    # chat: <think> ... </think> apart from the answer (reasoning.py); and every request's structured output governs
    # the answer after the block (SampleGroup sets the constraint's reasoning_parser: any engine behind it holds the
    # grammar back until then)
    reasoning_parser: str | None = None
    # tool_choice "auto": the calls' format (tool_calls.TOOL_PARSERS), or "auto": the one the model speaks
    tool_call_parser: str = "auto"
    # the other ids clients may send for this model (vLLM's --served-model-name takes several; replies name the first)
    model_aliases: tuple[str, ...] = ()
    request_logger: RequestLogger | None = None      # --enable-log-requests: a line for each request added

    @functools.cached_property
    def tool_parser(self) -> str:
        """The calls' format of this server's model (tool_calls.detect_tool_parser, unless --tool-call-parser)."""
        if self.tool_call_parser != "auto":
            return self.tool_call_parser
        tok = self.tokenizer.tokenizer
        try:       # the template that renders tools: a tokenizer with named ones, its "tool_use"
            template = resolved_template(tok, None, tools=[{}])
        except ValueError:
            template = None
        return detect_tool_parser(tok, template)

    @functools.cached_property
    def think_tags(self) -> ThinkTags | None:
        """With a think-block reasoning parser: the tokenizer's think tags (the servers checked at start that it has
        them); None without one, or with openai_gptoss (harmony.py reads GPT-OSS's reasoning, parser or not)."""
        if self.reasoning_parser in (None, HARMONY_PARSER):
            return None
        return ThinkTags.of(self.tokenizer.tokenizer, f"--reasoning-parser {self.reasoning_parser}")

    def grammar_parser(self, tools_constraint: bool, harmony_reply: bool) -> str | None:
        """The reasoning parser a request's grammar waits on (StructuredOutputsParams.reasoning_parser). A harmony
        model's: a chat reply read as harmony (harmony_reply) without the flag too (the grammar governs the final
        message's body, the reply stays harmony), a completion with --reasoning-parser openai_gptoss (vLLM's), never
        tool_choice's constraint (it governs the whole reply: tool_calls.py); else --reasoning-parser's."""
        if self.harmony is not None:
            if tools_constraint:
                return None
            return HARMONY_PARSER if harmony_reply else self.reasoning_parser
        return self.reasoning_parser

    @functools.cached_property
    def harmony(self) -> HarmonyTokens | None:
        """GPT-OSS's tokenizer (harmony's markers): its chat replies are read as harmony (harmony.py), else None."""
        tok = self.tokenizer.tokenizer
        return HarmonyTokens(tok) if speaks_harmony(tok) else None

    def template_messages(self, messages: list) -> list[dict]:
        """A request's messages as the chat template takes them (with harmony, as GPT-OSS's template takes them:
        harmony_template_messages)."""
        dicts = [m.as_template_dict() for m in messages]
        return harmony_template_messages(dicts) if self.harmony is not None else dicts

    def check_model(self, model: str | None) -> None:
        """A model this server does not serve: OpenAI's and vLLM's 404 model_not_found; none or "" is this one."""
        if model and model != self.model_name and model not in self.model_aliases:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_special_token_spaces(self, spaces: bool) -> None:
        """spaces_between_special_tokens: false is honoured with a fast tokenizer (HF's, ours: the detokenizer joins
        two added tokens in a row without the space a word-joining decoder puts between them); a slow one's decode
        would take the spaces around every added token away (vLLM's slow path), which the detokenizer does not do:
        refused."""
        tok = self.tokenizer.tokenizer
        if not spaces and tok is not None and not getattr(tok, "is_fast", True):
            raise APIError(400, "spaces_between_special_tokens: false is not supported with this model's (slow) "
                                "tokenizer", param="spaces_between_special_tokens")

    async def add(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams, request_id: str,
                  arrival_time: float, priority: int = 0, prompt_param: str | None = None,
                  logprobs_param: str = "logprobs") -> RequestStream:
        """The engine's refusal as a 400 naming the request's field: a structured output's source, priority, a
        SamplingParams (PoolingParams) field the engine checks against the model (SamplingParams.logprobs: the
        request's logprobs_param, chat's top_logprobs), or (prompt_param) the prompt."""
        if self.request_logger is not None:
            self.request_logger.log(request_id, prompt_token_ids, params)
        try:
            return await self.engine.add_request(prompt_token_ids, params, request_id, arrival_time, priority)
        except ValueError as e:
            so = getattr(params, "structured_outputs", None)   # a bad schema, regex or grammar: the request's field
            param = so.source if so is not None and so.source and str(e).startswith(so.source) else None
            if str(e).startswith("priority"):
                param = "priority"
            elif str(e).startswith("prompt"):
                param = param or prompt_param
            message = str(e)
            named = re.match(rf"{type(params).__name__}\.(\w+)", message)    # checked against the model
            if param is None and named and named.group(1) in type(params).__dataclass_fields__:
                param = named.group(1)
                if param == "logprobs" and logprobs_param != param:
                    param, message = logprobs_param, f"{logprobs_param}: {message}"
            raise APIError(400, message, param=param) from None
        except ENGINE_ERRORS as e:
            raise APIError(503, str(e), type="service_unavailable") from None


def truncated(ids: list[int], keep: int | None, ctx: ServingContext) -> list[int]:
    """A generation request's prompt after its truncate_prompt_tokens: its last `keep` ids (-1: as many as the model
    takes, max_model_len - 1: one position left to generate); a 400 naming the field for 0."""
    if keep is None:
        return ids
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens must be >= 1, or -1 (as many as the model takes)",
                       param="truncate_prompt_tokens")
    limit = ctx.engine.model_info()["max_model_len"]
    if limit is None:                   # a router that knows no prefill instance yet: the one it reaches checks
        return ids if keep == -1 else ids[-keep:]
    if keep > limit:                    # as vLLM's
        raise APIError(400, f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({limit})",
                       param="truncate_prompt_tokens")
    return ids[-(limit - 1 if keep == -1 else keep):]


def check_room(ids: list[int], requested: int | None, field: str, ctx: ServingContext) -> None:
    """A 400 naming `field` (vLLM's) when the prompt leaves less room than the request's max_tokens asks for; the
    engine itself caps it at the room left (the offline API's, as vLLM's). A prompt that leaves no room at all gets
    the engine's own refusal of the prompt; none while the limit is unknown (a router that knows no prefill
    instance yet: the one it reaches checks)."""
    limit = ctx.engine.model_info()["max_model_len"]
    if requested is not None and limit is not None and len(ids) < limit < len(ids) + requested:
        raise APIError(400, f"'{field}' is too large: {requested}. This model's maximum context length is {limit} "
                            f"tokens and your request has {len(ids)} input tokens ({requested} > {limit} - {len(ids)})",
                       param=field)


def engine_request_id(request_id: str) -> str:
    """The engine's id of a request the client calls request_id: that id and a random tag. Clients choose their ids
    (request_id, X-Request-Id), so two may send the same, or send one again the moment they hang up, while the
    engine still holds the first; and an n>1 request's samples, `{id}-{i}`, must not meet another client's id."""
    return f"{request_id}-{secrets.token_hex(4)}"


class SampleGroup:
    """The samples of one prompt (n, best_of) as one request: the first is added at once, its siblings when
    its first output shows the prompt computed (they take its KV blocks from the prefix cache)."""

    def __init__(self, ctx: ServingContext, ids: list[int], samples: list[SamplingParams], request_id: str,
                 arrival_time: float, priority: int = 0, harmony: bool = False, prompt_param: str = "prompt",
                 logprobs_param: str = "logprobs") -> None:
        """harmony: a chat reply read as harmony (ServingContext.grammar_parser); prompt_param: the request's field
        the prompt came from, which a refusal of the prompt names ("messages" for chat); logprobs_param: the one
        SamplingParams.logprobs came from ("top_logprobs" for chat)."""
        self.ctx, self.ids, self.samples, self.request_id, self.arrival = ctx, ids, samples, request_id, arrival_time
        self._engine_id = engine_request_id(request_id)     # the engine's (its samples': `-{i}` after it)
        self.priority, self.prompt_param, self.logprobs_param = priority, prompt_param, logprobs_param
        for s in samples:     # the request's own params: a grammar waits for the end of the reasoning
            so = s.structured_outputs
            if so is not None:
                so.reasoning_parser = ctx.grammar_parser(so.source in TOOLS_SOURCES, harmony)
        self.streams: list[RequestStream] = []

    def _id(self, i: int) -> str:
        return self._engine_id if len(self.samples) == 1 else f"{self._engine_id}-{i}"

    async def start(self) -> "SampleGroup":
        """Add the first sample (raises APIError: 400 naming the field, 503 if the engine is gone)."""
        self.streams.append(await self.ctx.add(self.ids, self.samples[0], self._id(0), self.arrival, self.priority,
                                               self.prompt_param, self.logprobs_param))
        return self

    async def _add_siblings(self) -> None:
        for i in range(1, len(self.samples)):
            try:
                self.streams.append(await self.ctx.engine.add_request(self.ids, self.samples[i], self._id(i),
                                                                      self.arrival, self.priority))
            except ValueError as e:   # the first sample passed the same checks: only a race gets here
                raise EngineStepError(f"sample {i}: {e}") from None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(sample index, its latest output) as any sample advances, until every one has finished. As a
        RequestStream, a slow reader skips to each sample's newest (cumulative) output."""
        if len(self.samples) == 1:
            async for out in self.streams[0].outputs():
                yield 0, checked(out)
            return
        # bounded: a reader that falls behind holds the pumps back, and each sample's stream keeps only its newest
        # output (RequestStream.put), where an unbounded queue kept one a step
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(self.samples))
        tasks = [asyncio.ensure_future(_pump(0, self.streams[0], queue))]
        running = 1
        try:
            while running:
                latest: dict[int, RequestOutput] = {}
                for i, item in await _drain(queue):
                    if isinstance(item, Exception):
                        raise item
                    if item is None:
                        running -= 1
                    else:
                        latest[i] = item
                if latest and len(tasks) == 1 and _aborted(latest[0]):
                    # aborted before its first token (the server shutting down): the siblings, never started,
                    # end the same way rather than starting after the abort
                    for j in range(1, len(self.samples)):
                        latest[j] = _aborted_like(latest[0], self._id(j))
                elif latest and len(tasks) == 1:    # the first sample's first output: the prompt is computed
                    await self._add_siblings()
                    tasks += [asyncio.ensure_future(_pump(j, s, queue)) for j, s in enumerate(self.streams[1:], 1)]
                    running += len(self.samples) - 1
                for i, out in latest.items():
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()
            self.close()

    async def finals(self) -> list[RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async for i, out in self.outputs():
            last[i] = out
        return [last[i] for i in range(len(self.samples))]

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


def _aborted(out: RequestOutput) -> bool:
    return out.finished and out.outputs[0].finish_reason == "abort"


def _aborted_like(out: RequestOutput, request_id: str) -> RequestOutput:
    """A sample never started, ended as the aborted `out` (its prompt, no tokens)."""
    c = out.outputs[0]
    empty = CompletionOutput(c.index, "", [], None if c.cumulative_logprob is None else 0.0,
                             None if c.logprobs is None else [], "abort")
    return RequestOutput(request_id, out.prompt, out.prompt_token_ids, [empty], True, out.metrics, out.error,
                         out.num_cached_tokens, out.prompt_logprobs)


async def _pump(i: int, stream: RequestStream, queue: asyncio.Queue) -> None:
    """Sample i's outputs into the group's queue, then None (or the exception, which the reader raises)."""
    try:
        async for out in stream.outputs():
            await queue.put((i, checked(out)))
    except Exception as e:
        await queue.put((i, e))
        return
    await queue.put((i, None))


async def _drain(queue: asyncio.Queue) -> list:
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


class TextDeltas:
    """Turns cumulative outputs into deltas. An engine's cumulative text never takes back what an output showed
    (Engine.make_output holds back the tail a stop string could still cut), so the streamed pieces always add up
    to the final text."""

    def __init__(self) -> None:
        self.sent_chars = 0
        self.sent_tokens = 0

    def text(self, c: CompletionOutput, finished: bool) -> str:
        end = max(self.sent_chars, len(c.text))
        delta, self.sent_chars = c.text[self.sent_chars:end], end
        return delta

    def tokens(self, c: CompletionOutput) -> range:
        new, self.sent_tokens = range(self.sent_tokens, len(c.token_ids)), len(c.token_ids)
        return new


def usage(out: RequestOutput) -> dict:
    """The prompt counts once, every sample's tokens count (OpenAI's way for n > 1)."""
    p, c = len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def prompt_logprobs_json(steps: list[dict[int, Logprob] | None] | None, k: int | None = None,
                         prompt_ids: list[int] | None = None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token, None (the first) or {token id: logprob, rank, decoded_token}.
    k (with the prompt's ids): the prompt token and the top k only, where the prompt was scored with more (a
    completion's echo with a larger logprobs: CompletionRequest.prompt_logprob_count)."""
    if steps is None:
        return None
    return [None if d is None else {str(t): {"logprob": json_logprob(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in d.items()
                                    if k is None or k == -1 or t == prompt_ids[pos]
                                    or (lp.rank is not None and lp.rank <= k)}
            for pos, d in enumerate(steps)]


def top_logprobs(d: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k best (token id, Logprob) of a step, best first (k -1: every token, the step's whole vocabulary)."""
    k = len(d) if k == -1 else k
    ranked = ((t, lp) for t, lp in d.items() if lp.rank is not None and lp.rank <= k)
    return sorted(ranked, key=lambda item: item[1].rank)[:k]


def token_name(token_id: int, lp: Logprob | None, as_id: bool) -> str:
    """How logprobs name a token: its text, or vLLM's "token_id:<id>" (return_tokens_as_token_ids), which
    tells apart tokens that decode to the same text or to no whole UTF-8 character."""
    return f"token_id:{token_id}" if as_id else ((lp.decoded_token if lp is not None else None) or "")


def with_usage(chunk: dict, prompt_tokens: int, completion_tokens: int) -> dict:
    """A streamed chunk with vLLM's continuous usage (stream_options.continuous_usage_stats): its choice's so far."""
    return {**chunk, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                               "total_tokens": prompt_tokens + completion_tokens}}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse_error(e: Exception) -> str:
    return sse(error_body(str(e), "internal_error"))


async def until_disconnected(raw: Request, work: Awaitable) -> asyncio.Task | None:
    """Run work until it ends or the client disconnects, whichever comes first: its task, done; None if the client
    went first (work is cancelled, as it is if the caller is)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task if task.done() and not task.cancelled() else None


async def final_output(raw: Request, group: SampleGroup) -> RequestOutput | None:
    """Wait for the samples' last outputs, merged into one (outputs[i] is sample i); None if the client
    disconnected first (the samples are aborted)."""
    try:
        task = await until_disconnected(raw, group.finals())
    finally:
        group.close()
    if task is None:
        return None
    try:
        return merge_samples(group.request_id, task.result())
    except ENGINE_ERRORS as e:
        raise APIError(500, str(e), type="internal_error") from None


async def disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def now() -> int:
    return int(time.time())
