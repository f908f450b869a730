"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat pipeline.

A request becomes a chat completion request (instructions -> a system message, input items -> messages, function
tools -> chat tools, text.format -> response_format, max_output_tokens -> max_completion_tokens), the chat handler
runs it (templates, structured outputs, tool calls, sampling defaults, metrics: all as for chat), and its answer
comes back as a response object; streamed, its chunks become the Responses events (response.created,
response.output_text.delta, response.function_call_arguments.delta, ..., response.completed). Nothing is stored:
`store: true`, `previous_response_id`, `conversation` and `background: true` are refused by name, as are non-text
input parts, tools other than functions and any `include` but the output's logprobs (`top_logprobs` with
`include: ["message.output_text.logprobs"]`). vLLM's extra sampling fields (top_k, seed, structured_outputs, ...) pass
through to the chat request; vLLM's request_id is the response's id.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, ValidationError, ValidationInfo, create_model, field_validator

from picovllm.entrypoints.openai.protocol import (MAX_INT, APIError, ChatCompletionRequest, FiniteFloat, _Strict,
                                                  refusing_model, unicode_text)
from picovllm.entrypoints.openai.serving import JSONBody, ServingContext, sse_response, until_disconnected
from picovllm.entrypoints.openai.serving_chat import ChatHandler

# What a stateless server cannot do, and the values that ask for nothing (None always does).
REFUSED_RESPONSES: dict[str, tuple] = {
    "previous_response_id": (), "conversation": (), "background": (False,), "store": (False,),
    "prompt": (), "truncation": ("disabled",), "stream_options": (),
    # vLLM's: multimodal processing and media loading, custom extensions' arguments, its own P/D connector's
    # parameters, the response's messages (harmony's), an earlier turn's harmony messages or whole response
    # (stateless multi-turn of GPT-OSS's)
    "mm_processor_kwargs": (), "media_io_kwargs": (), "vllm_xargs": (), "kv_transfer_params": (),
    "enable_response_messages": (False,), "previous_input_messages": (), "previous_response": (),
}
LOGPROBS = "message.output_text.logprobs"     # the one `include` this server honours
# vLLM's sampling fields beyond OpenAI's, handed to the chat request as they are (validated there, by these names)
PASSTHROUGH = ("top_k", "min_p", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
               "stop", "stop_token_ids", "ignore_eos", "logit_bias", "priority", "chat_template_kwargs", "cache_salt",
               "structured_outputs", "skip_special_tokens", "include_stop_str_in_output", "request_id")


_Passthrough = create_model("_Passthrough", __base__=_Strict, **{f: (Any, None) for f in PASSTHROUGH})


