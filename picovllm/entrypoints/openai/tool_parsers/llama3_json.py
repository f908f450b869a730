"""The llama3_json format, which Llama 3.1 to 3.3's chat templates ask for (tools through `Environment: ipython`):
the whole output is one or more `{"name": ..., "parameters": {...}}` objects ("arguments" is taken too), `;`
between them, after an optional `<|python_tag|>`. All calls or none: anything else in the output makes it all
content. Streamed, the calls come when the output ends."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from picovllm.entrypoints.openai.tool_parsers.base import UNPARSED, ToolCall, ToolParser

if TYPE_CHECKING:
    from picovllm.entrypoints.openai.tool_parsers.policy import ToolPolicy

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def parse(self, policy: ToolPolicy, text: str) -> tuple[str | None, list[ToolCall]]:
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
            except UNPARSED:
                return text, []
            call = policy.call_of(obj)
            if call is None:
                return text, []
            calls.append(call)
            rest = body[at:].lstrip()
            at = len(body) - len(rest) + (1 if rest.startswith(";") else 0)
            if rest and not rest.startswith(";"):
                return text, []
        return None, calls if policy.parallel else calls[:1]

    def held_content_end(self, text: str) -> int:
        """Calls or content, as the output's first characters say: none of it while calls may come."""
        head = text.lstrip()
        calls_may_come = head[:1] == "{" or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head)
        return 0 if calls_may_come else len(text)
