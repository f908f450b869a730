"""Structured outputs: a grammar (JSON schema, regex, choice list, EBNF, structural tag) compiled into per-token masks.

Compilation and matching are xgrammar's (chosen over llguidance by measured mask time: see BENCHMARKS.md).
The request's side is `picovllm.sampling_params.StructuredOutputsParams` (torch-free). Each request with
`SamplingParams.structured_outputs` holds a `GrammarState` (a matcher over the tokens it has accepted). A step's
masks live in one preallocated host buffer for the whole batch (`BitmaskBuffers`: int32 words, bit j of word i
allows token 32 i + j; pinned for a CUDA device): xgrammar fills the constrained rows in place, several at once
(`TokenBitmasks.fill`, a few microseconds a row for a 49k or 151k vocabulary), the buffer goes to the device in
one copy, and one masked minimum applies every constrained row (`apply_token_bitmasks`, `mask_logits`). The host
never loops over the vocabulary, and a row costs no tensor of its own. When the step's token is known, the
engine advances the state with it.

The mask of step N+1 needs the token of step N. Under overlapped scheduling that token is still on the device
when step N+1 is prepared, so the mask is filled late: the engine launches step N+1's forward, then (while the
device runs it) waits for step N's tokens, advances those requests' grammars and fills their masks, and only then
queues step N+1's sampling (Executor.launch's before_sampling). The host's grammar work overlaps the forward, and
constrained requests decode every step, as without overlap.

Compiled grammars are cached by xgrammar's compiler, one per engine (so per tokenizer), keyed by the grammar text
(a structural tag's: its JSON text; xgrammar compiles it itself, its JSON schemas with xgrammar's own layout, free
whitespace included, as vLLM's).

With a reasoning parser (EngineConfig.reasoning_parser, vLLM's --reasoning-parser, for every request; or the
request's StructuredOutputsParams.reasoning_parser, which the OpenAI front ends set, so that P and D engines need no
flag) a thinking model reasons first and the grammar governs the answer after it, as vLLM does: a gate (`ThinkTags`:
the `<think>` and `</think>` token ids) on the GrammarState keeps its matcher out of the way while the model
reasons. The prompt sets where it starts (`ThinkTags.phase`, picovllm/reasoning.py): inside a block the prompt
opened (DeepSeek-R1's template: no mask until `</think>`), after a block the prompt closed (Qwen3 with
thinking off: the grammar from the first token), or at a first token that may open one (Qwen3's template: the
grammar's mask plus `<think>`). GPT-OSS's gate (`HarmonyTags`, --reasoning-parser openai_gptoss; the chat server
sets it for a harmony model's chat) holds the grammar back until a `<|channel|>final ... <|message|>` header: analysis
and commentary messages, headers included, pass, and the final message's body is the grammar's.
"""
from __future__ import annotations

import functools
import json
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from picovllm.kernels import use_triton
from picovllm.kernels.cpu import token_mask
from picovllm.reasoning import ANSWER as GRAMMAR, MAY_OPEN, REASONING, HarmonyTags, ThinkTags
from picovllm.sampling_params import StructuredOutputsParams

CACHE_BYTES = 256 << 20   # compiled grammars kept per engine
SCHEMA_GRAMMAR_CHARS = 64 << 20   # JSON schemas' grammar texts kept per engine (StructuredOutputCompiler._json_grammar)
# Threads of xgrammar's batched mask fill. One: on a 2-core host a second thread added ~40 us a call and saved
# nothing, and on the H200's 16-core host eight threads did not raise the constrained rate at batch 64 (20.4k tok/s
# against 37.7k plain, -46%; one thread, the call before: -41%, BENCHMARKS.md). The fill is host work between a
# step's forward and its sampling: 6.6 us a regex row on one thread there. Why more lose: with N > 1, xgrammar 0.2.8
# starts its N threads on every call (~70-100 us a call on a 2-core host, a 1-row fill included, against ~1 us a row
# on one). --fill-threads N of benchmarks/structured_output.py measures it.
FILL_THREADS = 1


