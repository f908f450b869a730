"""Per-request sampling parameters, named and validated as in vLLM."""
from __future__ import annotations

import copy
import math
import re
from dataclasses import KW_ONLY, dataclass
from enum import IntEnum
from typing import ClassVar


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's serving layer caps a cache_salt at 128 characters (a 256-bit salt is 43 in base64, 64 in hex): a salt
# takes no room in a cache, but a megabyte one would be hashed, copied to every sample and sent over the P/D wire
MAX_CACHE_SALT_CHARS = 128


class RequestOutputKind(IntEnum):
    """vLLM's: what each RequestOutput of a running request holds (Engine.step's; LLM.generate and LLM.chat return
    whole outputs whatever it says). CUMULATIVE: everything so far; DELTA: only what is new since the request's last
    output (its text held back by the longest stop string, which could still cut it; prompt_logprobs in the first
    only); FINAL_ONLY: no output until the request finishes, then the whole of it."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """Exactly one of these constrains the output (vLLM's StructuredOutputsParams):
    json: a JSON schema (dict or its text); regex: the output fullmatches it; choice: the output is one of
    these strings; grammar: an EBNF (GBNF) grammar whose rule `root` the output matches; json_object: any
    JSON object; structural_tag (vLLM's): xgrammar's structural tag as JSON text, either
    {"type": "structural_tag", "format": {...}} or the older {"structures": [{"begin", "schema", "end"}, ...],
    "triggers": [...]} (text is free until a trigger, then a structure's begin string, JSON its schema admits and
    its end string). `source`: the name the caller gave the constraint by (e.g. a request field), used in errors.
    reasoning_parser (picovllm.reasoning.REASONING_PARSERS; picovllm's): the constraint governs the answer after a
    thinking model's <think> ... </think> block ("qwen3", "deepseek_r1", "glm45") or after GPT-OSS's
    `<|channel|>final<|message|>` ("openai_gptoss"), as EngineConfig.reasoning_parser does for every request (the
    OpenAI front ends set it from their --reasoning-parser, and for a harmony model by themselves)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    source: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and isinstance(self.choice, (list, tuple)):
            self.choice = list(self.choice)   # never the caller's list
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def field_name(self) -> str:
        return self.source or f"SamplingParams.structured_outputs.{self.kind}"

    def validate(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.source or 'SamplingParams.structured_outputs'}: give exactly one of "
                             f"{', '.join(STRUCTURED_KINDS)}, got {given or 'none'}")
        bad = ValueError(f"{self.field_name} must be " + {
            "json": "a JSON schema (an object or its JSON text)", "regex": "a string", "grammar": "a string",
            "choice": "a non-empty list of strings", "json_object": "true",
            "structural_tag": "a structural tag's JSON text"}[self.kind])
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, (str, dict)):
            raise bad
        if self.kind in ("regex", "grammar", "structural_tag") and not isinstance(value, str):
            raise bad
        if self.kind == "choice" and not (isinstance(value, list) and value
                                          and all(isinstance(c, str) for c in value)):
            raise bad
        if self.kind == "json_object" and value is not True:
            raise bad
        from picovllm.reasoning import REASONING_PARSERS
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"SamplingParams.structured_outputs.reasoning_parser must be None or one of "
                             f"{', '.join(map(repr, REASONING_PARSERS))}, got {self.reasoning_parser!r}")


