"""Prompt preparation (chat template, tokenization) off both the event loop and the engine thread.

A worker thread owns a private copy of the tokenizer, so it never shares a tokenizer with the engine thread's
detokenizer, and a big prompt being tokenized never stalls running streams. A prompt of BIG_PROMPT_CHARS or more goes
to a second thread with a copy of its own (made when the first such prompt comes): a 4 MB prompt tokenizes for
seconds, and every other request's prompt would wait it out in one queue.
"""
from __future__ import annotations

import asyncio
import copy
import re
from concurrent.futures import ThreadPoolExecutor

from picovllm.entrypoints.chat_template import (check_request_template, content_for_template, resolved_template,
                                                template_kwargs)
from picovllm.entrypoints.openai.protocol import APIError
from picovllm.entrypoints.openai.tool_calls import template_renders_tools, with_tool_prompt
from picovllm.sampling_params import LONE_SURROGATE


BIG_PROMPT_CHARS = 100_000     # a prompt this long (~25k tokens and up) tokenizes on the big prompts' thread


class TokenizerWorker:
    def __init__(self, tokenizer, chat_template: str | None = None, trust_request_chat_template: bool = False,
                 content_format: str = "auto", default_template_kwargs: dict | None = None) -> None:
        """chat_template: the template's text (load_chat_template), used instead of the tokenizer's.
        trust_request_chat_template: a request may bring its own (vLLM's --trust-request-chat-template).
        content_format (vLLM's --chat-template-content-format): how a message's list of text parts reaches the
        template: "auto" (content_for_template), "string" (joined) or "openai" (the list).
        default_template_kwargs: template variables a request's chat_template_kwargs add to or replace (vLLM's
        --default-chat-template-kwargs, e.g. {"enable_thinking": False})."""
        self.trust_request_chat_template = trust_request_chat_template
        self.content_format = content_format
        self.default_template_kwargs = dict(default_template_kwargs or {})
        self.tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        if chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("--chat-template needs a tokenizer, and this model has none")
            self.tokenizer.chat_template = chat_template
        # one thread each (ThreadPoolExecutor starts it at the first job); a tokenizer is never shared between two
        # threads: the main one uses self.tokenizer (the event loop only reads its attributes), the big prompts' one a
        # copy it makes at its first prompt
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="picovllm-tokenizer")
        self._big_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="picovllm-tokenizer-big")
        self._big_tokenizer = None       # touched on the big prompts' thread only

    def _need(self, what: str):
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer, and this model has none: send token ids")
        return self.tokenizer

    async def _run(self, fn, *args, chars: int = 0):
        """fn(a tokenizer, *args) on a worker thread: the big prompts' one for `chars` >= BIG_PROMPT_CHARS."""
        if chars >= BIG_PROMPT_CHARS:
            return await asyncio.get_running_loop().run_in_executor(self._big_pool, self._on_big_thread, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, self.tokenizer, *args)

    def _on_big_thread(self, fn, *args):
        if self._big_tokenizer is None:
            self._big_tokenizer = copy.deepcopy(self.tokenizer)
        return fn(self._big_tokenizer, *args)

    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """As Engine.tokenize (and so LLM.generate) encodes a text prompt (add_special_tokens: /tokenize's); param:
        the request's field the text came from, which a 400 for text that cannot be tokenized names."""
        self._need("a text prompt")
        return await self._run(_encode, text, add_special_tokens, param, chars=len(text))

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool,
                          add_special_tokens: bool = False, tools: list[dict] | None = None,
                          continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                          documents: list[dict] | None = None, chat_template: str | None = None,
                          reasoning_effort: str | None = None) -> list[int]:
        """As LLM.chat: render the chat template, then encode without adding special tokens again
        (the template holds them; add_special_tokens=True adds them anyway, as vLLM's field does). tools: through
        the template if it renders them, else described in a system message (entrypoints/openai/tool_calls.py).
        documents: the template's (RAG templates render them). chat_template: the request's own template, where
        the server trusts requests with one. reasoning_effort: the template's variable of that name (a 400 where
        it has none). The other options: LLM.chat's (a bad one is a 400 naming its field)."""
        tok = self._need("chat")
        if chat_template is not None:
            if not self.trust_request_chat_template:
                raise APIError(400, "chat_template: this server does not take a request's chat template (start it "
                                    "with --trust-request-chat-template)", param="chat_template")
            try:
                check_request_template(chat_template)
            except ValueError as e:
                raise APIError(400, str(e), param="chat_template") from None
        try:
            template = resolved_template(tok, chat_template, tools)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        if not template:
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions")
        if self.content_format != "openai":
            messages = content_for_template(messages, template if self.content_format == "auto" else None)
        chat_template_kwargs = {**self.default_template_kwargs, **(chat_template_kwargs or {})}
        try:
            options = template_kwargs(messages, add_generation_prompt, continue_final_message, chat_template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(":")[0]) from None
        if documents and not re.search(r"\bdocuments\b", template):
            raise APIError(400, "documents: the chat template does not render documents", param="documents")
        if reasoning_effort is not None:
            if not re.search(r"\breasoning_effort\b", template):
                raise APIError(400, "reasoning_effort: the chat template has no reasoning effort (send null or omit "
                                    "it)", param="reasoning_effort")
            options["reasoning_effort"] = reasoning_effort
        if tools and not template_renders_tools(template):
            messages, tools = with_tool_prompt(messages, tools), None

        def render(tok) -> list[int]:
            try:
                text = tok.apply_chat_template(messages, tokenize=False, tools=tools or None, chat_template=template,
                                               documents=documents, **options)
            except Exception as e:  # jinja raises TemplateError (and others) on conversations it refuses
                raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
            return _encode(tok, text, add_special_tokens, "messages")

        return await self._run(render, chars=sum(len(str(m.get("content") or "")) for m in messages))

    async def decode(self, ids: list[int], skip_special_tokens: bool = False,
                     spaces_between_special_tokens: bool = True) -> str:
        """As the engine's detokenizer (by default with skip_special_tokens=False: every id shows);
        spaces_between_special_tokens=False (with the special tokens shown): an added token right after another
        comes out as its own text, without the space a decoder that joins tokens with spaces puts between them."""
        self._need("detokenize")
        if skip_special_tokens or spaces_between_special_tokens:
            return await self._run(lambda tok: tok.decode(ids, skip_special_tokens=skip_special_tokens))
        return await self._run(_decode_joining_added_tokens, ids)

    async def token_strs(self, ids: list[int]) -> list[str]:
        self._need("return_token_strs")
        return await self._run(lambda tok: tok.convert_ids_to_tokens(ids))

    def shutdown(self) -> None:
        for pool in (self._pool, self._big_pool):
            pool.shutdown(wait=False, cancel_futures=True)


def _encode(tok, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """engine/admission.encode_text's twin, raising the server's APIError (admission imports torch, which the HTTP
    front end does without)."""
    try:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    except Exception as e:  # e.g. a lone surrogate (valid JSON, not encodable text)
        why = "it holds a lone surrogate, which is not Unicode text" if LONE_SURROGATE.search(text) else \
            type(e).__name__
        raise APIError(400, f"{param}: cannot be tokenized ({why})", param=param) from None


def _decode_joining_added_tokens(tok, ids: list[int]) -> str:
    """ids' text, each run cut where two added tokens meet and decoded apart: nothing joins the two."""
    added = getattr(tok, "added_tokens_decoder", None) or {}
    runs, start = [], 0
    for i in range(1, len(ids)):
        if ids[i - 1] in added and ids[i] in added:
            runs.append(ids[start:i])
            start = i
    runs.append(ids[start:])
    return "".join(tok.decode(run, skip_special_tokens=False) for run in runs)