# Two fixes to xgrammar 0.2.8's JSON grammar, so that every accepted string is JSON (json.loads is the test's
# oracle): a string with minLength/maxLength gets characters [^"\\\r\n], which admits raw control characters;
# and no string character class excludes UTF-16 surrogates (bytes ED A0..BF xx), which are not UTF-8 text.
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_CONTROL_CHARS = ("[^\\0-\\x1f", "[^\\x00-\\x1f")    # how negated string classes start
_NOT_SURROGATES = "\\uD800-\\uDFFF"


_HEX_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9A-Fa-f]{2})")     # \xHH not after an escaped backslash


# JSON-schema keywords xgrammar 0.2.8 does not enforce (its grammar admits instances they reject; each checked
# against jsonschema): refused, as vLLM's xgrammar backend refuses them, rather than ignored
_UNENFORCED = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
               "dependentRequired", "dependentSchemas", "dependencies")
# the string formats xgrammar 0.2.8 turns into a grammar (any other, "regex", "idn-email", "iri", ..., gives any
# string): vLLM's xgrammar backend refuses the others (STRING_SUPPORTED_FORMATS)
_FORMATS = ("email", "hostname", "ipv4", "ipv6", "uri", "uri-reference", "uri-template", "json-pointer",
            "relative-json-pointer", "date", "time", "date-time", "duration", "uuid")
# a lookaround "(?=", "(?!", "(?<=", "(?<!" not after an escaping backslash: xgrammar 0.2.8 ignores it in a schema's
# pattern with a warning ("^(?!ab)[a-c]{2}$" admitted "ab"); "(?:" and "(?P<name>" it reads right, inline flags it
# refuses (a 400 from the compile)
_LOOKAROUND = re.compile(r"(?<!\\)(?:\\\\)*\(\?(?:=|!|<=|<!)")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_JSON_TYPES = {"string": str, "object": dict, "array": list, "boolean": bool, "null": type(None)}
# keywords that constrain an instance (beside $ref or anyOf/oneOf, xgrammar drops them)
_CONSTRAINTS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength",
                "pattern", "format", "minItems", "maxItems", "items", "prefixItems", "properties", "required",
                "additionalProperties", "minProperties", "maxProperties", "enum", "const")


def unenforced_keyword(schema: Any, path: str = "") -> str | None:
    """The first keyword of a JSON schema (where: a JSON pointer) the grammar would not enforce, or None. Walks the
    schema's subschemas only (a property named "not" is a name, not a keyword)."""
    if not isinstance(schema, dict):
        return None
    for key in _UNENFORCED:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            return f"{key} at {path or '/'}"
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        return f"{'pattern' if 'pattern' in schema else 'format'} with minLength/maxLength at {path or '/'}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"allOf of {len(schema['allOf'])} schemas at {path or '/'}"
    for key in ("$ref", "anyOf", "oneOf", "allOf"):    # xgrammar takes the reference or the branches, drops the rest
        beside = [k for k in _CONSTRAINTS + ("type",) if k in schema]
        if key in schema and beside:
            return f"{key} beside {beside[0]} at {path or '/'}"
    found = _unenforced_here(schema, path or "/")
    if found is not None:
        return found
    subs = [(f"{path}/{k}", schema[k]) for k in ("items", "additionalProperties", "propertyNames",
                                                  "unevaluatedProperties", "unevaluatedItems") if k in schema]
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            subs += [(f"{path}/{key}/{name}", sub) for name, sub in schema[key].items()]
    for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            subs += [(f"{path}/{key}/{i}", sub) for i, sub in enumerate(schema[key])]
    for where, sub in subs:
        found = unenforced_keyword(sub, where)
        if found is not None:
            return found
    return None


