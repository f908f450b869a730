"""Tool calling for /v1/chat/completions: tools into the prompt, calls out of the output.

The prompt: the tools go through the model's chat template (apply_chat_template(tools=...)) when the template
uses them (Qwen-family and other Hermes-style templates); otherwise a system message describes them and the
format to call them in. Either way a call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The output, by tool_choice:
- "auto": free text; each <tool_call> block whose JSON names a given tool becomes a call, the text before the
  first block is the content (a block that does not parse stays content: never a call with broken arguments);
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
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue
            args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
            if isinstance(obj, dict) and obj.get("name") in self.functions and isinstance(args, dict):
                calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
                first = m.start() if first is None else first
        if not calls:
            return text, []
        content = text[:first].strip()
        return content or None, calls if self.parallel else calls[:1]


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
