"""OpenAI request bodies as strict pydantic models (they are the server's OpenAPI schema), and errors.

Strict: a JSON string where a number belongs is a 400, not a silent coercion. Floats must be finite.
Fields vLLM adds to OpenAI's (top_k, min_p, min_tokens, ignore_eos, stop_token_ids, ...) are accepted
too. A field OpenAI or vLLM defines that this server does not honour (structured outputs, tools, beam
search, ...) is declared below only to be refused: a 400 naming it, unless it asks for nothing (its
no-op value). Never answer a request as if it had been honoured. Fields neither defines are ignored,
as OpenAI and vLLM do.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator

from picovllm.entrypoints.chat_template import joined_parts
from picovllm.entrypoints.openai.tool_calls import ToolPolicy, template_arguments
from picovllm.entrypoints.parallel_sampling import sample_params
from picovllm.sampling_params import (LONE_SURROGATE, MAX_CACHE_SALT_CHARS, SamplingParams,
                                       StructuredOutputsParams)

MAX_INT = 2**31 - 1
MAX_STOP = 16
MAX_N = 64               # samples per request (n, best_of)
MAX_LOGIT_BIAS = 1024    # entries; OpenAI allows 300
MAX_ALLOWED_TOKENS = 1 << 20   # allowed_token_ids entries (a vocabulary's size at most, in practice)
MAX_BAD_WORDS = 128            # bad_words entries (as vLLM's)
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
# logprobs, top_logprobs, prompt_logprobs (-1: the whole vocabulary): the engine holds them to its max_logprobs
# (--max-logprobs; engine/admission.check_logprobs), its refusal a 400 naming the field (ServingContext.add)
LogprobCount = Annotated[int, Field(ge=-1, le=MAX_INT)]
REQUEST_ID_PATTERN = r"^[\x21-\x7e]+$"     # a client's request_id: printable ASCII without spaces


class APIError(Exception):
    """An error the client gets as OpenAI's error object with this HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)