def _unenforced_here(schema: dict, where: str) -> str | None:
    """unenforced_keyword's checks of one schema's own keywords that xgrammar 0.2.8 accepts and then ignores (each
    found admitting instances jsonschema rejects)."""
    if "multipleOf" in schema:     # xgrammar keeps an integer multiple only without bounds; a number's never
        m = schema["multipleOf"]
        if not (schema.get("type") == "integer" and isinstance(m, int) and not isinstance(m, bool)
                and not any(k in schema for k in _BOUNDS)):
            return f"multipleOf at {where} (only an integer's whole multipleOf without bounds)"
    for key in ("enum", "const"):   # xgrammar writes the values out and drops every other constraint beside them
        if key not in schema:
            continue
        beside = [k for k in _CONSTRAINTS if k in schema and k not in ("enum", "const")]
        if beside:
            return f"{key} beside {beside[0]} at {where}"
        values = schema["enum"] if key == "enum" and isinstance(schema["enum"], list) else [schema.get(key)]
        if "type" in schema and not all(_has_type(v, schema["type"]) for v in values):
            return f"{key} beside type {schema['type']!r} (a value of another type) at {where}"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f"$ref {ref!r} at {where} (only references within the schema, '#' or '#/...')"
    fmt, kind = schema.get("format"), schema.get("type")
    # (a format on another type, e.g. OpenAPI's "int32" on an integer, constrains nothing: JSON Schema applies formats
    # to strings, as vLLM's check does)
    if fmt is not None and fmt not in _FORMATS and (kind == "string" or isinstance(kind, list) and "string" in kind):
        return f"format {fmt!r} at {where}"
    patterns = [("pattern", schema["pattern"])] if isinstance(schema.get("pattern"), str) else []
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [("patternProperties", p) for p in schema["patternProperties"]]
    for key, pattern in patterns:
        if _LOOKAROUND.search(pattern):
            return f"{key} {pattern!r} with a lookaround at {where}"
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required")
    if isinstance(required, list):     # xgrammar makes only the properties it lists; it drops a required other one
        missing = [r for r in required if isinstance(r, str) and r not in props]   # (not a name: xgrammar's 400)
        if missing:
            return f"required {missing[0]!r} not in properties at {where}"
    if props and "propertyNames" in schema:     # xgrammar applies propertyNames to the other properties only
        return f"propertyNames beside properties at {where}"
    if props and isinstance(schema.get("patternProperties"), dict):   # and patternProperties to the others only
        for p in schema["patternProperties"]:
            try:
                hit = next((name for name in props if re.search(p, name)), None)
            except re.error:
                hit = None
            if hit is not None:
                return f"patternProperties {p!r} matching property {hit!r} at {where}"
    return None


def _has_type(value: Any, types: Any) -> bool:
    """Whether a JSON value is of the schema's type (a name or a list of names; a type that is neither is not this
    check's to refuse: True)."""
    for t in types if isinstance(types, list) else [types]:
        if not isinstance(t, str):
            return True
        if t in ("integer", "number"):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                    t == "number" or isinstance(value, int) or value.is_integer()):   # (no float(): 10**400)
                return True
        elif t in _JSON_TYPES and isinstance(value, _JSON_TYPES[t]):
            return True
    return False


def json_schema_grammar(schema_text: str) -> str:
    """The EBNF grammar of a JSON schema's instances: compact (no free whitespace between tokens, which a
    small model would otherwise spend its tokens on), strings of JSON characters only."""
    import xgrammar as xgr
    ebnf = str(xgr.Grammar.from_json_schema(schema_text, any_whitespace=False))
    ebnf = ebnf.replace(_BOUNDED_STRING_CHAR, _CONTROL_CHARS[1] + '\\"\\\\]')
    for start in _CONTROL_CHARS:
        ebnf = ebnf.replace(start, start + _NOT_SURROGATES)
    # xgrammar prints a character as \xHH and reads \x greedily back ("\xb0C", the schema's "°C", as U+0B0C): \u00HH
    # reads exactly four digits
    return _HEX_ESCAPE.sub(lambda m: f"{m.group(1)}\\u00{m.group(2)}", ebnf)


