"""Tool calling for /v1/chat/completions: tools into the prompt, calls out of the output.

The prompt: the tools go through the model's chat template (apply_chat_template(tools=...)) when the template
uses them (Qwen-family and other Hermes-style templates); otherwise a system message describes them and the
format to call them in. Either way a call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The output, by tool_choice:
- "auto": free text; each <tool_call> block whose JSON names a given tool becomes a call, the text before the
  first such block is the content, trailing whitespace dropped (a block that does not parse stays content: never
  a call with broken arguments). Streamed (AutoToolStream), the content goes out as it is generated and each
  call as soon as its block closes;
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
from dataclasses import dataclass, field

from picovllm.sampling_params import StructuredOutputsParams

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
ANY_OBJECT = {"type": "object"}


@dataclass
class ToolCall:
    name: str
    arguments: str        # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolPolicy:
    """What a request's tools and tool_choice ask for. mode: none, auto, required or named (then `named`)."""
    tools: list[dict]             # OpenAI tool objects: {"type": "function", "function": {name, parameters, ...}}
    mode: str
    named: str | None = None
    parallel: bool = True         # parallel_tool_calls: false -> at most one call

    @property
    def functions(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def active(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output that makes the reply a valid call (required, named), else None."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self._parameters(self.named), source="tool_choice")
        if self.mode != "required":
            return None
        calls = [{"type": "object", "required": ["name", "arguments"],
                  "properties": {"name": {"const": n}, "arguments": self._parameters(n)}} for n in self.functions]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, source="tools")

    def _parameters(self, name: str) -> dict:
        return self.functions[name].get("parameters") or ANY_OBJECT

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":
            try:
                json.loads(text)
            except json.JSONDecodeError:   # cut short by max_tokens
                return text, []
            return None, [ToolCall(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:   # cut short by max_tokens: no call, the text as content
                return text, []
            return None, [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in items]
        if self.mode == "auto":
            return self._parse_auto(text)
        return text, []

    def _parse_auto(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, first = [], None
        for m in TOOL_CALL_RE.finditer(text):
            call = self.valid_call(m.group(1))
            if call is not None:
                calls.append(call)
                first = m.start() if first is None else first
        if not calls:
            return text, []
        content = text[:first].rstrip()
        return content or None, calls if self.parallel else calls[:1]

    def valid_call(self, block: str) -> ToolCall | None:
        """The call a complete <tool_call> block's JSON makes, or None if it makes none."""
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(obj, dict) and obj.get("name") in self.functions and isinstance(args, dict):
            return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
        return None


class AutoToolStream:
    """tool_choice "auto", streamed: feed() the whole text so far, get the new content and the calls whose
    blocks closed since. What it gives adds up to ToolPolicy.parse of the final text: content is held back
    only where a <tool_call> tag may be starting, where trailing whitespace may end the content, and the
    `hold` characters a stop string could still trim."""

    def __init__(self, policy: ToolPolicy, hold: int = 0) -> None:
        self.policy, self.hold = policy, hold
        self.sent = 0            # characters of content sent
        self.scanned = 0         # the text up to here has been searched for complete blocks
        self.content_end: int | None = None   # where the first call's block starts: content ends there
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        if not finished:     # a stop string could still cut the last `hold` characters (and a block there)
            text = text[:max(0, len(text) - self.hold)]
        calls = []
        for m in TOOL_CALL_RE.finditer(text, self.scanned):
            self.scanned = m.end()
            call = self.policy.valid_call(m.group(1))
            if call is None or (self.num_calls and not self.policy.parallel):
                continue
            self.content_end = m.start() if self.content_end is None else self.content_end
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
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
