"""Structured outputs: a grammar (JSON schema, regex, choice list, EBNF) compiled into per-token masks.

Compilation and matching are xgrammar's (chosen over llguidance by measured mask time: see BENCHMARKS.md).
The request's side is `picovllm.sampling_params.StructuredOutputsParams` (torch-free). Each request with
`SamplingParams.structured_outputs` holds a `GrammarState` (a matcher over the tokens it has
accepted). When a step is prepared, the state fills a packed bitmask on the host (int32 words, bit j of word i
allows token 32 i + j; a few microseconds for a 49k or 151k vocabulary); the sampler uploads the batch's
bitmasks as one [rows, words] tensor and masks every constrained row at once on the device
(`apply_token_bitmasks`). The host never loops over the vocabulary. When the step's token is known, the engine
advances the state with it.

The mask of step N+1 needs the token of step N. Under overlapped scheduling that token is still on the device
when step N+1 is prepared, so the mask is filled late: the engine launches step N+1's forward, then (while the
device runs it) waits for step N's tokens, advances those requests' grammars and fills their masks, and only then
queues step N+1's sampling (Executor.launch's before_sampling). The host's grammar work overlaps the forward, and
constrained requests decode every step, as without overlap.

Compiled grammars are cached by xgrammar's compiler, one per engine (so per tokenizer), keyed by the grammar text.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Sequence

import torch

from picovllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from picovllm.engine.model_runner import SamplingRow

CACHE_BYTES = 256 << 20   # compiled grammars kept per engine


# Two fixes to xgrammar 0.2.8's JSON grammar, so that every accepted string is JSON (json.loads is the test's
# oracle): a string with minLength/maxLength gets characters [^"\\\r\n], which admits raw control characters;
# and no string character class excludes UTF-16 surrogates (bytes ED A0..BF xx), which are not UTF-8 text.
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_CONTROL_CHARS = ("[^\\0-\\x1f", "[^\\x00-\\x1f")    # how negated string classes start
_NOT_SURROGATES = "\\uD800-\\uDFFF"


def json_schema_grammar(schema_text: str) -> str:
    """The EBNF grammar of a JSON schema's instances: compact (no free whitespace between tokens, which a
    small model would otherwise spend its tokens on), strings of JSON characters only."""
    import xgrammar as xgr
    ebnf = str(xgr.Grammar.from_json_schema(schema_text, any_whitespace=False))
    ebnf = ebnf.replace(_BOUNDED_STRING_CHAR, _CONTROL_CHARS[1] + '\\"\\\\]')
    for start in _CONTROL_CHARS:
        ebnf = ebnf.replace(start, start + _NOT_SURROGATES)
    return ebnf


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One request's matcher: which tokens may come next, advanced with each accepted token."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0     # output tokens accepted so far (the engine may advance it ahead of the output)

    def next_bitmask(self) -> torch.Tensor:
        """[ceil(vocab / 32)] int32 on the host: the tokens the grammar allows next. A new tensor each
        step: the previous one may still be read by a step in flight."""
        import xgrammar as xgr
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self._matcher.fill_next_token_bitmask(mask, 0)
        return mask[0]

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the state is unchanged)."""
        ok = self._matcher.accept_token(token)
        self.num_accepted += ok
        return ok

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end (a stop token) was accepted."""
        return self._matcher.is_terminated()


class StructuredOutputCompiler:
    """Compiles StructuredOutputsParams for one tokenizer (one per engine, built at its first use: the
    tokenizer's token table takes 0.1-0.6 s). Compiled grammars are cached by text."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError("structured outputs need the xgrammar package: pip install 'picovllm[serve]'") from None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_BYTES)
        self.vocab_size = vocab_size

    def compile(self, p: StructuredOutputsParams) -> Any:
        """The compiled grammar; ValueError naming p's field when the schema, regex or grammar is bad."""
        try:
            return self._compile(p)
        except (RuntimeError, ValueError, TypeError) as e:   # xgrammar raises these for bad input
            raise ValueError(f"{p.field_name}: invalid {_WHAT[p.kind]}: {_first_line(e)}") from None

    def _compile(self, p: StructuredOutputsParams) -> Any:
        c = self._compiler
        if p.kind == "json":
            text = p.json if isinstance(p.json, str) else json.dumps(p.json)
            json.loads(text)   # xgrammar's own message for bad JSON text is less clear
            return c.compile_grammar(json_schema_grammar(text))
        if p.kind == "json_object":
            return c.compile_grammar(json_schema_grammar('{"type": "object"}'))
        if p.kind == "regex":
            return c.compile_regex(p.regex)
        if p.kind == "choice":
            return c.compile_grammar(choice_grammar(p.choice))
        return c.compile_grammar(p.grammar)

    def new_state(self, p: StructuredOutputsParams) -> GrammarState:
        import xgrammar as xgr
        return GrammarState(xgr.GrammarMatcher(self.compile(p)), self.vocab_size)


_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
         "choice": "choice list", "grammar": "EBNF grammar"}


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def unpack_bitmask(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 packed bitmasks -> [R, vocab] bool (True: allowed); tokens past 32 W are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = ((packed.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    if bits.shape[1] < vocab:
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]))
    return bits[:, :vocab]


def apply_token_bitmasks(logits: torch.Tensor, rows: Sequence["SamplingRow"]) -> torch.Tensor:
    """logits [B, V] -> `logits` itself if no row is constrained, else a copy with every token a row's
    grammar forbids at -inf: one upload of the stacked bitmasks, one masked_fill on the device."""
    constrained = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
    if not constrained:
        return logits
    dev = logits.device
    packed = torch.stack([rows[i].token_bitmask for i in constrained])
    if dev.type == "cuda":
        packed = packed.pin_memory().to(dev, non_blocking=True)
    allowed = unpack_bitmask(packed.to(dev), logits.shape[-1])
    # Out of place either way: the raw logits stay as they are (logprobs are read from them).
    if len(constrained) == len(rows):   # one pass over the logits, no copy first
        return torch.where(allowed, logits, float("-inf"))
    idx = torch.tensor(constrained, device=dev)
    out = logits.clone()
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out