def _lone_surrogate_at(value: Any, at: str) -> str | None:
    """Where in value (a string, or lists and dicts of them at any depth) a string holds a lone surrogate, as a path
    from `at`; None if nowhere. Depth first, a dict's keys before its values, without recursing: a body may nest as
    deep as json.loads reads (~900 levels), past what two frames a level leave of Python's stack."""
    todo = [(at, value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, str):
            if LONE_SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            todo += reversed([(path, k) for k in item] + [(f"{path}.{k}", v) for k, v in item.items()])
        elif isinstance(item, list):
            todo += reversed([(f"{path}[{i}]", v) for i, v in enumerate(item)])
    return None


def unicode_text(value: Any, field: str) -> Any:
    """value, unless a string in it holds a lone surrogate: a ValueError naming where. For text that is matched
    against the output (a stop string that never could) or rendered into the prompt beside the messages (whose
    tokenizer's refusal would name the messages)."""
    where = _lone_surrogate_at(value, field)
    if where is not None:
        raise ValueError(f"{where} holds a lone surrogate (a \\ud800-\\udfff escape), which is not Unicode text")
    return value


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False    # vLLM's: with include_usage, every chunk carries its choice's usage so far


# Refused fields and the values that ask for nothing (None always does): any other value is a 400.
REFUSED_COMMON: dict[str, tuple] = {
    "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "functions": (), "function_call": ("none",),
    "logits_processors": (), "vllm_xargs": (),
    "store": (False,), "prediction": (), "audio": (), "modalities": (["text"],),
    "web_search_options": (),
    # vLLM's newer fields: explicit logprob token sets, a thinking budget, its own P/D connector's parameters,
    # watermarks, media; truncation keeps the prompt's last tokens (vLLM's "left" side)
    "logprob_token_ids": (), "thinking_token_budget": (), "kv_transfer_params": (), "watermarking": (False,),
    "media_io_kwargs": (), "truncation_side": ("left",),
    # vLLM's: ends a request on a repeating n-gram, encoder-cache disaggregation's parameters, the rendered prompt's
    # text in the response, and a per-request --stream-interval (1, the least, changes nothing here)
    "repetition_detection": (), "ec_transfer_params": (), "return_prompt_text": (False,), "stream_interval": (1,),
}
REFUSED_CHAT: dict[str, tuple] = {
    "mm_processor_kwargs": (),
}
REFUSED_COMPLETION: dict[str, tuple] = {
    "prompt_embeds": (),
    "tool_choice": ("none",),                             # tools are chat's
    "reasoning_effort": (),                               # chat's (a template variable)
}


def _same(value: Any, ok: Any) -> bool:
    if isinstance(value, bool) or isinstance(ok, bool):   # True == 1 in Python, not in JSON
        return type(value) is type(ok) and value == ok
    return value == ok


def refuse_unless_noop(name: str, value: Any, noop: dict[str, tuple]) -> Any:
    if value is None or any(_same(value, ok) for ok in noop[name]):
        return value
    if name.startswith("guided_"):   # guided_decoding_backend, guided_whitespace_pattern
        raise ValueError("is not supported: the backend is xgrammar, JSON is compact (send null or omit it)")
    if name in ("functions", "function_call"):
        raise ValueError("is not supported: use tools and tool_choice")
    allowed = " or ".join(repr(v) for v in noop[name])
    raise ValueError("is not supported" + (f" (only {allowed} or null)" if allowed else " (send null or omit it)"))


def refusing_model(name: str, refused: dict[str, tuple]) -> type[BaseModel]:
    """A base model that declares each refused field (so the OpenAPI schema lists it and the 400 names it)
    as Any, and refuses every value but the no-op ones."""
    def check(cls, v: Any, info: ValidationInfo) -> Any:
        return refuse_unless_noop(info.field_name, v, refused)

    validator = field_validator(*refused)(classmethod(check))
    return create_model(name, __base__=_Strict, __validators__={f"_refuse{name}": validator},
                        **{f: (Any, None) for f in refused})


_RefusedCommon = refusing_model("_RefusedCommon", REFUSED_COMMON)
_RefusedChat = refusing_model("_RefusedChat", REFUSED_CHAT)
_RefusedCompletion = refusing_model("_RefusedCompletion", REFUSED_COMPLETION)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None    # {"name", "description", "schema", "strict"}: schema is used
    # structural_tag's two forms (vLLM's): xgrammar's {"format": {...}}, or the older structures
    # ([{"begin", "schema", "end"}, ...]) with their triggers
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    def structural_tag_text(self) -> str:
        """The structural tag as one JSON text, as vLLM's protocol dumps it for its engine; ValueError unless exactly
        one form is given (vLLM would quietly take the older one where both are)."""
        older = self.structures is not None or self.triggers is not None
        if older == (self.format is not None):
            raise ValueError("response_format: a structural_tag takes either format or structures and triggers")
        if older and (self.structures is None or self.triggers is None):
            raise ValueError(f"response_format.{'triggers' if self.triggers is None else 'structures'} is required "
                             f"with {'structures' if self.triggers is None else 'triggers'}")
        if older:
            return json.dumps({"type": "structural_tag", "structures": self.structures, "triggers": self.triggers})
        return json.dumps({"type": "structural_tag", "format": self.format})


# The ways a request may constrain its output, in the order they are named in errors; at most one per request.
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs")


class _StructuredRequest(_Strict):
    """response_format and vLLM's guided_* / structured_outputs, read into one StructuredOutputsParams."""
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag" (JSON text): ...}
    structured_outputs: dict[str, Any] | None = None

    def structured_output_params(self) -> StructuredOutputsParams | None:
        given = [f for f in STRUCTURED_FIELDS if getattr(self, f) is not None
                 and not (f == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise APIError(400, f"give at most one of {', '.join(given)}", param=given[1])
        if not given:
            return None
        f = given[0]
        try:
            if f == "response_format":
                return self._response_format_params()
            if f == "structured_outputs":
                return StructuredOutputsParams(**self._known_keys(), source=f)
            return StructuredOutputsParams(**{f.removeprefix("guided_"): getattr(self, f)}, source=f)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), param=f) from None

    def _response_format_params(self) -> StructuredOutputsParams:
        rf = self.response_format
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True, source="response_format")
        if rf.type == "structural_tag":
            return StructuredOutputsParams(structural_tag=rf.structural_tag_text(), source="response_format")
        spec = rf.json_schema
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema is required with type json_schema")
        schema = spec.get("schema")
        if schema is None:   # OpenAI: a schema is optional; without one, any JSON object
            return StructuredOutputsParams(json_object=True, source="response_format.json_schema")
        return StructuredOutputsParams(json=schema, source="response_format.json_schema.schema")

    def _known_keys(self) -> dict:
        so = self.structured_outputs
        unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object", "structural_tag"})
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]} is not supported")
        return so


