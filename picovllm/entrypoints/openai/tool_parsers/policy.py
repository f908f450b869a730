"""What a request's tools and tool_choice ask for (ToolPolicy), and how its output is read, by tool_choice:
- "auto": free text; each call in the calls' format (the request's parser, a name of registry.TOOL_PARSERS) that
  names a given tool with an object for arguments becomes a call, the text before the first one is the content,
  trailing whitespace dropped (a call that does not parse stays content: never a call with broken arguments).
  Streamed, see streaming.AutoToolStream;
- "required": the output is constrained (structured outputs) to a JSON array of one or more
  {"name", "arguments"} objects, each one's arguments by that function's parameter schema;
- a named function: the output is constrained to that function's arguments (its parameter schema);
- "none" (or no tools): the tools are left out of the prompt and the output is plain content.
So under "required" and a named function the arguments always parse and validate."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from picovllm.entrypoints.openai.tool_parsers.base import UNPARSED, ToolCall
from picovllm.entrypoints.openai.tool_parsers.registry import tool_parser
from picovllm.sampling_params import StructuredOutputsParams

ANY_OBJECT = {"type": "object"}
# the sources of ToolPolicy.constraint's structured outputs (a named function's, tool_choice "required"'s): the field
# that holds their parameter schemas, which a refused schema's 400 names
TOOLS_SOURCES = ("tools",)


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

    def call_of(self, obj) -> ToolCall | None:
        """The call a decoded {"name", "arguments" (or "parameters")} object makes: an offered tool and an object
        for its arguments, else None."""
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(obj, dict) and obj.get("name") in self.functions and isinstance(args, dict):
            return self.new_call(obj["name"], json.dumps(args, ensure_ascii=False))
        return None

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
        return StructuredOutputsParams(json=schema, source=TOOLS_SOURCES[0])

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
            except UNPARSED:   # cut short by max_tokens: no call, the text as content
                return text, []
            return None, [self.new_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False), i)
                          for i, c in enumerate(items)]
        if self.mode == "auto":
            return tool_parser(self.parser).parse(self, text)
        return text, []
