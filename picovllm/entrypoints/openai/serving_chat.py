"""POST /v1/chat/completions: messages through the model's chat template, a reply out, streamed or not."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request, Response

from picovllm.entrypoints.chat_template import reasoning_effort_options, resolved_template
from picovllm.entrypoints.openai.harmony import ContentTokens, HarmonyStream, parse_harmony
from picovllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest
from picovllm.entrypoints.openai.reasoning import ReasoningSplitter, opened_in_prompt, split_reasoning
from picovllm.entrypoints.openai.tool_calls import (SPECIAL_MARKER_PARSERS, TOOLS_SOURCES, AutoToolStream,
                                                   ToolPolicy, template_renders_tools)
from picovllm.entrypoints.openai.serving import (ENGINE_ERRORS, SSE_DONE, JSONBody, SampleGroup, ServingContext,
                                                 TextDeltas, check_room, final_output, now, prompt_logprobs_json, sse,
                                                 sse_error, sse_response, token_name, top_logprobs, truncated, usage,
                                                 with_usage)
from picovllm.entrypoints.openai.serving_beam import serve_beam_search
from picovllm.entrypoints.parallel_sampling import merge_samples, sample_params
from picovllm.outputs import CompletionOutput, RequestOutput, json_logprob


@dataclass
class _ChoiceStream:
    """One choice's state while a chat reply streams (ChatHandler._events): what each of its readers has taken."""
    deltas: TextDeltas = field(default_factory=TextDeltas)   # the text and tokens not yet sent
    split: ReasoningSplitter | None = None    # a reasoning parser's: the think block apart from the content
    auto: AutoToolStream | None = None        # tool_choice auto: the calls out of the content as their blocks close
    harmony: HarmonyStream | None = None      # a harmony reply's messages
    kinds: ContentTokens | None = None        # harmony with message logprobs: which tokens are the content's
    content: str = ""                         # with a split: the content so far (what the tool calls are read from)
    sent: int = 0                             # continuous usage: the tokens so far
    new_ids: list[int] = field(default_factory=list)   # return_token_ids: the tokens not yet sent
    call_id: str | None = None                # named tool_choice: the call's id, once its first delta went out
    last: RequestOutput | None = None         # the latest output


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, req: ChatCompletionRequest, raw: Request, message_logprobs: bool = False) -> Response:
        """message_logprobs (the Responses API's): the logprobs of the reply's content tokens only, not of its
        reasoning, nor, with harmony, of its headers, markers and calls (ContentTokens)."""
        arrival = time.time()
        ctx = self.ctx
        ctx.check_model(req.model)
        ctx.check_special_token_spaces(req.spaces_between_special_tokens)
        k = req.num_logprobs
        if req.stream and req.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not supported with stream=true in chat completions "
                                "(it comes in the response body)", param="prompt_logprobs")
        params = req.sampling_params(req.max_new_tokens, k, ctx.sampling_defaults)
        policy = req.tool_policy()
        # call ids as the model's templates take them back (Mistral's 9 characters, Kimi's functions.NAME:IDX)
        policy.id_style = {"mistral": "mistral", "kimi_k2": "kimi"}.get(ctx.tool_parser, "openai")
        policy.calls_before = sum(len(m.tool_calls or []) for m in req.messages if getattr(m, "tool_calls", None))
        try:
            renders = template_renders_tools(resolved_template(ctx.tokenizer.tokenizer, req.chat_template,
                                                               policy.tools))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        if policy.mode == "auto":     # the model's own call format where its template renders the tools, else Hermes'
            policy.parser = ctx.tool_parser if renders else "hermes"
            if policy.active and policy.parser in SPECIAL_MARKER_PARSERS:
                params.skip_special_tokens = False       # their markers are special tokens
        # tool_choice "none": a template that renders the tools still gets them, as vLLM and transformers render them
        # (not the fallback's system message, which asks for calls)
        tools = policy.tools if policy.active or (renders and policy.tools) else None
        effort, template_kwargs = self._reasoning_effort(req, tools)
        ids = await ctx.tokenizer.encode_chat(ctx.template_messages(req.messages), req.add_generation_prompt,
                                              req.add_special_tokens, tools=tools,
                                              continue_final_message=req.continue_final_message,
                                              chat_template_kwargs=template_kwargs,
                                              documents=req.documents, chat_template=req.chat_template,
                                              reasoning_effort=effort)
        ids = truncated(ids, req.truncate_prompt_tokens, ctx)
        check_room(ids, req.max_new_tokens, "max_tokens" if req.max_completion_tokens is None else
                   "max_completion_tokens", ctx)
        # a reasoning parser splits the think block from the answer (a grammar governs the answer alone: SampleGroup);
        # opened: None without a split, else whether the prompt opens a think block
        opened = None
        if ctx.think_tags is not None:
            opened = opened_in_prompt(ctx.think_tags, ids)
        # GPT-OSS: its reply's harmony messages into reasoning, content and calls, read at the markers the engine
        # keeps for it (harmony.py); a grammar governs the final message's body (SampleGroup), but tool_choice's
        # governs the whole reply (it writes no markers)
        so = params.structured_outputs
        harmony = ctx.harmony is not None and (so is None or so.source not in TOOLS_SOURCES)
        header = None      # with harmony: the header of a message the prompt leaves open (continue_final_message)
        if harmony:
            params.skip_special_tokens = False
            header = ctx.harmony.open_header(ids)
        if req.use_beam_search:
            return await self._beams(req, raw, ids, opened, harmony, header)
        group = await SampleGroup(ctx, ids, sample_params(params), req.response_id("chatcmpl"), arrival,
                                  req.priority, harmony, "messages", "top_logprobs").start()
        if req.stream:
            return sse_response(self._events(req, group, k, policy, opened, harmony, header, message_logprobs))
        out = await final_output(raw, group)
        if out is None:
            return Response(status_code=499)     # the client is gone; nobody reads this
        choices = []
        for c in out.outputs:
            message, finish = (_harmony_message(c, policy, req.include_reasoning, header) if harmony else
                               _message(c, policy, opened, req.include_reasoning))
            if req.echoed:
                message["content"] = req.echoed + (message["content"] or "")
            idx = range(len(c.token_ids))
            if message_logprobs and harmony:
                idx = [j for j, kept in enumerate(ContentTokens(ctx.harmony, header).feed(c.token_ids)) if kept]
            elif message_logprobs and opened is not None:
                idx = idx[await self._reasoning_tokens(c, opened, req.skip_special_tokens):]
            choices.append({"index": c.index, "message": message, "finish_reason": finish, "stop_reason": c.stop_reason,
                            "logprobs": _logprobs(c, idx, k, req.return_tokens_as_token_ids)
                            if k is not None else None})
            if req.return_token_ids:
                choices[-1]["token_ids"] = list(c.token_ids)
        extra = {"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)} if req.prompt_logprobs is not None else {}
        if req.return_token_ids:
            extra["prompt_token_ids"] = list(out.prompt_token_ids)
        use = await self._usage(req, out, opened, harmony, header)
        return JSONBody(self._body(group.request_id, "chat.completion", choices, usage=use, **extra))

    def _reasoning_effort(self, req: ChatCompletionRequest, tools: list | None) -> tuple[str | None, dict | None]:
        """The reasoning_effort and chat_template_kwargs the template is rendered with (reasoning_effort_options:
        vLLM's enable_thinking from the effort); a 400 naming reasoning_effort where the template reads neither."""
        if req.reasoning_effort is None:      # the usual request: nothing to read of the template
            return None, req.chat_template_kwargs
        try:
            template = resolved_template(self.ctx.tokenizer.tokenizer, req.chat_template, tools)
            return reasoning_effort_options(template, req.reasoning_effort, req.chat_template_kwargs)
        except ValueError as e:
            param = "reasoning_effort" if str(e).startswith("reasoning_effort") else "messages"
            raise APIError(400, str(e), param=param) from None

    async def _usage(self, req: ChatCompletionRequest, out: RequestOutput, opened: bool | None,
                     harmony: bool = False, header: str | None = None) -> dict:
        """usage; with a reasoning split also completion_tokens_details.reasoning_tokens (OpenAI's): the output
        tokens up to the reasoning block's end (harmony: its analysis messages' tokens; header: _events'), summed
        over the choices."""
        use = usage(out)
        if harmony:
            counts = [self.ctx.harmony.reasoning_tokens(c.token_ids, header) for c in out.outputs]
            use["completion_tokens_details"] = {"reasoning_tokens": sum(counts)}
        elif opened is not None:
            counts = [await self._reasoning_tokens(c, opened, req.skip_special_tokens) for c in out.outputs]
            use["completion_tokens_details"] = {"reasoning_tokens": sum(counts)}
        return use

    async def _reasoning_tokens(self, c: CompletionOutput, opened: bool, skip_special_tokens: bool) -> int:
        """The shortest run of c's tokens whose text reaches the end of its reasoning block (its </think>, or all of
        it where the block never closed; 0 without one): found by bisection over decoded prefixes."""
        thought, content = split_reasoning(c.text, opened)
        if thought is None:
            return 0
        if content is None:
            return len(c.token_ids)
        end, lo, hi = len(c.text) - len(content), 0, len(c.token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(await self.ctx.tokenizer.decode(c.token_ids[:mid], skip_special_tokens)) >= end:
                hi = mid
            else:
                lo = mid + 1
        return lo

    async def _beams(self, req: ChatCompletionRequest, raw: Request, ids: list[int], opened: bool | None,
                     harmony: bool, header: str | None) -> Response:
        """The beams as any reply's message: a reasoning split (opened, harmony, header: as for sampling) applies
        to each, and the usage counts its reasoning tokens. (Beam search takes no tools: beam_search_params.)"""
        rid = req.response_id("chatcmpl")
        done = await serve_beam_search(self.ctx, req, raw, ids, req.max_new_tokens, rid,
                                       skip_special_tokens=False if harmony else None)
        if done is None:
            return Response(status_code=499)     # the client is gone; nobody reads this
        beams, use = done
        outs = [CompletionOutput(i, text, b.output_token_ids, b.cum_logprob, None, b.finish_reason)
                for i, (text, b) in enumerate(beams)]
        policy, choices = req.tool_policy(), []      # no tools (beam_search_params refused them)
        for c in outs:
            message, finish = (_harmony_message(c, policy, req.include_reasoning, header) if harmony else
                               _message(c, policy, opened, req.include_reasoning))
            choices.append({"index": c.index, "message": message, "logprobs": None, "finish_reason": finish,
                            "stop_reason": None})
        if harmony or opened is not None:
            use["completion_tokens_details"] = {"reasoning_tokens": sum(
                [self.ctx.harmony.reasoning_tokens(c.token_ids, header) if harmony else
                 await self._reasoning_tokens(c, opened, req.skip_special_tokens) for c in outs])}
        return JSONBody(self._body(rid, "chat.completion", choices, usage=use))

    def _body(self, rid: str, obj: str, choices: list, **extra) -> dict:
        return {"id": rid, "object": obj, "created": now(), "model": self.ctx.model_name, "choices": choices, **extra}

    def _chunk(self, rid: str, index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return self._body(rid, "chat.completion.chunk", [choice])

    async def _events(self, req: ChatCompletionRequest, group: SampleGroup, k: int | None, policy: ToolPolicy,
                      opened: bool | None, harmony: bool, header: str | None = None,
                      message_logprobs: bool = False) -> AsyncIterator[str]:
        """opened: None without a reasoning split, else whether the prompt opens a think block; harmony: the reply
        read as harmony messages (harmony.py; header: the message the prompt leaves open, if any);
        message_logprobs: as __call__'s (a think block's go on its reasoning chunks anyway)."""
        rid, n = group.request_id, len(group.samples)
        content_kinds = harmony and message_logprobs     # which tokens are the content's, for their logprobs
        choices = [_ChoiceStream(split=None if opened is None else ReasoningSplitter(opened),
                                 auto=AutoToolStream(policy) if policy.mode == "auto" else None,
                                 harmony=HarmonyStream(policy, header) if harmony else None,
                                 kinds=ContentTokens(self.ctx.harmony, header) if content_kinds else None)
                   for _ in range(n)]
        prompt_ids_due = req.return_token_ids                # the prompt's ids still to go, on the first chunk

        def emit(chunks: list[dict], i: int) -> str:
            nonlocal prompt_ids_due
            ch = choices[i]
            if req.continuous_usage:
                chunks = [with_usage(chunk, len(group.ids), ch.sent) for chunk in chunks]
            if req.return_token_ids:
                if ch.new_ids:
                    chunks[-1]["choices"][0]["token_ids"], ch.new_ids = ch.new_ids, []
                if prompt_ids_due:
                    chunks[0] = {**chunks[0], "prompt_token_ids": list(group.ids)}
                    prompt_ids_due = False
            return "".join(sse(chunk) for chunk in chunks)

        try:
            for i in range(n):
                yield emit([self._chunk(rid, i, {"role": "assistant", "content": ""})], i)
                if req.echoed:
                    yield emit([self._chunk(rid, i, {"content": req.echoed})], i)
            async for i, out in group.outputs():
                ch, c = choices[i], out.outputs[0]
                ch.last = out
                text, toks = ch.deltas.text(c, out.finished), ch.deltas.tokens(c)
                ch.sent = len(c.token_ids)
                ch.new_ids += c.token_ids[toks.start:toks.stop]
                thought, ended = "", False
                if ch.split is not None:
                    before = ch.split.state
                    thought, text = ch.split.feed(text, out.finished)
                    ended = before != "content" and ch.split.state == "content" and ch.split.reasoned
                    ch.content += text
                    thought = thought if req.include_reasoning else ""
                if not (text or thought or out.finished or (k is not None and toks)):
                    continue
                lps = _logprobs(c, toks, k, req.return_tokens_as_token_ids) if k is not None else None
                if ch.harmony is not None:
                    if ch.kinds is not None and lps is not None:
                        keep = ch.kinds.feed(c.token_ids[toks.start:toks.stop])
                        lps = {"content": [e for e, kept in zip(lps["content"], keep) if kept]}
                    chunks = self._harmony_chunks(rid, i, text, c, lps, ch.harmony, req.include_reasoning)
                    if chunks:
                        yield emit(chunks, i)
                    continue
                # the reasoning's tokens' logprobs go with it, the content's with the content; where the block ended
                # in this step's tokens, they are cut where its text ends (its </think> the reasoning's)
                cut = len(toks) if thought else 0
                if ended and lps is not None:
                    cut = min(max(await self._reasoning_tokens(c, opened, req.skip_special_tokens) - toks.start, 0),
                              len(toks))
                head = []
                if thought or cut:
                    mine = None if lps is None else {"content": lps["content"][:cut]}
                    head = [self._chunk(rid, i, _reasoning_delta(thought) if thought else {}, mine)]
                    lps = None if lps is None or cut == len(toks) else {"content": lps["content"][cut:]}
                if policy.mode == "named":   # the output is the call's arguments: streamed as they come
                    chunks = self._named_call_chunks(rid, i, text, c, lps, policy, ch)
                elif ch.auto is not None:   # content as it comes, each call once its block closes
                    chunks = self._auto_chunks(rid, i, c, lps, ch.auto, c.text if ch.split is None else ch.content)
                elif policy.active:   # required: the calls are known once the output is
                    chunks = self._tool_chunks(rid, i, c, lps, policy, opened)
                elif text or not thought or c.finish_reason is not None:
                    chunks = [self._chunk(rid, i, {"content": text} if text else {}, lps, c.finish_reason,
                                          c.stop_reason)]
                else:
                    chunks = []
                chunks = head + chunks
                if chunks:
                    yield emit(chunks, i)
            if req.include_usage and all(ch.last is not None for ch in choices):
                use = await self._usage(req, merge_samples(rid, [ch.last for ch in choices]), opened, harmony, header)
                yield sse(self._body(rid, "chat.completion.chunk", [], usage=use))
        except ENGINE_ERRORS as e:
            yield sse_error(e)
        finally:
            group.close()
        yield SSE_DONE


    def _harmony_chunks(self, rid: str, i: int, text: str, c: CompletionOutput, lps: dict | None,
                        stream: HarmonyStream, include_reasoning: bool) -> list[dict]:
        """A harmony reply (GPT-OSS): its reasoning and content as they come, each call whole once its message ends
        (OpenAI's delta: index, id, type, name and arguments), then the finish reason (tool_calls if any came)."""
        finished = c.finish_reason is not None
        d = stream.feed(text, finished, cut=finished and c.finish_reason != "stop")
        out = []
        index = stream.num_calls - len(d.calls)      # the calls' indices run on over the whole choice
        for kind, what in d.parts:       # in the order the reply wrote them (a piece may close one message, open more)
            if kind == "reasoning" and include_reasoning:
                out.append(self._chunk(rid, i, _reasoning_delta(what)))
            elif kind == "content":
                out.append(self._chunk(rid, i, {"content": what}))
            elif kind == "call":
                out.append(self._chunk(rid, i, {"tool_calls": [{"index": index, **what.as_dict()}]}))
                index += 1
        if lps is not None:       # the step's logprobs ride on its content chunk, else its first (or one of their own)
            at = next((ch for ch in out if ch["choices"][0]["delta"].get("content")), out[0] if out else None)
            if at is not None:
                at["choices"][0]["logprobs"] = lps
            else:
                out.append(self._chunk(rid, i, {}, lps))
        if finished:      # calls stream only under "auto" (HarmonyStream)
            out.append(self._chunk(rid, i, {}, None, "tool_calls" if stream.num_calls else c.finish_reason,
                                   c.stop_reason))
        return out

    def _named_call_chunks(self, rid: str, i: int, text: str, c: CompletionOutput, lps: dict | None,
                           policy: ToolPolicy, choice: _ChoiceStream) -> list[dict]:
        """A named tool_choice: the first delta with text (after a reasoning block, if any) opens the call (index,
        id, type, name), the next ones add to its arguments; the finish reason is the output's own (stop, or length
        when max_tokens cut the arguments short), as OpenAI's for a named function (ToolPolicy.finish_reason)."""
        out = []
        if choice.call_id is None and text:
            choice.call_id = policy.new_call(policy.named, "").id
            opened = {"index": 0, "id": choice.call_id, "type": "function",
                      "function": {"name": policy.named, "arguments": ""}}
            out.append(self._chunk(rid, i, {"tool_calls": [opened]}))
        if text or lps is not None:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
            out.append(self._chunk(rid, i, delta, lps))
        if c.finish_reason is not None:
            out.append(self._chunk(rid, i, {}, None, c.finish_reason, c.stop_reason))
        return out

    def _auto_chunks(self, rid: str, i: int, c: CompletionOutput, lps: dict | None,
                     stream: AutoToolStream, so_far: str) -> list[dict]:
        """tool_choice auto: the content so far (so_far: the output's text, or its content after the reasoning),
        then each call whose block closed, whole (OpenAI's delta: index, id, type, name and arguments); at the end
        the finish reason (tool_calls if any call came)."""
        finished = c.finish_reason is not None
        text, calls = stream.feed(so_far, finished)
        out = [self._chunk(rid, i, {"content": text} if text else {}, lps)] if text or lps is not None else []
        first = stream.num_calls - len(calls)      # the calls' indices run on over the whole choice
        for j, call in enumerate(calls):
            out.append(self._chunk(rid, i, {"tool_calls": [{"index": first + j, **call.as_dict()}]}))
        if finished:
            out.append(self._chunk(rid, i, {}, None, stream.policy.finish_reason(stream.num_calls > 0,
                                                                                 c.finish_reason), c.stop_reason))
        return out

    def _tool_chunks(self, rid: str, i: int, c: CompletionOutput, lps: dict | None,
                     policy: ToolPolicy, opened: bool | None) -> list[dict]:
        """tool_choice required: logprobs as they come; at the end the content (after the reasoning, which went
        out as it came), then each call whole (as OpenAI's deltas: index, id, type and name, and the arguments),
        then the finish reason."""
        if c.finish_reason is None:
            return [self._chunk(rid, i, {}, lps)] if lps is not None else []
        message, finish = _message(c, policy, opened)
        head = {"content": message["content"]} if message["content"] else {}
        out = [self._chunk(rid, i, head, lps)] if head or lps is not None else []
        for j, call in enumerate(message.get("tool_calls", [])):
            out.append(self._chunk(rid, i, {"tool_calls": [{"index": j, **call}]}))
        return out + [self._chunk(rid, i, {}, None, finish, c.stop_reason)]


def _message(c: CompletionOutput, policy: ToolPolicy, opened: bool | None = None,
             include_reasoning: bool = True) -> tuple[dict, str | None]:
    """The assistant message of a finished output and its finish reason (ToolPolicy.finish_reason). opened: as
    in _events (with a split, the message has reasoning, null where there was none or include_reasoning is false,
    and calls are read from the content after it)."""
    head, text = {"role": "assistant"}, c.text
    if opened is not None:
        thought, text = split_reasoning(c.text, opened)
        head.update(_reasoning_delta(thought if include_reasoning else None))
    content, calls = policy.parse(text) if policy.active and text is not None else (text, [])
    if not calls:
        return {**head, "content": content}, c.finish_reason
    return ({**head, "content": content, "tool_calls": [x.as_dict() for x in calls]},
            policy.finish_reason(True, c.finish_reason))


def _harmony_message(c: CompletionOutput, policy: ToolPolicy, include_reasoning: bool,
                     header: str | None = None) -> tuple[dict, str | None]:
    """A finished harmony reply's assistant message (reasoning, content, calls) and its finish reason."""
    thought, content, calls = parse_harmony(c.text, policy, c.finish_reason != "stop", header)
    message = {"role": "assistant", **_reasoning_delta(thought if include_reasoning else None), "content": content}
    if not calls:
        return message, c.finish_reason
    return {**message, "tool_calls": [x.as_dict() for x in calls]}, policy.finish_reason(True, c.finish_reason)


def _reasoning_delta(thought: str | None) -> dict:
    """vLLM's two names of the reasoning text: `reasoning` (now) and `reasoning_content` (first, still read)."""
    return {"reasoning": thought, "reasoning_content": thought}


def _logprobs(c: CompletionOutput, idx: range, k: int, as_ids: bool) -> dict:
    """OpenAI's chat logprobs for output tokens idx: each chosen token and the k most likely ones (named by
    their ids with as_ids: return_tokens_as_token_ids)."""
    def entry(t: int, lp) -> dict:
        s = token_name(t, lp, as_ids)
        return {"token": s, "logprob": json_logprob(lp.logprob), "bytes": list(s.encode("utf-8"))}

    content = []
    for i in idx:
        d, t = c.logprobs[i], c.token_ids[i]
        content.append({**entry(t, d[t]), "top_logprobs": [entry(*item) for item in top_logprobs(d, k)]})
    return {"content": content}
