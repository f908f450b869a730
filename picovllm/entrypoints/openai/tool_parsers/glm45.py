"""The glm45 format, which GLM-4.5 to GLM-4.7's chat templates write:
`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` blocks, with or without newlines
between the pairs. A value is text where the tool's schema says string, else JSON where it parses (GLM's template
writes non-strings as JSON), else text; qwen3_coder reads its values the same way (typed_value). The markers are
special tokens: the server keeps them in the text for this parser."""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from picovllm.entrypoints.openai.tool_parsers.base import BlockParser, ToolCall, json_or_text

if TYPE_CHECKING:
    from picovllm.entrypoints.openai.tool_parsers.policy import ToolPolicy

GLM_ARG_RE = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def typed_value(policy: ToolPolicy, name: str, key: str, raw: str) -> Any:
    """A value written as text: text where the tool's schema says string, else JSON where it parses, else text."""
    props = (policy.functions[name].get("parameters") or {}).get("properties") or {}
    kind = (props.get(key) or {}).get("type")
    return raw if kind == "string" or (isinstance(kind, list) and "string" in kind) else json_or_text(raw)


class Glm45Parser(BlockParser):
    name = "glm45"
    special_markers = True

    def block_call(self, policy: ToolPolicy, block: str) -> ToolCall | None:
        """GLM's NAME then <arg_key>/<arg_value> pairs and nothing else, or None."""
        head = block.split("<arg_key>", 1)[0]
        name = head.strip()
        if name not in policy.functions or GLM_ARG_RE.sub("", block[len(head):]).strip():
            return None
        args = {m.group(1).strip(): typed_value(policy, name, m.group(1).strip(), m.group(2))
                for m in GLM_ARG_RE.finditer(block)}
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