def structural_tag_text(text: str) -> str:
    """A structural tag's JSON text as xgrammar 0.2.8's compile_structural_tag takes it: {"type": "structural_tag",
    "format": ...} as it is, the older {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]} converted
    (vLLM's xgrammar backend tells them apart the same way: by "structures"). ValueError on anything else, and on a
    JSON schema in it with a keyword xgrammar would not enforce (as for `json`)."""
    import xgrammar as xgr
    tag = json.loads(text)
    if not isinstance(tag, dict):
        raise ValueError("a structural tag is a JSON object")
    if "structures" not in tag:
        _check_schemas(tag.get("format"), "/format")
        return text
    structures, triggers = tag["structures"], tag.get("triggers")
    if not (isinstance(structures, list) and structures and isinstance(triggers, list) and triggers
            and all(isinstance(t, str) for t in triggers)):
        raise ValueError("structures and triggers must be non-empty lists (triggers of strings)")
    items = []
    for i, s in enumerate(structures):
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), dict)):
            raise ValueError(f"structures[{i}] must be an object with strings begin and end and a JSON schema object")
        _refuse_unenforced(s["schema"], f"/structures/{i}/schema")
        items.append(xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"]))
    # (the same JSON text for the same tag: the compiler's cache is keyed by it)
    return xgr.StructuralTag.from_legacy_structural_tag(items, triggers).model_dump_json(indent=None)


def _check_schemas(fmt: Any, path: str) -> None:
    """ValueError naming the first keyword xgrammar would not enforce in a JSON schema of a structural tag's format
    (its json_schema formats, however deep in sequences, tags and alternatives)."""
    if isinstance(fmt, list):
        for i, sub in enumerate(fmt):
            _check_schemas(sub, f"{path}/{i}")
        return
    if not isinstance(fmt, dict):
        return
    if fmt.get("type") == "json_schema":
        _refuse_unenforced(fmt.get("json_schema"), f"{path}/json_schema")
        return
    for key, sub in fmt.items():
        _check_schemas(sub, f"{path}/{key}")


def _refuse_unenforced(schema: Any, path: str) -> None:
    found = unenforced_keyword(schema, path)
    if found is not None:
        raise ValueError(f"{found}: the grammar backend (xgrammar) does not enforce it")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One request's matcher: which tokens may come next, advanced with each accepted token. With a gate, the
    tokens of a think block before the answer pass it by (phase: module docstring)."""

    def __init__(self, matcher: Any, vocab_size: int, gate: ThinkTags | HarmonyTags | None = None,
                 phase: str = GRAMMAR, progress: int = 0) -> None:
        self._matcher = matcher   # xgrammar's matcher (the tests' oracle calls: accept_string, one-row fills)
        # what the batched calls take: xgrammar's native matcher (its Python wrappers look it up per call), or the
        # matcher itself where that private handle is not there (_native)
        self.handle = native_handle(matcher)
        self._stops = frozenset(matcher.stop_token_ids)
        self.vocab_size = vocab_size
        self.num_accepted = 0     # output tokens accepted so far (the engine may advance it ahead of the output)
        # the grammar is complete and its end (a stop token) was accepted: kept here, not asked of the matcher
        # per token, since only a stop token can end it (two calls into xgrammar a row a step fewer)
        self.is_terminated = False
        self.gate, self.phase = gate, phase if gate is not None else GRAMMAR
        self._progress = progress     # the gate's own count (HarmonyTags: how far into a final header so far)

    @property
    def masked(self) -> bool:
        """Whether its next token has a mask (not inside a think block)."""
        return self.phase != REASONING

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the state is unchanged)."""
        if self.phase != GRAMMAR:     # a token of the reasoning passes the grammar by; the phase moves on with it
            passes, phase, progress = self.gate.advance(self.phase, self._progress, token)
            if passes:
                self.phase, self._progress = phase, progress
                self.num_accepted += 1
                return True
        if not self.handle.accept_token(token, False):
            return False
        self.phase = GRAMMAR
        self._took(token)
        return True

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """Speculative decoding: the longest prefix of drafts the grammar takes after what it has taken, stopping
        before a stop token (no mask follows the grammar's end); the state is unchanged. [] unless the grammar itself
        governs the next token (not inside a think block)."""
        if self.phase != GRAMMAR or self.is_terminated:
            return []
        n = 0
        for token in drafts:
            if token in self._stops or not self.handle.accept_token(token, False):
                break
            n += 1
        if n:
            self.handle.rollback(n)
        return drafts[:n]

    def fill_ahead(self, masks: "TokenBitmasks", row: int, drafts: list[int]) -> None:
        """Rows row .. row + len(drafts) of masks := what the grammar allows next after drafts[:i] (valid_drafts':
        each is taken); the state is unchanged."""
        masks.fill([row], [self])
        for i, token in enumerate(drafts):
            taken = self.handle.accept_token(token, False)
            assert taken, (token, drafts)
            masks.fill([row + 1 + i], [self])
        if drafts:
            self.handle.rollback(len(drafts))

    def _took(self, token: int) -> None:
        """Bookkeeping after the matcher accepted `token`."""
        self.num_accepted += 1
        if token in self._stops:
            self.is_terminated = self.handle.is_terminated()

    @staticmethod
    def accept_all(states: list[GrammarState], tokens: list[int]) -> list[bool]:
        """states[i].accept(tokens[i]) for every i, in one call into xgrammar: whether each was accepted."""
        return GrammarState._accept_batch(states, tokens)[0]

    @staticmethod
    def _accept_batch(states: list[GrammarState], tokens: list[int]) -> tuple[list[bool], list | None]:
        """accept_all's verdicts, and the states' handles if every state took its token, is in its grammar and has
        not ended (each then has a mask to fill: TokenBitmasks.accept_and_fill), else None."""
        handles = [s.handle for s in states if s.phase == GRAMMAR]
        if len(handles) < len(states):      # a think block's tokens (few states, seldom): one by one
            return [s.accept(t) for s, t in zip(states, tokens)], None
        if not handles:
            return [], handles
        result = _batch_accept()(handles, tokens, False)
        # an array of xgrammar's whose elements cost ~0.5 us each to read: one `in` (native) for the usual case
        if 0 in result:
            accepted = [bool(a) for a in result]
            for s, token, ok in zip(states, tokens, accepted):
                if ok:
                    s._took(token)
            return accepted, None
        for s, token in zip(states, tokens):
            s._took(token)
        ended = any(s.is_terminated for s in states)
        return [True] * len(states), None if ended else handles


@functools.lru_cache(maxsize=1)
def _native() -> bool:
    """Whether xgrammar's native batched calls are reachable through its private `_handle`s (they are in 0.2.8,
    which constraints.txt pins). Without them (another version) the public calls serve, a little slower: the
    masks and verdicts are the same (tests/test_structured_output.py)."""
    import xgrammar as xgr
    batch = getattr(xgr.BatchGrammarMatcher(1), "_handle", None)
    return all(hasattr(batch, m) for m in ("batch_fill_next_token_bitmask", "batch_accept_token"))


def native_handle(matcher: Any) -> Any:
    """What GrammarState.handle holds: the native matcher, with the calls it is used for, or the matcher."""
    handle = getattr(matcher, "_handle", None)
    usable = _native() and all(hasattr(handle, m) for m in ("accept_token", "is_terminated"))
    return handle if usable else matcher


@functools.lru_cache(maxsize=1)
def _batch_accept() -> Any:
    """xgrammar's native batch_accept_token: its Python wrapper (BatchGrammarMatcher.batch_accept_token) turns the
    result into a list element by element, which costs more than it saves over one accept_token a row. The
    wrapper where the native call is not reachable."""
    import xgrammar as xgr
    if _native():
        return type(xgr.BatchGrammarMatcher(1)._handle).batch_accept_token
    return xgr.BatchGrammarMatcher.batch_accept_token


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
        self._schema_grammars: OrderedDict[str, str] = OrderedDict()   # JSON schema text -> grammar, newest last
        self._schema_chars = 0             # the characters of _schema_grammars' keys and values
        self._lock = threading.Lock()      # a server compiles on a thread of its own, then adds on the engine's

    def compile(self, p: StructuredOutputsParams) -> Any:
        """The compiled grammar; ValueError naming p's field when the schema, regex or grammar is bad."""
        try:
            return self._compile(p)
        except (RuntimeError, ValueError, TypeError) as e:   # xgrammar (and pydantic, under it) raise these
            raise ValueError(f"{p.field_name}: invalid {_WHAT[p.kind]}: {_first_line(e)}") from None

    def _compile(self, p: StructuredOutputsParams) -> Any:
        c = self._compiler
        if p.kind == "json":
            return c.compile_grammar(self._json_grammar(p.json if isinstance(p.json, str) else json.dumps(p.json)))
        if p.kind == "json_object":
            return c.compile_grammar(self._json_grammar('{"type": "object"}'))
        if p.kind == "regex":
            return c.compile_regex(p.regex)
        if p.kind == "choice":
            return c.compile_grammar(choice_grammar(p.choice))
        if p.kind == "structural_tag":
            return c.compile_structural_tag(structural_tag_text(p.structural_tag))
        return c.compile_grammar(p.grammar)

    def _json_grammar(self, schema_text: str) -> str:
        """json_schema_grammar(schema_text), kept (SCHEMA_GRAMMAR_CHARS of them, the newest): xgrammar's cache holds
        compiled grammars by their text, not this conversion to it, which is most of a deep schema's compile (3.0 of
        3.2 s for 400 nested arrays) and which the request's add would otherwise do again on the engine's thread
        after a server compiled it on its own (AsyncEngine), stalling every request; and again for each of n
        samples. A schema kept was checked when it was converted (_refuse_unenforced), so it is not checked again."""
        with self._lock:
            grammar = self._schema_grammars.get(schema_text)
            if grammar is not None:
                self._schema_grammars.move_to_end(schema_text)
                return grammar
        _refuse_unenforced(json.loads(schema_text), "")     # (xgrammar's own message for bad JSON text is less clear)
        grammar = json_schema_grammar(schema_text)
        with self._lock:
            kept = self._schema_grammars
            if schema_text not in kept:         # (another thread may have converted it meanwhile)
                kept[schema_text] = grammar
                self._schema_chars += len(schema_text) + len(grammar)
            while len(kept) > 1 and self._schema_chars > SCHEMA_GRAMMAR_CHARS:
                k, v = kept.popitem(last=False)
                self._schema_chars -= len(k) + len(v)
        return grammar

    def new_state(self, p: StructuredOutputsParams, gate: ThinkTags | HarmonyTags | None = None,
                  phase: str = GRAMMAR, progress: int = 0) -> GrammarState:
        """A matcher at the grammar's start; ValueError naming p's field for a grammar no text matches (a $ref
        cycle without a base case, 'root ::= root "a"', an empty regex class): no token may start it, and the
        request would only fail at its first token."""
        import xgrammar as xgr
        matcher = xgr.GrammarMatcher(self.compile(p))
        first = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(first)
        if not first.any():
            raise ValueError(f"{p.field_name}: the {_WHAT[p.kind]} matches no text (no token may begin it)")
        return GrammarState(matcher, self.vocab_size, gate, phase, progress)


_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
         "choice": "choice list", "grammar": "EBNF grammar", "structural_tag": "structural tag"}


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def _signed_bit(bit: int) -> int:
    """Bit `bit` of an int32 word, as the int32 value it has alone (bit 31 is the sign)."""
    return (1 << bit) - (1 << 32 if bit == 31 else 0)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class TokenBitmasks:
    """One step's grammar masks on the host: row i of `words` ([sampling rows, words] int32, a view of one of
    BitmaskBuffers' buffers) is sampling row i's. Only the rows in `filled` are applied; the others hold
    whatever an earlier step left there."""

    def __init__(self, words: torch.Tensor, owner: "BitmaskBuffers", slot: int) -> None:
        self.words = words
        self.filled: list[int] = []
        self._owner, self._slot = owner, slot

    def fill(self, rows: list[int], states: list[GrammarState]) -> None:
        """Row rows[i] := the tokens states[i] allows next: one call into xgrammar for all of them."""
        if rows:
            self._owner.fill_rows([s.handle for s in states], self.words, rows)
            self.filled.extend(rows)
            for row, s in zip(rows, states):
                if s.phase == MAY_OPEN:      # the first token may open a think block instead
                    word, bit = divmod(s.gate.start, 32)
                    self.words[row, word] |= _signed_bit(bit)

    def accept_and_fill(self, rows: list[int], states: list[GrammarState], tokens: list[int]) -> None:
        """states[i] takes tokens[i] (GrammarState.accept_all), then row rows[i] := what it allows next, unless it
        refused the token, ended with it or is inside a think block (that row stays unfilled). Two calls into
        xgrammar, and no Python a row beyond the accept's count, where every state goes on in its grammar."""
        accepted, handles = GrammarState._accept_batch(states, tokens)
        if handles is None:
            keep = [k for k, s in enumerate(states) if accepted[k] and s.masked and not s.is_terminated]
            self.fill([rows[k] for k in keep], [states[k] for k in keep])
        elif rows:      # (no state in a gate's MAY_OPEN phase: each is in its grammar)
            self._owner.fill_rows(handles, self.words, rows)
            self.filled.extend(rows)

    def word_rows(self) -> list[int]:
        """For each sampling row, its row of `words` if filled, else -1 (left as it is)."""
        rows = [-1] * self.words.shape[0]
        for i in self.filled:
            rows[i] = i
        return rows

    def to_device(self, device: torch.device) -> torch.Tensor:
        """The words on the device (the buffer itself on the CPU; one non-blocking copy to a GPU, after which
        the buffer is not refilled until the copy is done)."""
        if device.type != "cuda":
            return self.words
        return self._owner.upload(self._slot, self.words, device)

    def ceilings(self, dtype: torch.dtype) -> torch.Tensor:
        return self._owner.ceilings(dtype)