class ResponsesRequest(refusing_model("_RefusedResponses", REFUSED_RESPONSES), _Passthrough):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    temperature: FiniteFloat | None = Field(None, ge=0, le=2)
    top_p: FiniteFloat | None = Field(None, gt=0, le=1)
    stream: bool = False
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)     # OpenAI's 0-20; chat's top_logprobs: --max-logprobs too
    reasoning: dict[str, Any] | None = None    # {"effort": ...}: chat's reasoning_effort; a summary is refused
    # Accepted and ignored, as vLLM does: service_tier, prompt_cache_key (vLLM: "not implemented yet and vLLM will
    # ignore it"), safety_identifier, text.verbosity; max_tool_calls caps built-in tools' calls, and this server has
    # none (a tool that is not a function is refused).

    @field_validator("instructions", "tools", mode="before")
    @classmethod
    def _unicode_template_text(cls, v: Any, info: ValidationInfo) -> Any:
        """Rendered beside the input: text that is not Unicode is named here, not as the input."""
        return unicode_text(v, info.field_name)

    def response_id(self) -> str:
        """vLLM's: the request's request_id (checked by the chat request it becomes), else a random one."""
        return self.request_id or f"resp_{uuid.uuid4().hex}"


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _text_of(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    """A message's content: a string, or text parts (input_text; an assistant's output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{param}: must be a string or a list of parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{j}]: only {' or '.join(kinds)} parts with a text are supported, got {kind!r}",
                       f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """instructions and input as chat messages; function_call items go with the assistant message right before
    them, or make one, as one chat reply's content and calls (the items a reply of this server gives: a message, then
    its calls); a reasoning item's text goes with the assistant message after it (its `reasoning`: GPT-OSS's template
    renders it before a call; others leave it out), a summary-only one is dropped."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    thought = None          # a reasoning item's text, for the next assistant message
    for i, item in enumerate(req.input):
        at = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{at}.role: must be user, system, developer or assistant, got {role!r}", f"{at}.role")
            kinds = ("output_text", "input_text") if role == "assistant" else ("input_text",)
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{at}.content", kinds)})
            if role == "assistant" and thought is not None:
                messages[-1]["reasoning"], thought = thought, None
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", at), "type": "function",
                    "function": {"name": _string(item, "name", at), "arguments": _string(item, "arguments", at)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thought is not None:
                    messages[-1]["reasoning"], thought = thought, None
        elif kind == "function_call_output":
            output = item.get("output")
            output = _text_of(output, f"{at}.output", ("input_text",)) if isinstance(output, list) else output
            if not isinstance(output, str):
                raise _bad(f"{at}.output: must be a string", f"{at}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", at), "content": output})
        elif kind == "reasoning":     # an earlier turn's, sent back as the SDK does
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise _bad(f"{at}.content: must be a list of reasoning_text parts", f"{at}.content")
            for j, p in enumerate(parts):     # (another part would be dropped: refused instead)
                if not (isinstance(p, dict) and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str)):
                    raise _bad(f"{at}.content[{j}]: only reasoning_text parts with a text are supported",
                               f"{at}.content[{j}]")
            texts = [p["text"] for p in parts]
            thought = "\n".join(texts) if texts else thought
        else:
            raise _bad(f"{at}.type: {kind!r} is not supported (message, function_call, function_call_output, "
                       f"reasoning)", f"{at}.type")
    return messages


