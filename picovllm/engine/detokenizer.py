"""Incremental detokenization and stop-condition checks for one request at a time."""
from __future__ import annotations

from dataclasses import dataclass

from picovllm.engine.request import FinishReason, Request

CONTEXT_TOKENS = 4   # prompt tokens decoded alongside the output so leading spaces come out right
MAX_CONTEXT_TOKENS = 16   # how far back a prompt ending inside a character is read for the end of one before it
                          # (a character is at most 4 byte tokens; a prompt of nothing but stray bytes stops there)


# the classes whose _decode is the `tokenizers` object's decode, then an optional clean-up of spaces (transformers 5, 4)
FAST_DECODES = {("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
                ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast")}


def native_decoder(tokenizer):
    """The `tokenizers` object behind a fast HF tokenizer whose decode is that object's (no decode of its own; a
    clean-up of spaces, which the detokenizer never asks for, aside), or None. Its decode skips transformers'
    wrapper, which took ~60% of a decode's time (4.8 against 1.9 us for a short text on a 2-core CPU): two decodes a
    token a request are much of a decode step's host work at small models."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from transformers import PreTrainedTokenizerBase
    mro = type(tokenizer).__mro__
    owner = next(c for c in mro if "_decode" in c.__dict__)
    if (owner.__module__, owner.__name__) not in FAST_DECODES or \
            next(c for c in mro if "decode" in c.__dict__) is not PreTrainedTokenizerBase:
        return None
    return backend


def _hf_tokenizer(tokenizer) -> bool:
    if tokenizer is None:
        return False
    from transformers import PreTrainedTokenizerBase
    return isinstance(tokenizer, PreTrainedTokenizerBase)


@dataclass
class DetokState:
    tokens: list[int]      # context tokens + output tokens
    prefix_offset: int     # tokens[prefix_offset:read_offset] decode to text already emitted
    read_offset: int
    last_added: bool = False   # the previous output token is an added (special) token


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._backend = native_decoder(tokenizer)
        # an HF tokenizer's decode takes the clean-up switch; another (a test's, a user's own) decodes as it does
        self._no_clean_up = {"clean_up_tokenization_spaces": False} if _hf_tokenizer(tokenizer) else {}
        self._added: dict[int, str] | None = None    # added tokens' ids -> their text, read when first needed

    def added_tokens(self) -> dict[int, str]:
        if self._added is None:
            added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
            self._added = {i: getattr(t, "content", str(t)) for i, t in added.items()}
        return self._added

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        """ids' text, spaces never cleaned up (as vLLM's detokenizer): a clean-up can take back a space an earlier
        delta sent, and the text after it would then come out a character short."""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special, **self._no_clean_up)

    def append(self, req: Request, token_id: int) -> str:
        """Add one output token; return the text it adds (empty while a character is incomplete)."""
        if self.tokenizer is None:
            return ""
        st = req.detok_state
        skip = req.params.skip_special_tokens
        if st is None:
            # The first delta is decode(ctx + token) minus decode(ctx): a token decoded alone can
            # lose its leading space (SentencePiece's '▁'). A prompt that ends part way through a character
            # (its text ends in U+FFFD) leaves that character to the output tokens that finish it: read from before
            # it, or the character would never come out. Where no token of the context ends a character (a byte-level
            # vocabulary's context that starts inside one emoji and ends inside the next), the context reaches
            # further back: read from its start, the earlier character's bytes, already the prompt's text, had come
            # out as U+FFFDs in front of the output's.
            n = CONTEXT_TOKENS
            while True:
                ctx = req.prompt_token_ids[-n:]
                read = len(ctx)
                while read and self._decode(ctx[:read], skip).endswith("\ufffd"):
                    read -= 1
                if read or len(ctx) == len(req.prompt_token_ids) or n >= MAX_CONTEXT_TOKENS:
                    break
                n += CONTEXT_TOKENS
            st = req.detok_state = DetokState(list(ctx), 0, read)
        st.tokens.append(token_id)
        # vLLM's spaces_between_special_tokens=False: an added token right after another comes out as its own text,
        # without the space that a decoder joining tokens with spaces (WordPiece's, WordLevel's) puts between them
        content, after_added = None, st.last_added
        if not (skip or req.params.spaces_between_special_tokens):
            content = self.added_tokens().get(token_id)
            st.last_added = content is not None
        prefix = self._decode(st.tokens[st.prefix_offset:st.read_offset], skip)
        full = self._decode(st.tokens[st.prefix_offset:], skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""   # wait for the rest of a multi-byte character (or a token that adds nothing)
        st.prefix_offset, st.read_offset = st.read_offset, len(st.tokens)
        delta = full[len(prefix):]
        return content if after_added and content is not None and delta == " " + content else delta


def stop_token(req: Request, token_id: int, eos_token_ids: list[int]) -> bool:
    """Whether req's newest token (token_id, already in its output) stops it: one of its stop_token_ids, or an EOS
    it does not ignore, past min_tokens."""
    p = req.params
    return len(req.output_token_ids) >= p.min_tokens and (
        token_id in p.stop_token_ids or (not p.ignore_eos and token_id in eos_token_ids))


def check_stop(req: Request, token_id: int, new_text: str, eos_token_ids: list[int], max_model_len: int,
               token_stops: bool | None = None, primary_eos: int | None = None) -> None:
    """Finish req if token_id or its text meets a stop condition; trims a matched stop string. token_stops: what
    stop_token said of token_id, where the caller asked already (it leaves a stop token's own text out, as vLLM
    does unless include_stop_str_in_output). primary_eos: the tokenizer's EOS; the model's other EOS ids (its
    generation config's) stop as stop tokens do, their id the stop_reason (vLLM moves them into stop_token_ids)."""
    p = req.params
    n_out = len(req.output_token_ids)
    if token_stops is None:
        token_stops = stop_token(req, token_id, eos_token_ids)
    if token_stops:
        # vLLM's stop_reason: None for the EOS (the tokenizer's, not ignored), even one also in stop_token_ids;
        # else the token's id
        eos = not p.ignore_eos and token_id in eos_token_ids and primary_eos in (None, token_id)
        return req.finish(FinishReason.STOP, stop_reason=None if eos else token_id)
    if n_out > p.min_tokens and p.stop and new_text:   # (vLLM's) a stop string ends after the min_tokens' text
        match = _first_stop_string(req.text, len(new_text), p.stop)
        if match is not None:
            idx, s = match
            req.text = req.text[:idx + (len(s) if p.include_stop_str_in_output else 0)]
            return req.finish(FinishReason.STOP, stop_reason=s)
    if n_out >= req.max_tokens or req.num_known_tokens >= max_model_len:    # a pending token: the next step's
        req.finish(FinishReason.LENGTH)


def _first_stop_string(text: str, new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """(where it starts, the string) of the stop string that the text's last new_chars characters complete first;
    ties go to the one listed first. A token whose text completes several (vLLM takes the first listed that
    matches) is cut at the first to end, as one character at a time would: no stop string is left in the text."""
    best = None
    for s in stops:
        idx = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if idx >= 0 and (best is None or idx + len(s) < best[0] + len(best[1])):
            best = idx, s
    return best