class BitmaskBuffers:
    """The host buffers a step's masks are filled into: two, used in turn, so that step N + 1 (prepared while
    step N is in flight) never writes into the buffer step N's copy reads; a CUDA event recorded after each
    copy is waited for (it has nearly always passed) before that buffer is filled again. One per engine."""

    def __init__(self, vocab_size: int, device: torch.device, fill_threads: int | None = None) -> None:
        import xgrammar as xgr
        # the native call, on GrammarState.handle: xgrammar's wrapper rebuilds the list of handles each call
        batch = xgr.BatchGrammarMatcher(fill_threads or FILL_THREADS)
        self._fill = (batch._handle if _native() else batch).batch_fill_next_token_bitmask
        self.words = bitmask_words(vocab_size)
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]   # each slot's one event, after each upload
        self._device_buffers: list[torch.Tensor | None] = [None, None]
        self._next = 0
        self._ceilings: dict[torch.dtype, torch.Tensor] = {}    # the masked apply's table, by logits dtype

    def for_step(self, num_rows: int) -> TokenBitmasks:
        """The masks of a step with num_rows sampling rows, none filled yet."""
        slot, self._next = self._next, 1 - self._next
        if self._events[slot] is not None:      # its last upload (nearly always done): then the buffer is free
            self._events[slot].synchronize()
        buf = self._buffers[slot]
        if buf is None or buf.shape[0] < num_rows:
            rows = max(64, 1 << (num_rows - 1).bit_length())
            buf = torch.empty(rows, self.words, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self._buffers[slot] = buf
        return TokenBitmasks(buf[:num_rows], self, slot)

    def fill_rows(self, handles: list, words: torch.Tensor, rows: list[int]) -> None:
        """Row rows[i] of words := the mask of the matcher handles[i] (GrammarState.handle) allows next."""
        self._fill(handles, words, rows, False)

    def ceilings(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._ceilings:
            self._ceilings[dtype] = token_ceilings(dtype, self.device)
        return self._ceilings[dtype]

    def upload(self, slot: int, words: torch.Tensor, device: torch.device) -> torch.Tensor:
        """words (a view of slot's host buffer) copied into slot's device buffer, without blocking; an event after
        the copy guards the host buffer's refill (for_step). The device buffer is reused in stream order."""
        dev = self._device_buffers[slot]
        if dev is None or dev.shape[0] < words.shape[0] or dev.device != device:
            dev = self._device_buffers[slot] = torch.empty(self._buffers[slot].shape, dtype=torch.int32, device=device)
        out = dev[:words.shape[0]]
        out.copy_(words, non_blocking=True)
        if self._events[slot] is None:
            self._events[slot] = torch.cuda.Event()
        self._events[slot].record()
        return out


def token_ceilings(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: entry (b, k) is +inf if bit k of byte b is set, else -inf; min(logit, ceiling) masks."""
    bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    return torch.where(bits.bool(), float("inf"), float("-inf")).to(dtype)


def mask_logits(logits: torch.Tensor, words: torch.Tensor, ceilings: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] with every token the packed masks words [R, W] (int32) forbid at -inf, as a new tensor;
    tokens past 32 W are forbidden. The words are read as little-endian bytes (token t is bit t % 8 of byte
    t // 8), each byte looked up in `ceilings` (token_ceilings) and the logits clipped from above: one gather
    and one minimum, with no [R, W, 32] intermediate. The reference, and the path on a GPU (float32 logits on
    the CPU take kernels/cpu/token_mask.c)."""
    assert sys.byteorder == "little"    # the hosts and GPUs we run on; the byte view relies on it
    if ceilings is None or ceilings.dtype != logits.dtype or ceilings.device != logits.device:
        ceilings = token_ceilings(logits.dtype, logits.device)
    r, vocab = logits.shape
    per_token = torch.nn.functional.embedding(words.contiguous().view(torch.uint8).long(), ceilings).view(r, -1)
    if per_token.shape[1] < vocab:
        per_token = torch.nn.functional.pad(per_token, (0, vocab - per_token.shape[1]), value=float("-inf"))
    return torch.minimum(logits, per_token[:, :vocab])


def device_masks(masks: TokenBitmasks, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the Triton kernels take (kernels/token_mask.py, the fused sampler): the step's mask words on `device`,
    and each sampling row's words row (-1: not constrained) unless every row is constrained."""
    words = masks.to_device(device)
    if len(masks.filled) == masks.words.shape[0]:
        return words, None
    rows = torch.tensor(masks.word_rows(), dtype=torch.int32, pin_memory=device.type == "cuda")
    return words, rows.to(device, non_blocking=True)


def apply_token_bitmasks(logits: torch.Tensor, masks: TokenBitmasks | None) -> torch.Tensor:
    """logits [B, V] -> `logits` itself if no row is constrained, else a copy with every token a row's
    grammar forbids at -inf: one upload of the step's mask buffer, then one kernel on a GPU (kernels/token_mask.py).
    Out of place either way: the raw logits stay as they are (the logprobs mask them on their own: engine/sampling.py,
    _logprob_tensors)."""
    if masks is None or not masks.filled:
        return logits
    if token_mask.usable(logits):      # CPU, float32: one pass in C
        return token_mask.mask_logits(logits, masks.words, masks.word_rows())
    if use_triton(logits):     # one kernel, whichever rows are constrained
        from picovllm.kernels import token_mask as triton_mask
        return triton_mask.mask_logits(logits, *device_masks(masks, logits.device))
    words = masks.to_device(logits.device)
    ceilings = masks.ceilings(logits.dtype)
    if len(masks.filled) == logits.shape[0]:
        return mask_logits(logits, words, ceilings)
    idx = torch.tensor(masks.filled, device=logits.device)
    out = logits.clone()
    out[idx] = mask_logits(logits[idx], words[idx], ceilings)
    return out