class _SamplingRequest(_StructuredRequest, _RefusedCommon):
    """Fields shared by completions and chat completions."""
    model: str | None = None
    temperature: FiniteFloat | None = Field(None, ge=0, le=2)
    top_p: FiniteFloat | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    prompt_logprobs: LogprobCount | None = None   # vLLM's: each prompt token's, and the top k
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    frequency_penalty: FiniteFloat | None = Field(None, ge=-2, le=2)
    presence_penalty: FiniteFloat | None = Field(None, ge=-2, le=2)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: str | None = None
    # Accepted and ignored, as vLLM ignores them: OpenAI's service_tier, metadata, verbosity, prompt_cache_key,
    # safety_identifier and stream_options.include_obfuscation (vLLM's models do not declare them: undeclared, they are
    # dropped here too); vLLM's return_token_offsets and return_mm_kwargs (its render endpoints' only, "ignored on
    # regular generation endpoints"), routed_experts_prompt_start (used only with --enable-return-routed-experts,
    # which this server does not have) and session_id (a conversation's identity across requests, no sampling
    # parameter; nothing here is keyed by sessions).
    session_id: str | None = None
    return_token_offsets: bool | None = None
    return_mm_kwargs: bool = True
    routed_experts_prompt_start: int = Field(0, ge=0, le=MAX_INT)
    # vLLM's additions
    repetition_penalty: FiniteFloat | None = Field(None, gt=0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)
    min_p: FiniteFloat | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT)    # -1: as many as the model takes
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKENS)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=1024)]],
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)   # vLLM's: with --scheduling-policy priority, lower first
    use_beam_search: bool = False                          # vLLM's: n beams (serving_beam.py)
    length_penalty: FiniteFloat = 1.0
    return_tokens_as_token_ids: bool = False   # logprobs name tokens "token_id:<id>" (for text that is not UTF-8)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)   # vLLM's: hits within one salt
    # vLLM's: the prompt's and each choice's token ids in the response (streamed: the prompt's in the first chunk,
    # each chunk's new ones)
    return_token_ids: bool = False
    # vLLM's: the request's id (the response's is the endpoint's prefix and it), else a random one
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=REQUEST_ID_PATTERN)

    def response_id(self, prefix: str) -> str:
        return f"{prefix}-{self.request_id or uuid.uuid4().hex}"
    # vLLM's: false (with skip_special_tokens false) puts no space between two added (special) tokens in a row, where
    # the tokenizer's decoder joins tokens with spaces (WordPiece's); SamplingParams.spaces_between_special_tokens
    spaces_between_special_tokens: bool = True

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):     # vLLM's and OpenAI's refusal
            raise ValueError("stream_options can only be given with stream: true")
        return v

    @field_validator("stop")
    @classmethod
    def _unicode_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        return unicode_text(v, "stop")

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict | None) -> dict | None:
        bad = next((k for k in (v or {}) if not (k.isascii() and k.isdigit() and int(k) <= MAX_INT)), None)
        if bad is not None:
            raise ValueError(f"keys must be token ids (decimal strings), got {bad[:20]!r}")
        return v

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict | None = None) -> SamplingParams:
        """defaults: the model's generation config (picovllm/generation_config.py) for the fields this request left
        unset; its max_tokens caps the request's. Raises APIError(400) naming the field when the combination is
        invalid."""
        d = defaults or {}

        def own(value, name: str, fallback):
            return value if value is not None else d.get(name, fallback)

        if "max_tokens" in d:
            max_tokens = d["max_tokens"] if max_tokens is None else min(max_tokens, d["max_tokens"])
        try:
            return SamplingParams(
                temperature=own(self.temperature, "temperature", 1.0), top_p=own(self.top_p, "top_p", 1.0),
                n=self.n, top_k=own(self.top_k, "top_k", 0), min_p=own(self.min_p, "min_p", 0.0), seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=self.prompt_logprob_count(),
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                allowed_token_ids=self.allowed_token_ids, truncate_prompt_tokens=self.truncate_prompt_tokens,
                bad_words=self.bad_words,
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=own(self.repetition_penalty, "repetition_penalty", 1.0),
                logit_bias=self.logit_bias, structured_outputs=self.structured_output_params(),
                cache_salt=self.cache_salt)
        except ValueError as e:       # SamplingParams.FIELD ...: the request's field of that name, where it has one
            named = re.match(r"SamplingParams\.(\w+)", str(e))
            param = named.group(1) if named and named.group(1) in type(self).model_fields else None
            raise APIError(400, str(e), param=param) from None

    def prompt_logprob_count(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: asked together with include_usage, or it does nothing."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest, _RefusedCompletion):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=0, le=MAX_INT)     # 0: only with echo (the prompt scored, as OpenAI's)
    logprobs: LogprobCount | None = None
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    add_special_tokens: bool = True      # vLLM's: a text prompt gets the tokenizer's special tokens (BOS)

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any) -> Any:
        """null is OpenAI's default, 16, as vLLM reads it (not "until the context is full")."""
        return cls.model_fields["max_tokens"].default if v is None else v

    def prompt_logprob_count(self) -> int | None:
        if self.echo and self.logprobs is not None:   # the echoed prompt's tokens get logprobs like the output's
            return -1 if -1 in (self.logprobs, self.prompt_logprobs) else max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def samples(self, params: SamplingParams) -> list[SamplingParams]:
        """One SamplingParams per sample to run: best_of of them (ranked by cumulative logprob, which
        needs the chosen tokens' logprobs), else n. Raises APIError naming best_of when it cannot be."""
        k = self.best_of or params.n
        if k < params.n:
            raise APIError(400, f"best_of ({k}) must be >= n ({params.n})", param="best_of")
        if k > params.n and self.stream:
            raise APIError(400, "best_of > n cannot be streamed (the best are known at the end)", param="best_of")
        if k > params.n and params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)
        return sample_params(params, k)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one (text or token ids), or each of a list of them (OpenAI's batched prompts)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(refusing_model("_RefusedInMessage", {"function_call": ()})):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None    # an assistant's earlier calls
    tool_call_id: str | None = None                    # a tool message: which call it answers
    reasoning: str | None = None                       # an assistant's earlier reasoning, as this server returns it
    reasoning_content: str | None = None               # (vLLM's older name)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        """A part that is not text (an image, audio, a file, a refusal) named by its type: this server serves text
        models."""
        for j, part in enumerate(v if isinstance(v, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content[{j}]: a part of type {kind!r} is not supported (text parts only: this "
                                 f"server's model takes text)")
        return v

    def as_template_dict(self) -> dict:
        """The message as a chat template takes it; a content of text parts stays a list of them
        (chat_template.content_for_template joins them unless the template loops over them)."""
        content = self.content
        if isinstance(content, list):
            content = [{"type": "text", "text": p.text} for p in content]
        d = {"role": self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thought is not None:     # by the names templates read: Qwen3's reasoning_content, GPT-OSS's thinking
            d["reasoning_content"] = thought
            if not (self.tool_calls and d["content"]):   # GPT-OSS's template takes one or the other before a call
                d["thinking"] = thought
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": template_arguments(c.function.arguments)}}
                for c in self.tool_calls]
        return d


class FunctionSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None    # a JSON schema; required and named calls are constrained by it
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class _ChatTemplateOptions(_Strict):
    """vLLM's: the last (assistant) message left open to be continued, more variables for the chat template
    (checked by entrypoints/chat_template.template_kwargs), documents for a template that renders them (RAG), and
    a template of the request's own (a server started with --trust-request-chat-template)."""
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: Annotated[list[dict[str, str]], Field(max_length=1024)] | None = None
    chat_template: str | None = None

    # and the tools of the requests that have them (chat's, /tokenize's): the template renders them too
    @field_validator("chat_template_kwargs", "documents", "chat_template", "tools", mode="before", check_fields=False)
    @classmethod
    def _unicode_template_text(cls, v: Any, info: ValidationInfo) -> Any:
        return unicode_text(v, info.field_name)


class ChatCompletionRequest(_SamplingRequest, _RefusedChat, _ChatTemplateOptions):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False     # vLLM's: the template holds the special tokens; True adds them again
    echo: bool = False                   # vLLM's: a reply to an assistant's last message starts with that message
    include_reasoning: bool = True       # vLLM's: false leaves the reasoning out (a server with --reasoning-parser)
    # OpenAI's (vLLM's values: chat_template.REASONING_EFFORTS): the chat template's reasoning_effort variable
    # (GPT-OSS's system message) and enable_thinking (Qwen3's), as vLLM passes them
    # (chat_template.reasoning_effort_options)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    @property
    def echoed(self) -> str:
        """What echo puts before each choice's content: the last message's, if it is the assistant's (the reply's
        role), else nothing."""
        last = self.messages[-1]
        return joined_parts(last.as_template_dict()["content"]) if self.echo and last.role == "assistant" else ""
    # an empty list is a 400, as OpenAI's and vLLM's: omit tools instead
    tools: Annotated[list[ToolSpec], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def tool_policy(self) -> ToolPolicy:
        """Raises APIError naming tools or tool_choice when they do not fit together."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: function names must be unique", param="tools")
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if tools else "none")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice: no tool named {choice.function.name!r} in tools", param="tool_choice")
            return ToolPolicy(tools, "named", choice.function.name, self.parallel_tool_calls)
        if choice != "none" and not tools:
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        return ToolPolicy(tools, choice, parallel=self.parallel_tool_calls)

    def structured_output_params(self) -> StructuredOutputsParams | None:
        own = super().structured_output_params()
        forced = self.tool_policy().constraint()
        if forced is not None and own is not None:
            raise APIError(400, f"{own.source}: cannot be combined with a required or named tool_choice",
                           param=own.source.split(".")[0])
        return forced or own

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# -- /tokenize and /detokenize (vLLM's) -----------------------------------------------------------------------
_RefusedTokenize = refusing_model("_RefusedTokenize", {"mm_processor_kwargs": (), "media_io_kwargs": ()})



class TokenizeRequest(_RefusedTokenize, _ChatTemplateOptions):
    """Exactly one of prompt (as /v1/completions encodes it) or messages (as /v1/chat/completions; with tools, as
    a chat request whose tool_choice is "auto" renders them)."""
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[ToolSpec] | None = None
    add_special_tokens: bool | None = None    # None: True for a prompt, False for messages (the endpoints' way)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def checked(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: function names must be unique", param="tools")
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents",
                     "chat_template", "tools"):
            if self.prompt is not None and name in self.model_fields_set:
                raise APIError(400, f"{name} applies to messages only", param=name)
        return self

    @property
    def special_tokens(self) -> bool:
        return self.messages is None if self.add_special_tokens is None else self.add_special_tokens


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1_000_000)]


# -- /v1/embeddings (OpenAI's, with vLLM's extras; a pooling server's: serving_embeddings.py) --------------------------
MAX_EMBEDDING_INPUTS = 2048      # OpenAI's limit of inputs in one request


# vLLM's chat embeddings (messages, through a chat template) and their template fields: not served here
_RefusedEmbedding = refusing_model("_RefusedEmbedding", {
    "messages": (), "chat_template": (), "chat_template_kwargs": (), "mm_processor_kwargs": ()})


class EmbeddingRequest(_RefusedEmbedding):
    """input: a string, a list of strings, a list of token ids, or a list of those (one embedding each).
    encoding_format: "float" or "base64" (float32, as OpenAI's; vLLM's embed_dtype float16 or bfloat16 and endianness
    native, little or big change that). dimensions: a Matryoshka model's only.
    user: accepted, no effect. vLLM's: truncate_prompt_tokens (each input's last k tokens; -1: the model's maximum
    length), add_special_tokens, normalize (None: the server's pooler config), priority, request_id (the response's id
    is embd-<request_id>)."""
    model: str | None = None
    input: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
            | Annotated[list[TokenId], Field(min_length=1)]
            | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                        Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"    # vLLM's (its fp8 ones are refused)
    endianness: Literal["native", "big", "little"] = "native"            # vLLM's, of base64's values
    dimensions: int | None = Field(None, ge=1, le=MAX_INT)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT)
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)   # as the generation requests'
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)    # as theirs
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=REQUEST_ID_PATTERN)   # as theirs

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        return [x] if isinstance(x, str) or isinstance(x[0], int) else list(x)