def _string(item: dict, key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{at}.{key}: must be a string", f"{at}.{key}")
    return value


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that runs req. Raises APIError naming the Responses field."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "stream": req.stream,
                            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
                            **{k: getattr(req, k) for k in PASSTHROUGH if getattr(req, k) is not None}}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for k, name in enumerate(req.include or []):
        if name != LOGPROBS:
            raise _bad(f"include[{k}]: only {LOGPROBS!r} is supported, got {name!r}", f"include[{k}]")
    if LOGPROBS in (req.include or []) or req.top_logprobs:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    if req.tools:
        body["tools"] = [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(req.tools)]
    if isinstance(req.tool_choice, dict):
        if req.tool_choice.get("type") != "function" or not isinstance(req.tool_choice.get("name"), str):
            raise _bad("tool_choice: only {\"type\": \"function\", \"name\": ...} or none, auto, required",
                       "tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice["name"]}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    for key, value in (req.reasoning or {}).items():
        if key == "effort":
            body["reasoning_effort"] = value
        elif value is not None:
            raise _bad(f"reasoning.{key}: is not supported (only reasoning.effort)", f"reasoning.{key}")
    fmt = (req.text or {}).get("format")
    if fmt is not None and req.structured_outputs is not None:    # (the chat request would name response_format)
        raise _bad("give at most one of text.format or structured_outputs", "structured_outputs")
    if fmt is not None:
        body["response_format"] = _response_format(fmt)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise _bad(f"{loc}: {err.get('msg', 'invalid')}", loc.split(".")[0] or None) from None


# a chat field an error names -> the Responses field it came from (the longest that matches)
CHAT_NAMES = {"response_format.json_schema": "text.format", "response_format": "text.format",
              "max_completion_tokens": "max_output_tokens", "messages": "input", "reasoning_effort": "reasoning.effort"}


def responses_error(e: APIError) -> APIError:
    """e, naming the Responses field where it names the chat field made from it."""
    param = e.param or ""
    for chat in sorted(CHAT_NAMES, key=len, reverse=True):
        if param == chat or param.startswith(chat + "."):
            name = CHAT_NAMES[chat] + param[len(chat):]
            return APIError(e.status, e.message.replace(param, name), e.type, name, e.code)
    return e


def _chat_tool(tool: dict, at: str) -> dict:
    if tool.get("type") != "function":
        raise _bad(f"{at}.type: only function tools are supported, got {tool.get('type')!r}", f"{at}.type")
    spec = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": spec}


def _response_format(fmt: dict) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise _bad(f"text.format.type: must be text, json_object or json_schema, got {kind!r}", "text.format")


# a chat finish reason -> the response's status and incomplete_details (stop and tool_calls: completed)
FINISHES = {"length": ("incomplete", {"reason": "max_output_tokens"}), "abort": ("cancelled", None),
            "error": ("failed", None), None: ("in_progress", None)}


class ResponsesHandler:
    def __init__(self, ctx: ServingContext, chat: ChatHandler) -> None:
        self.ctx, self.chat = ctx, chat

    async def __call__(self, req: ResponsesRequest, raw: Request) -> Response:
        """Streamed or not, the chat stream's chunks make the items (_events): the response object is the stream's
        last event's, so its items are the stream's, in the order the reply wrote them (a harmony reply's analysis,
        preamble, call and final messages each an item where they alternate)."""
        try:
            out = await self.chat(chat_request(req.model_copy(update={"stream": True})), raw, message_logprobs=True)
        except APIError as e:
            raise responses_error(e) from None
        if req.stream:
            return sse_response(_sse(self._events(req, out.body_iterator)))
        if not isinstance(out, StreamingResponse):
            return out

        async def last_event() -> dict:      # (the others are never serialized)
            events = self._events(req, out.body_iterator)
            try:
                async for last in events:
                    pass
                return last
            finally:
                await events.aclose()

        task = await until_disconnected(raw, last_event())
        if task is None:
            return Response(status_code=499)     # the client is gone; nobody reads this
        done = task.result()
        if done["type"] == "error":
            raise APIError(500, done["message"], type="internal_error")
        return JSONBody(done["response"])

    def _response(self, req: ResponsesRequest, rid: str, output: list, finish: str | None,
                  use: dict | None) -> dict:
        status, incomplete = FINISHES.get(finish, ("completed", None))
        error = {"code": "server_error", "message": "the engine failed the request"} if status == "failed" else None
        return {
            "id": rid, "object": "response", "created_at": int(time.time()), "status": status, "error": error,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.ctx.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None} if req.reasoning else None,
            "store": False, "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "truncation": "disabled", "user": req.user, "metadata": req.metadata or {},
            "usage": None if use is None else {
                "input_tokens": use["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": use["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": use["completion_tokens"], "output_tokens_details": {
                    "reasoning_tokens": use.get("completion_tokens_details", {}).get("reasoning_tokens", 0)},
                "total_tokens": use["total_tokens"]}}

    async def _events(self, req: ResponsesRequest, chunks: AsyncIterator[str]) -> AsyncIterator[dict]:
        """The chat stream's chunks as Responses events: each text run a message item, each tool call a
        function_call item, one after another, then response.completed (or .incomplete) with all of them. An event
        holds items that later chunks extend in place: serialize each before taking the next (_sse)."""
        rid, seq, output = req.response_id(), 0, []
        item: dict | None = None      # the output item being streamed
        calls: dict[int, dict] = {}   # the chat tool call index -> its item
        finish, use = None, None
        # logprobs of tokens with no text yet while no item is open: the next text's (an incomplete character), or
        # dropped where reasoning or a call comes first (a <think>, a call's held-back text): no empty message
        pending: list = []

        def event(kind: str, **data) -> dict:
            nonlocal seq
            seq += 1
            return {"type": kind, "sequence_number": seq - 1, **data}

        def close(status: str = "completed") -> list[dict]:
            nonlocal item
            if item is None:
                return []
            done, item = item, None
            done["status"] = status
            at = {"item_id": done["id"], "output_index": output.index(done)}
            if done["type"] == "message":
                part = done["content"][0]
                return [event("response.output_text.done", **at, content_index=0, text=part["text"],
                              logprobs=part["logprobs"]),
                        event("response.content_part.done", **at, content_index=0, part=part),
                        event("response.output_item.done", output_index=at["output_index"], item=done)]
            if done["type"] == "reasoning":
                return [event("response.reasoning_text.done", **at, content_index=0, text=done["content"][0]["text"]),
                        event("response.output_item.done", output_index=at["output_index"], item=done)]
            return [event("response.function_call_arguments.done", **at, arguments=done["arguments"]),
                    event("response.output_item.done", output_index=at["output_index"], item=done)]

        def open_item(new: dict) -> list[dict]:
            nonlocal item
            events = close()
            item = new
            output.append(new)
            added = {**new, "content": []} if new["type"] == "message" else new
            events.append(event("response.output_item.added", output_index=len(output) - 1, item=dict(added)))
            if new["type"] == "message":
                events.append(event("response.content_part.added", item_id=new["id"], output_index=len(output) - 1,
                                    content_index=0, part=dict(new["content"][0])))
            return events

        start = self._response(req, rid, [], None, None)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        try:
            async for text in chunks:
                for line in text.split("\n"):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        yield event("error", code=chunk["error"].get("type"), message=chunk["error"]["message"],
                                    param=None)
                        return
                    use = chunk.get("usage") or use
                    for choice in chunk.get("choices", []):
                        delta = choice.get("delta", {})
                        if delta.get("reasoning") or delta.get("tool_calls"):
                            pending = []
                        if delta.get("reasoning"):
                            if item is None or item["type"] != "reasoning":
                                for e in open_item(_reasoning_item(f"rs_{uuid.uuid4().hex}", "", "in_progress")):
                                    yield e
                            item["content"][0]["text"] += delta["reasoning"]
                            yield event("response.reasoning_text.delta", item_id=item["id"],
                                        output_index=len(output) - 1, content_index=0, delta=delta["reasoning"])
                        lps = (choice.get("logprobs") or {}).get("content") or []
                        text = delta.get("content") or ""
                        if not text and lps and item is None and not delta.get("tool_calls"):
                            pending += lps
                            lps = []
                        # a token may have no text yet (an incomplete character): its logprob still goes out with
                        # the message's, unless it belongs to a function call's arguments
                        in_text = item is not None and item["type"] == "message"
                        if text or (lps and in_text and not delta.get("tool_calls")):
                            if item is None or item["type"] != "message":
                                for e in open_item(_message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")):
                                    yield e
                            lps, pending = pending + lps, []
                            item["content"][0]["text"] += text
                            item["content"][0]["logprobs"] += lps
                            yield event("response.output_text.delta", item_id=item["id"],
                                        output_index=len(output) - 1, content_index=0, delta=text, logprobs=lps)
                        for tc in delta.get("tool_calls") or []:
                            fn = tc.get("function", {})
                            if tc["index"] not in calls:
                                calls[tc["index"]] = _call_item(f"fc_{uuid.uuid4().hex}", tc.get("id"),
                                                                fn.get("name"), "", "in_progress")
                                for e in open_item(calls[tc["index"]]):
                                    yield e
                            if fn.get("arguments"):
                                call = calls[tc["index"]]
                                call["arguments"] += fn["arguments"]
                                yield event("response.function_call_arguments.delta", item_id=call["id"],
                                            output_index=output.index(call), delta=fn["arguments"])
                        finish = choice.get("finish_reason") or finish
            for e in close("incomplete" if finish == "length" else "completed"):    # max_output_tokens cut it
                yield e
            done = self._response(req, rid, output, finish, use)
            yield event("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                        response=done)
        finally:
            await chunks.aclose()


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Responses events as server-sent events, each serialized as it comes (its items may change after)."""
    try:
        async for e in events:
            yield f"event: {e['type']}\ndata: {json.dumps(e)}\n\n"
    finally:
        await events.aclose()


def _message_item(item_id: str, text: str, status: str, logprobs: list | None = None) -> dict:
    """logprobs: chat's logprobs.content entries (token, logprob, bytes, top_logprobs), which are the Responses'."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
