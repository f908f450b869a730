"""The qwen3_coder format, which Qwen3-Coder's chat template writes:
`<tool_call><function=NAME><parameter=K>V</parameter>...</function></tool_call>` blocks, newlines between the tags.
A value loses one leading and one trailing newline, then is read as glm45's are (text where the tool's schema says
string, else JSON where it parses, else text)."""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from picovllm.entrypoints.openai.tool_parsers.base import BlockParser, ToolCall
from picovllm.entrypoints.openai.tool_parsers.glm45 import typed_value

if TYPE_CHECKING:
    from picovllm.entrypoints.openai.tool_parsers.policy import ToolPolicy

CODER_FUNCTION_RE = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
CODER_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderParser(BlockParser):
    name = "qwen3_coder"

    def block_call(self, policy: ToolPolicy, block: str) -> ToolCall | None:
        """One <function=NAME> of <parameter=K> values and nothing else, or None."""
        m = CODER_FUNCTION_RE.fullmatch(block)
        name = m.group(1).strip() if m else None
        if name not in policy.functions or CODER_PARAM_RE.sub("", m.group(2)).strip():
            return None
        args = {}
        for p in CODER_PARAM_RE.finditer(m.group(2)):
            raw = p.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            args[p.group(1).strip()] = typed_value(policy, name, p.group(1).strip(), raw)
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
