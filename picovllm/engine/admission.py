"""A request's checks against the model and the KV cache (vocabulary, EOS ids, bad words, lengths, capacity): what
would otherwise fail inside a step, taking the whole batch down with it; and against max_logprobs (a whole
vocabulary's logprobs a token are megabytes of Python objects). Each raises ValueError naming the field."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from picovllm.layers.logits_processors import bad_words_token_ids
from picovllm.sampling_params import LONE_SURROGATE, SamplingParams

if TYPE_CHECKING:
    from picovllm.engine.request import Request


@dataclasses.dataclass(frozen=True)
class AdmissionLimits:
    """What an engine admits requests against; fixed once its KV cache is allocated."""
    vocab_size: int
    max_model_len: int
    kv_capacity: int                 # tokens: the KV cache's blocks times block_size
    block_size: int
    window: int | None               # the longest sliding window when every layer has one (Engine._kv_window)
    max_num_batched_tokens: int
    max_logprobs: int                # EngineConfig.max_logprobs (-1: no limit)
    whole_prompt: bool = False       # a P engine: it keeps every block of the prompt (its D decodes, windowed or not)


def check_sampling_params(params: SamplingParams, limits: AdmissionLimits, eos_token_ids: list[int],
                          tokenizer) -> list[list[int]]:
    """A generating request's params against the model; returns its bad words' token ids."""
    vocab = limits.vocab_size
    check_logprobs(params, limits)
    if any(t >= vocab for t in params.stop_token_ids):   # banned from the logits before min_tokens
        raise ValueError(f"SamplingParams.stop_token_ids must be in [0, {vocab}), got {params.stop_token_ids}")
    allowed = params.allowed_token_ids
    if allowed is not None:
        if max(allowed) >= vocab:
            raise ValueError(f"SamplingParams.allowed_token_ids must be token ids in [0, {vocab}), "
                             f"got {max(allowed)}")
        if params.structured_outputs is not None:   # the two masks could leave no token at all
            raise ValueError("SamplingParams.allowed_token_ids cannot be combined with structured outputs")
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        if params.min_tokens and set(allowed) <= ends:   # banned before min_tokens: nothing left to sample
            raise ValueError("SamplingParams.allowed_token_ids holds only stop tokens, which min_tokens bans")
    if params.min_tokens and params.structured_outputs is not None:   # the grammar may end before min_tokens
        raise ValueError("SamplingParams.min_tokens cannot be combined with structured outputs: the grammar may "
                         "end before it, and min_tokens bans the end")
    if any(t >= vocab for t in params.logit_bias):
        raise ValueError(f"SamplingParams.logit_bias keys must be token ids in [0, {vocab}), got "
                         f"{max(params.logit_bias)}")
    return bad_words_ids(params, tokenizer, vocab)


def check_logprobs(params: SamplingParams, limits: AdmissionLimits) -> None:
    """SamplingParams.logprobs and .prompt_logprobs within the vocabulary and EngineConfig.max_logprobs, as vLLM's:
    a count of -1 (the whole vocabulary) is the vocabulary's size, and so is a max_logprobs of -1. A beam search's
    steps (params.within_max_logprobs False) ask for the candidates the search itself needs."""
    vocab = limits.vocab_size
    most = vocab if limits.max_logprobs == -1 else limits.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is None:
            continue
        if k > vocab:
            raise ValueError(f"SamplingParams.{name} must be <= the vocabulary size {vocab}, got {k}")
        if (vocab if k == -1 else k) > most and params.within_max_logprobs:
            asked = f"-1 (the whole vocabulary, {vocab})" if k == -1 else str(k)
            raise ValueError(f"SamplingParams.{name} {asked} is more than max_logprobs ({limits.max_logprobs}): "
                             f"LLM(max_logprobs=...) or --max-logprobs raises it, -1 for no limit")


def bad_words_ids(params: SamplingParams, tokenizer, vocab_size: int) -> list[list[int]]:
    """SamplingParams.bad_words as token ids; ValueError naming the field if they cannot be honoured."""
    if not params.bad_words:
        return []
    if tokenizer is None:
        raise ValueError("SamplingParams.bad_words needs the model's tokenizer")
    # with another mask on the row, the two could leave no token at all
    if params.structured_outputs is not None:
        raise ValueError("SamplingParams.bad_words cannot be combined with structured outputs")
    if params.allowed_token_ids is not None:
        raise ValueError("SamplingParams.bad_words cannot be combined with allowed_token_ids")
    ids = bad_words_token_ids(tokenizer, params.bad_words)
    if any(t >= vocab_size for word in ids for t in word):
        raise ValueError(f"SamplingParams.bad_words: a word has a token outside the model's vocabulary "
                         f"({vocab_size})")
    return ids


def encode_text(tokenizer, text: str, field: str, **kwargs) -> list[int]:
    """tokenizer.encode(text, **kwargs), or a ValueError naming field where the text cannot be encoded: a lone
    surrogate (a "\\ud800" escape) is no Unicode text, and the tokenizer's own error (a TypeError) names nothing."""
    try:
        return tokenizer.encode(text, **kwargs)
    except Exception as e:
        why = "it holds a lone surrogate, which is not Unicode text" if LONE_SURROGATE.search(text) else \
            type(e).__name__
        raise ValueError(f"{field}: cannot be tokenized ({why})") from None


