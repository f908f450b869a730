"""OpenAI request bodies as strict pydantic models (they are the server's OpenAPI schema), and errors.

Strict: a JSON string where a number belongs is a 400, not a silent coercion. Floats must be finite.
Fields vLLM adds to OpenAI's (top_k, min_p, min_tokens, ignore_eos, stop_token_ids, ...) are accepted
too; unknown fields are ignored, as OpenAI and vLLM do.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from picovllm.sampling_params import SamplingParams

MAX_INT = 2**31 - 1
MAX_LOGPROBS = 20
MAX_STOP = 16
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]


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


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""
    model: str | None = None
    temperature: FiniteFloat | None = Field(None, ge=0, le=2)
    top_p: FiniteFloat | None = Field(None, gt=0, le=1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    frequency_penalty: FiniteFloat | None = None
    presence_penalty: FiniteFloat | None = None
    logit_bias: dict[str, FiniteFloat] | None = None
    user: str | None = None
    # vLLM's additions
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)
    min_p: FiniteFloat | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    skip_special_tokens: bool = True

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("n must be 1 (parallel sampling is not supported)")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0):
            raise ValueError("penalties are not supported (must be 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises APIError(400) naming the field when the combination is invalid."""
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0, min_p=self.min_p or 0.0, seed=self.seed, max_tokens=max_tokens,
                min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("best_of must be 1")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt: one prompt per request is supported, got {len(p)}", param="prompt")
            return p[0]
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        d = {"role": self.role, "content": content or ""}
        if self.name is not None:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list | None) -> list | None:
        if v:
            raise ValueError("tools are not supported")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
