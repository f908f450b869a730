"""Tool calling for /v1/chat/completions: tools into the prompt, calls out of the output.

The prompt: the tools go through the model's chat template (apply_chat_template(tools=...)) when the template
uses them; otherwise a system message describes them and the Hermes format to call them in.

The calls' format (vLLM's --tool-call-parser; by default the one the model's tokenizer and template speak):
- hermes (Qwen-family and other Hermes-style templates, and the system-message fallback):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks;
- glm45 (GLM-4.5 to 4.7's templates): `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`
  blocks (newlines between or not), a value taken as text where the tool's schema says string, else as JSON where
  it parses; the server keeps the special tokens in the text for it;
- qwen3_coder (Qwen3-Coder's template): `<tool_call><function=NAME><parameter=K>V</parameter>...</function>
  </tool_call>` blocks, a value's one leading and trailing newline dropped, then read as glm45's are;
- llama3_json (Llama 3.1-3.3's templates): the output is one or more `{"name": ..., "parameters": {...}}` objects
  (or "arguments"), `; ` between them, after an optional `<|python_tag|>`;
- mistral (a tokenizer with a `[TOOL_CALLS]` token): `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}, or
  (the newer tokenizers') `[TOOL_CALLS]NAME[ARGS]{...}` (or `NAME[CALL_ID]ID[ARGS]{...}`) for each call, ids of 9
  letters and digits (Mistral's templates refuse others); the server keeps the special tokens in the
  text for it;
- the section formats (SECTION_FORMATS; their markers are special tokens, kept in the text for the parser): a calls
  section opens, then each call between its own markers: deepseek_v3 (DeepSeek-V3, R1-0528: a tokenizer with a
  `<｜tool▁calls▁begin｜>` token) `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`;
  deepseek_v31 (DeepSeek-V3.1: that token and a template that writes NAME right after `<｜tool▁call▁begin｜>`)
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`; kimi_k2 (a `<|tool_calls_section_begin|>` token)
  `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`, the call's id
  `functions.NAME:IDX` as the model wrote it (vLLM's). Where no call comes, the content is the text without the
  format's markers (what skip_special_tokens would have shown).

The output, by tool_choice:
- "auto": free text; each call whose JSON names a given tool with an object for arguments becomes a call, the
  text before the first one is the content, trailing whitespace dropped (a call that does not parse stays
  content: never a call with broken arguments). Streamed (AutoToolStream), the content goes out as it is
  generated; a call of the block and section formats (hermes, glm45, qwen3_coder; deepseek_v3, deepseek_v31,
  kimi_k2) as soon as its block closes, llama3_json's and mistral's calls when the output ends;
- "required": the output is constrained (structured outputs) to a JSON array of one or more
  {"name", "arguments"} objects, each one's arguments by that function's parameter schema;
- a named function: the output is constrained to that function's arguments (its parameter schema);
- "none" (or no tools): the tools are left out of the prompt and the output is plain content.
So under "required" and a named function the arguments always parse and validate.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from picovllm.sampling_params import StructuredOutputsParams

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
ANY_OBJECT = {"type": "object"}
TOOL_PARSERS = ("hermes", "glm45", "llama3_json", "mistral", "qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2")
GLM_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
GLM_ARG_RE = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
CODER_FUNCTION_RE = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
CODER_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
BLOCK_PARSERS = ("hermes", "glm45", "qwen3_coder")     # <tool_call> blocks, each call as soon as it closes
PYTHON_TAG, MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# Mistral's chat templates refuse a tool call id that is not 9 letters and digits (the next turn's): its calls get such
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def without_markers(text: str, markers: Sequence[str]) -> str:
    """text as the client may see it: a format's markers (special tokens, kept in the text for its parser) out, as
    skip_special_tokens would have shown it."""
    for marker in markers:
        text = text.replace(marker, "")
    return text


@dataclass(frozen=True)
class SectionFormat:
    """A format whose calls stand in a section: `begin`, then each call's inside between `call_begin` and
    `call_end`, then `end`. Its markers are special tokens of the model's tokenizer."""
    begin: str
    end: str
    call_begin: str
    call_end: str
    sep: str             # between a call's name and its arguments

    @property
    def markers(self) -> tuple[str, ...]:
        return self.begin, self.end, self.call_begin, self.call_end, self.sep

    @property
    def call_re(self) -> re.Pattern:
        """A complete call: its inside is group 1."""
        return re.compile(re.escape(self.call_begin) + "(.*?)" + re.escape(self.call_end), re.DOTALL)

    def without_markers(self, text: str) -> str:
        return without_markers(text, self.markers)

    def content_end(self, text: str) -> int:
        """Where the content of a text still growing may end: at its first marker, or where one may be starting."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else len(text) - max(partial_tag(text, m) for m in self.markers)


DEEPSEEK = dict(begin="<｜tool▁calls▁begin｜>", end="<｜tool▁calls▁end｜>", call_begin="<｜tool▁call▁begin｜>",
                call_end="<｜tool▁call▁end｜>", sep="<｜tool▁sep｜>")
SECTION_FORMATS = {
    "deepseek_v3": SectionFormat(**DEEPSEEK),       # function<｜tool▁sep｜>NAME\n```json\n{...}\n```
    "deepseek_v31": SectionFormat(**DEEPSEEK),      # NAME<｜tool▁sep｜>{...}
    "kimi_k2": SectionFormat(begin="<|tool_calls_section_begin|>", end="<|tool_calls_section_end|>",
                             call_begin="<|tool_call_begin|>", call_end="<|tool_call_end|>",
                             sep="<|tool_call_argument_begin|>"),     # functions.NAME:IDX<|...|>{...}
}
DEEPSEEK_V3_CALL_RE = re.compile(r"\s*function\s*<｜tool▁sep｜>\s*([^\n`]+?)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)
KIMI_ID_RE = re.compile(r"(?:functions\.)?(.+):\d+")
# the formats whose markers are special tokens: the server keeps them in the text for the parser
SPECIAL_MARKER_PARSERS = ("mistral", "glm45", *SECTION_FORMATS)


@dataclass
class ToolCall:
    name: str
    arguments: str        # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# the sources of ToolPolicy.constraint's structured outputs (a named function's, tool_choice "required"'s)
TOOLS_SOURCES = ("tool_choice", "tools")


@dataclass
class ToolPolicy:
    """What a request's tools and tool_choice ask for. mode: none, auto, required or named (then `named`)."""
    tools: list[dict]             # OpenAI tool objects: {"type": "function", "function": {name, parameters, ...}}
    mode: str
    named: str | None = None
    parallel: bool = True         # parallel_tool_calls: false -> at most one call
    parser: str = "hermes"        # the calls' format under "auto" (TOOL_PARSERS)
    # the ids of the calls made here: "openai" (call_...), "mistral" (9 letters and digits: Mistral's templates take
    # no others) or "kimi" (functions.NAME:IDX, IDX counting the conversation's calls: calls_before, then these)
    id_style: str = "openai"
    calls_before: int = 0         # "kimi": the tool calls of the request's earlier assistant messages

    def new_call(self, name: str, arguments: str, index: int = 0) -> ToolCall:
        """The index-th call of this reply, with a new id of the request's id_style."""
        call = ToolCall(name, arguments)
        if self.id_style == "mistral":
            call.id = uuid.uuid4().hex[:9]
        elif self.id_style == "kimi":
            call.id = f"functions.{name}:{self.calls_before + index}"
        return call

    @property
    def functions(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def active(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output that makes the reply a valid call (required, named: its source one of
        TOOLS_SOURCES), else None."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self._parameters(self.named), source=TOOLS_SOURCES[0])
        if self.mode != "required":
            return None
        calls = [{"type": "object", "required": ["name", "arguments"],
                  "properties": {"name": {"const": n}, "arguments": self._parameters(n)}} for n in self.functions]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, source=TOOLS_SOURCES[1])

    def finish_reason(self, called: bool, own: str | None) -> str | None:
        """A choice's finish reason, as OpenAI's and vLLM's: tool_calls where calls came under "auto", and under
        "required" where the output ended by itself; a named function's call keeps the output's own (stop, or length
        where max_tokens cut it)."""
        if called and (self.mode == "auto" or (self.mode == "required" and own == "stop")):
            return "tool_calls"
        return own

    def _parameters(self, name: str) -> dict:
        return self.functions[name].get("parameters") or ANY_OBJECT

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":       # the call, also where max_tokens cut its arguments short (finish length), as
            return None, [self.new_call(self.named, text)]     # vLLM answers it and as it is streamed
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:   # cut short by max_tokens: no call, the text as content
                return text, []
            return None, [self.new_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False), i)
                          for i, c in enumerate(items)]
        if self.mode == "auto":
            return self._parse_auto(text)
        return text, []

    def _parse_auto(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.parser == "llama3_json":
            return self._parse_llama3(text)
        if self.parser == "mistral":
            return self._parse_mistral(text)
        if self.parser in SECTION_FORMATS:
            return self._parse_section(text)
        calls, first, end = [], None, 0
        for m in self.block_re.finditer(text):
            call = self.block_call(m.group(1))
            end = m.end()
            if call is not None:
                calls.append(call)
                first = m.start() if first is None else first
        open_at, call = self.unclosed_call(text, end)
        if call is not None:
            calls.append(call)
            first = open_at if first is None else first
        if not calls:
            return text, []
        content = text[:first].rstrip()
        return content or None, calls if self.parallel else calls[:1]

    def _parse_llama3(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """All calls or none: the output (after whitespace and <|python_tag|>) is JSON objects with `;` between."""
        body = text.lstrip()
        body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
        if not body.lstrip().startswith("{"):
            return text, []
        calls, at, decoder = [], 0, json.JSONDecoder()
        while True:
            at = len(body) - len(body[at:].lstrip())
            if at == len(body):
                break
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = self._call_of(obj)
            if call is None:
                return text, []
            calls.append(call)
            rest = body[at:].lstrip()
            at = len(body) - len(rest) + (1 if rest.startswith(";") else 0)
            if rest and not rest.startswith(";"):
                return text, []
        return None, calls if self.parallel else calls[:1]

    def _parse_mistral(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content before [TOOL_CALLS]; after it a JSON list of calls, or NAME[ARGS]{...} (NAME[CALL_ID]ID[ARGS]
        {...}: the model's id kept where it is Mistral's 9 letters and digits, with id_style "mistral") for each
        call (each after a [TOOL_CALLS] of its own, or one after the other). Anything that does not parse: all
        content, the markers out (they are special tokens, kept in the text for this parser only)."""
        start = text.find(MISTRAL_CALLS)
        if start < 0:
            return text, []
        rest, calls = text[start + len(MISTRAL_CALLS):], []
        if rest.lstrip().startswith("["):
            try:
                items = json.loads(rest)
            except json.JSONDecodeError:
                return without_markers(text, (MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID)), []
            calls = [self._call_of(item) for item in items] if isinstance(items, list) and items else [None]
        else:
            decoder = json.JSONDecoder()
            for piece in rest.split(MISTRAL_CALLS):
                while piece.strip():
                    name, sep, args = piece.partition(MISTRAL_ARGS)
                    name, _, given_id = name.partition(MISTRAL_CALL_ID)
                    try:
                        obj, end = decoder.raw_decode(args.lstrip()) if sep else (None, 0)
                    except json.JSONDecodeError:
                        obj = None
                    calls.append(self._call_of({"name": name.strip(), "arguments": obj}) if sep else None)
                    if calls[-1] is None:
                        break
                    if self.id_style == "mistral" and MISTRAL_ID.fullmatch(given_id.strip()):
                        calls[-1].id = given_id.strip()
                    piece = args.lstrip()[end:]
        if not calls or any(c is None for c in calls):
            return without_markers(text, (MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID)), []
        content = text[:start].rstrip()
        return content or None, calls if self.parallel else calls[:1]

    def _parse_section(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The section formats: the content before the section; each complete call after its start that names an
        offered tool with an object for arguments (one cut short or broken is left out). No call: all content, the
        markers out."""
        fmt = SECTION_FORMATS[self.parser]
        start = text.find(fmt.begin)
        calls = [] if start < 0 else [self.section_call(m.group(1)) for m in fmt.call_re.finditer(text, start)]
        calls = [c for c in calls if c is not None]
        if not calls:
            return fmt.without_markers(text), []
        content = fmt.without_markers(text[:start]).rstrip()
        return content or None, calls if self.parallel else calls[:1]

    def section_call(self, inside: str) -> ToolCall | None:
        """The call a complete call of a section format makes (its inside, between its markers), or None."""
        parts = self._section_parts(inside)
        if parts is None:
            return None
        name, args, given_id = parts
        try:
            call = self._call_of({"name": name, "arguments": json.loads(args)})
        except json.JSONDecodeError:
            return None
        if call is not None and given_id is not None:
            call.id = given_id
        return call

    def _section_parts(self, inside: str) -> tuple[str, str, str | None] | None:
        """A call's (name, arguments' JSON text, the model's id for it or None), or None where it has no such parts."""
        if self.parser == "deepseek_v3":
            m = DEEPSEEK_V3_CALL_RE.fullmatch(inside)
            return (m.group(1), m.group(2), None) if m else None
        head, sep, args = inside.partition(SECTION_FORMATS[self.parser].sep)
        head = head.strip()
        if not sep:
            return None
        if self.parser == "kimi_k2":      # functions.NAME:IDX, the call's id as well
            m = KIMI_ID_RE.fullmatch(head)
            return (m.group(1), args, head) if m else None
        return head, args, None

    @property
    def block_re(self) -> re.Pattern:
        """The <tool_call> blocks of the block formats (BLOCK_PARSERS): their inside is group 1."""
        return TOOL_CALL_RE if self.parser == "hermes" else GLM_CALL_RE

    def unclosed_call(self, text: str, after: int) -> tuple[int, ToolCall | None]:
        """hermes: a last <tool_call> (after `after`) that the output never closed, read as a call where its inside
        is one (vLLM's hermes parser: `<tool_call>(.*)` beside the closed blocks): where it opens, and the call or
        None."""
        at = text.find("<tool_call>", after) if self.parser == "hermes" else -1
        if at < 0:
            return -1, None
        return at, self.block_call(text[at + len("<tool_call>"):])

    def block_call(self, block: str) -> ToolCall | None:
        """The call a complete <tool_call> block's inside makes, or None if it makes none."""
        if self.parser == "glm45":
            return self._glm_call(block)
        if self.parser == "qwen3_coder":
            return self._coder_call(block)
        return self.valid_call(block)

    def _coder_call(self, block: str) -> ToolCall | None:
        """Qwen3-Coder's one <function=NAME> of <parameter=K> values and nothing else (values as _typed reads)."""
        m = CODER_FUNCTION_RE.fullmatch(block)
        name = m.group(1).strip() if m else None
        if name not in self.functions or CODER_PARAM_RE.sub("", m.group(2)).strip():
            return None
        args = {}
        for p in CODER_PARAM_RE.finditer(m.group(2)):
            raw = p.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            args[p.group(1).strip()] = self._typed(name, p.group(1).strip(), raw)
        return ToolCall(name, json.dumps(args, ensure_ascii=False))

    def _typed(self, name: str, key: str, raw: str):
        """A value written as text: text where the tool's schema says string, else JSON where it parses, else text."""
        props = (self.functions[name].get("parameters") or {}).get("properties") or {}
        kind = (props.get(key) or {}).get("type")
        return raw if kind == "string" or (isinstance(kind, list) and "string" in kind) else json_or_text(raw)

    def _glm_call(self, block: str) -> ToolCall | None:
        """GLM's NAME then <arg_key>/<arg_value> pairs and nothing else; a value is text where the tool's schema
        says string, else JSON where it parses (GLM's template writes non-strings as JSON), else text."""
        head = block.split("<arg_key>", 1)[0]
        name = head.strip()
        if name not in self.functions or GLM_ARG_RE.sub("", block[len(head):]).strip():
            return None
        args = {m.group(1).strip(): self._typed(name, m.group(1).strip(), m.group(2))
                for m in GLM_ARG_RE.finditer(block)}
        return ToolCall(name, json.dumps(args, ensure_ascii=False))

    def valid_call(self, block: str) -> ToolCall | None:
        """The call a complete <tool_call> block's JSON makes, or None if it makes none."""
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return None
        return self._call_of(obj)

    def _call_of(self, obj) -> ToolCall | None:
        """The call a decoded {"name", "arguments" (or "parameters")} object makes: an offered tool and an object
        for its arguments, else None."""
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(obj, dict) and obj.get("name") in self.functions and isinstance(args, dict):
            return self.new_call(obj["name"], json.dumps(args, ensure_ascii=False))
        return None


class AutoToolStream:
    """tool_choice "auto", streamed: feed() the whole text so far, get the new content and the calls whose
    blocks closed since (llama3_json and mistral: the calls at the end). What it gives adds up to
    ToolPolicy.parse of the final text: content is held back only where a call may be starting, where trailing
    whitespace may end the content, and the `hold` characters a stop string could still trim."""

    def __init__(self, policy: ToolPolicy, hold: int = 0) -> None:
        self.policy, self.hold = policy, hold
        self.sent = 0            # characters of content sent
        self.scanned = 0         # the text up to here has been searched for complete blocks
        self.content_end: int | None = None   # where the first call's block starts: content ends there
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        if not finished:     # a stop string could still cut the last `hold` characters (and a block there)
            text = text[:max(0, len(text) - self.hold)]
        if self.policy.parser in SECTION_FORMATS:
            return self._feed_section(text, finished)
        if self.policy.parser not in BLOCK_PARSERS:
            return self._feed_whole(text, finished)
        calls = []
        for m in self.policy.block_re.finditer(text, self.scanned):
            self.scanned = m.end()
            call = self.policy.block_call(m.group(1))
            if call is None or (self.num_calls and not self.policy.parallel):
                continue
            self.content_end = m.start() if self.content_end is None else self.content_end
            self.num_calls += 1
            calls.append(call)
        if finished:      # a last block never closed (ToolPolicy.unclosed_call)
            at, call = self.policy.unclosed_call(text, self.scanned)
            if call is not None and not (self.num_calls and not self.policy.parallel):
                self.content_end = at if self.content_end is None else self.content_end
                self.num_calls += 1
                calls.append(call)
        if self.content_end is not None:          # a call came: the content is what stood before it
            end = len(text[:self.content_end].rstrip())
        elif finished:
            end = len(text)
        else:
            end = len(text)
            tag = text.find("<tool_call>", self.scanned)
            if tag >= 0:                          # a block still open: it may become a call
                end = min(end, tag)
            else:                                 # a tag may be starting at the end
                end = min(end, len(text) - partial_tag(text))
            end = len(text[:end].rstrip())
        new = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return new, calls

    def _feed_section(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """The section formats: each call once its end marker comes; the content (the markers out) up to where the
        first marker is or may be starting, and, once a call came, up to its section's start."""
        fmt, calls = SECTION_FORMATS[self.policy.parser], []
        start = text.find(fmt.begin)
        for m in fmt.call_re.finditer(text, max(self.scanned, start)) if start >= 0 else ():
            self.scanned = m.end()
            call = self.policy.section_call(m.group(1))
            if call is None or (self.num_calls and not self.policy.parallel):
                continue
            self.content_end = start
            self.num_calls += 1
            calls.append(call)
        if self.content_end is not None:
            content = fmt.without_markers(text[:self.content_end]).rstrip()
        elif finished:
            content = fmt.without_markers(text)
        else:        # no marker before the end: the text so far is content as it stands
            content = text[:fmt.content_end(text)].rstrip()
        new = content[self.sent:]
        self.sent = max(self.sent, len(content))
        return new, calls

    def _feed_whole(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """llama3_json and mistral: the content up to where calls may start; the calls once the output ends."""
        calls = []
        if finished:      # the content sent so far is a prefix of the parse's (no marker stood before it)
            content, calls = self.policy.parse(text)
            self.num_calls = len(calls)
            new = (content or "")[self.sent:]
            self.sent = max(self.sent, len(content or ""))
            return new, calls
        if self.policy.parser == "mistral":
            tag = text.find(MISTRAL_CALLS)
            end = tag if tag >= 0 else len(text) - partial_tag(text, MISTRAL_CALLS)
            end = len(text[:end].rstrip())
        else:                           # llama3_json: calls or content, as the output's first characters say
            head = text.lstrip()
            calls_may_come = head[:1] == "{" or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head)
            end = 0 if calls_may_come else len(text)
        new = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return new, calls


def detect_tool_parser(tokenizer, chat_template: str | None) -> str:
    """The calls' format a model speaks (TOOL_PARSERS): mistral where its tokenizer has a [TOOL_CALLS] token,
    deepseek_v3 where it has a <｜tool▁calls▁begin｜> token (deepseek_v31 where the chat template writes V3.1's calls:
    the name right after <｜tool▁call▁begin｜>, no ```json), kimi_k2 where it has <|tool_calls_section_begin|>,
    qwen3_coder where its chat template writes <function=...> and <parameter=...>, glm45 where it writes <arg_key>
    pairs, llama3_json where the template is Llama 3's (tools through `Environment: ipython` / <|python_tag|>),
    else hermes."""
    if has_token(tokenizer, MISTRAL_CALLS):
        return "mistral"
    deepseek = SECTION_FORMATS["deepseek_v3"]
    if has_token(tokenizer, deepseek.begin):      # V3.1's template writes NAME right after the call's marker
        v31 = chat_template and deepseek.call_begin in chat_template and "```json" not in chat_template
        return "deepseek_v31" if v31 else "deepseek_v3"
    if has_token(tokenizer, SECTION_FORMATS["kimi_k2"].begin):
        return "kimi_k2"
    if chat_template and "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if chat_template and "<arg_key>" in chat_template:
        return "glm45"
    if chat_template and (PYTHON_TAG in chat_template or "Environment: ipython" in chat_template):
        return "llama3_json"
    return "hermes"


def has_token(tokenizer, marker: str) -> bool:
    """Whether the tokenizer has marker as one token of its own."""
    try:
        return tokenizer is not None and len(tokenizer.encode(marker, add_special_tokens=False)) == 1
    except Exception:       # a tokenizer that cannot encode: not one with this marker
        return False


def json_or_text(text: str) -> Any:
    """text's JSON value where it parses, else text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def template_arguments(text: str | None) -> Any:
    """An earlier call's arguments as chat templates take them (Qwen's, HF's convention): an object, not JSON text;
    none (an empty string) as {}, as vLLM passes them."""
    return json_or_text(text) if (text or "").strip() else {}


def partial_tag(text: str, tag: str = "<tool_call>") -> int:
    """How many characters at the end of text could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template uses the `tools` it is given (else they would silently vanish)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def tool_system_prompt(tools: list[dict]) -> str:
    """For templates without tool support: the tools and the call format, as a system message."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You may call functions to help with the user's request. The functions, as JSON:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call one, reply with a JSON object with its name and arguments within tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def with_tool_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The messages with the tools' description added to the system message (a new one first if none)."""
    prompt = tool_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        content = messages[0]["content"]
        if isinstance(content, list):         # text parts (a template that loops over them)
            content = content + [{"type": "text", "text": prompt}]
        else:
            content = f"{content}\n\n{prompt}"
        return [{**messages[0], "content": content}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