def check_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """A generating request's prompt leaves room for one token."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"prompt is {num_prompt_tokens} tokens, longer than max_model_len - 1 = "
                         f"{max_model_len - 1}")


def max_tokens_of(params: SamplingParams, num_prompt_tokens: int, limits: AdmissionLimits) -> int:
    """SamplingParams.max_tokens cut to the context's room; unset, the room left in the context and in a KV cache
    that holds less."""
    room = limits.max_model_len - num_prompt_tokens
    if params.max_tokens is not None:
        return min(params.max_tokens, room)
    unset = room if limits.window is not None else min(room, limits.kv_capacity - num_prompt_tokens)
    return max(unset, 1)   # a prompt that fills the cache: check_capacity refuses it


def check_capacity(num_prompt_tokens: int, max_tokens: int, limits: AdmissionLimits) -> None:
    """The request fits the KV cache at its longest (with a sliding window, what it holds at once)."""
    capacity = limits.kv_capacity
    if limits.whole_prompt and num_prompt_tokens > capacity:
        raise ValueError(f"prompt ({num_prompt_tokens}) tokens exceed the KV cache ({capacity} tokens), which holds "
                         f"a prompt whole on a prefill engine")
    need = num_prompt_tokens + max_tokens
    if limits.window is not None:   # at most the window, a chunk and a block on either side at once
        need = min(need, limits.window + limits.max_num_batched_tokens + 2 * limits.block_size)
    if need > capacity:     # a pooling request (max_tokens 0) has no max_tokens to name
        asked = f"prompt ({num_prompt_tokens})" + (f" + max_tokens ({max_tokens})" if max_tokens else "")
        raise ValueError(f"{asked} tokens exceed the KV cache ({capacity} tokens)")


def check_offer(req: Request, limits: AdmissionLimits, role: str, tokenizer) -> list[list[int]]:
    """A request the peer offers (P resolved its max_tokens against its own limits), against this engine's; returns
    its bad words' token ids."""
    check_length(req.num_prompt_tokens, limits.max_model_len)
    if req.num_prompt_tokens + req.max_tokens > limits.max_model_len:
        raise ValueError(f"max_tokens: prompt ({req.num_prompt_tokens}) + max_tokens ({req.max_tokens}) "
                         f"exceed the {role} engine's max_model_len ({limits.max_model_len})")
    check_capacity(req.num_prompt_tokens, req.max_tokens, limits)
    # The peer's KV arrives whole, into blocks for it and the next token: a sliding window (whose check above counts
    # only what is held at once) gives none of it back before it arrived, so one that cannot fit would wait forever
    if req.num_tokens > limits.kv_capacity:
        raise ValueError(f"prompt ({req.num_prompt_tokens}) tokens: their KV arrives whole from the peer, and with the "
                         f"next token exceeds the {role} engine's KV cache ({limits.kv_capacity} tokens)")
    return bad_words_ids(req.params, tokenizer, limits.vocab_size)