@dataclass
class SamplingParams:
    n: int = 1
    # The rest by keyword only: vLLM's positional order differs (n, presence_penalty, ...), so SamplingParams(1, 0.5)
    # would silently mean another field here; a TypeError instead.
    _: KW_ONLY
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # vLLM's: per output token, its logprob and rank, and the `logprobs` most likely tokens' (-1: the whole
    # vocabulary). The logprobs are vLLM's default logprobs_mode, raw_logprobs: the model's own distribution before
    # logit_bias, penalties, bad words, allowed_token_ids, min_tokens' bans, temperature and top-k/top-p/min-p, but
    # within a structured output's grammar (as vLLM's, which masks the logits with it first: a token it forbids
    # has logprob -inf). A rank counts the tokens at least as likely, the token itself included (vLLM's).
    logprobs: int | None = None
    prompt_logprobs: int | None = None   # per prompt token (the first gets None): its logprob, rank and top-k (-1: all)
    skip_special_tokens: bool = True
    # vLLM's (with skip_special_tokens False): False puts no space between two added (special) tokens in a row, where
    # the tokenizer's decoder joins tokens with spaces (WordPiece's; a byte-level BPE's never does). LLM refuses
    # False with a slow tokenizer, whose decode would take the spaces around every added token away (vLLM's slow path)
    spaces_between_special_tokens: bool = True
    detokenize: bool = True     # vLLM's: False (token ids only) is not supported, refused by validate()
    include_stop_str_in_output: bool = False     # vLLM's: a matched stop string stays at the end of the text
    allowed_token_ids: list[int] | None = None   # vLLM's: only these tokens may be sampled (None: any)
    truncate_prompt_tokens: int | None = None    # vLLM's: keep only the prompt's last k tokens (None: all of it;
                                                 # -1: as many as the model takes, max_model_len - 1)
    # vLLM's: words never generated. Each is tokenized as it is and after a space; a one-token word is banned
    # always, a longer one's last token whenever the output so far ends with the rest of it.
    bad_words: list[str] | None = None
    # As vLLM/OpenAI: presence and frequency penalties count the generated tokens; the repetition
    # penalty (HF/CTRL: positive logits divided by it, negative ones multiplied) the prompt's too.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit; str keys ("42") are read as ids
    # A JSON schema, regex, choice list or grammar the output must match (a dict is read as its fields).
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE    # vLLM's (the enum's docstring)
    # vLLM's request cache_salt (offline: a prompt dict's): prefix-cache hits only among requests of the same salt,
    # so that one tenant cannot learn from another's hits (time to first token) which prompts it sent. At most
    # MAX_CACHE_SALT_CHARS characters: it is hashed into the request's first block hash and travels with the request
    cache_salt: str | None = None
    # Not a field: logprobs and prompt_logprobs within EngineConfig.max_logprobs (engine/admission.check_logprobs);
    # False for a beam search's steps (entrypoints/beam_search.BeamStepParams), whose count is the search's own
    within_max_logprobs: ClassVar[bool] = True

    def __post_init__(self) -> None:
        # Normalise containers so no two requests ever share a list object.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = _copied(self.stop)
        self.stop_token_ids = _copied(self.stop_token_ids) if self.stop_token_ids is not None else []
        self.allowed_token_ids = _copied(self.allowed_token_ids)
        self.bad_words = _copied(self.bad_words)
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1 and not isinstance(self.seed, bool):     # vLLM's: -1 is no seed (a random stream)
            self.seed = None
        if self.logprobs is True:       # vLLM's: 1
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        self.logit_bias = _token_id_keys(self.logit_bias)
        if isinstance(self.structured_outputs, dict):   # from JSON: batch lines, the P/D wire
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if type(self.output_kind) is int and self.output_kind in iter(RequestOutputKind):    # from JSON: an int
            self.output_kind = RequestOutputKind(self.output_kind)
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", "must be an int >= 1")
        if not _number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an int >= 0 (or -1 to disable)")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an int or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an int >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s and _unicode(s) for s in self.stop):
            raise bad("stop", "must be a string or a list of non-empty Unicode strings")    # (none ever matched)
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative ints")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (k >= 1 or k == -1)):
            raise bad("truncate_prompt_tokens", "must be None, an int >= 1, or -1 (as many as the model takes)")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        if not self.detokenize:
            raise bad("detokenize", "False (token ids without text) is not supported; leave it True")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not allowed or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed)):
            raise bad("allowed_token_ids", "must be None or a non-empty list of token ids (ints >= 0)")
        words = self.bad_words
        if words is not None and (not isinstance(words, list) or not all(isinstance(w, str) and w.strip()
                                                                          and _unicode(w) for w in words)):
            raise bad("bad_words", "must be None or a list of words (Unicode strings with more than spaces)")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < -1):
            raise bad("logprobs", "must be an int >= 0, -1 (the whole vocabulary) or None")
        k = self.prompt_logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < -1):
            raise bad("prompt_logprobs", "must be an int >= 0, -1 (the whole vocabulary) or None")
        self._validate_penalties(bad)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        salt = self.cache_salt
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
            raise ValueError(f"SamplingParams.cache_salt must be None or a non-empty string of at most "
                             f"{MAX_CACHE_SALT_CHARS} characters, got {_shown(salt)}")

    def _validate_penalties(self, bad) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be a number in [-2, 2]")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a number > 0 (1 is off)")
        if not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "must be a dict of token id -> bias")
        for tok, b in self.logit_bias.items():
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise bad("logit_bias", f"keys must be token ids (ints >= 0), not {tok!r}")
            if not _number(b) or not -100 <= b <= 100:
                raise bad("logit_bias", f"values must be numbers in [-100, 100], not {b!r} (token {tok})")

    def clone(self) -> "SamplingParams":
        """vLLM's: a deep copy (its lists and dicts are the copy's own)."""
        return copy.deepcopy(self)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# JSON's "\ud800" escapes decode to lone surrogates: no Unicode text, which no tokenizer encodes and no model writes
LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _unicode(text: str) -> bool:
    return not LONE_SURROGATE.search(text)


def _shown(value) -> str:
    """A value for an error message: a long string by its length and start, not in full."""
    if isinstance(value, str) and len(value) > 40:
        return f"a string of {len(value)} characters ({value[:20]!r}...)"
    return repr(value)


def _copied(value):
    """An iterable (a list, tuple, range, ...) as a new list, so no two requests share one; a string, a mapping or a
    non-iterable as it is, for validate to name."""
    if value is None or isinstance(value, (str, bytes, dict)):
        return value
    try:
        return list(value)
    except TypeError:
        return value


def _token_id_keys(bias):
    """A fresh dict (never the caller's), with decimal-string keys read as ids: JSON (OpenAI's
    logit_bias, batch files, the P/D wire) only has string keys. Anything else is left for validate()."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        return bias
    return {int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k: v for k, v in bias.items()}
