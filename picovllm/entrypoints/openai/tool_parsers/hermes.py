"""The hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of JSON. Hermes-style chat
templates write it (Qwen2.5 and Qwen3, NousResearch's Hermes 2 and 3), and so does any model asked to by the
system-message fallback (prompt.py) for templates that do not render tools. A last block that the output never
closed is a call too where its JSON is one, as vLLM's hermes parser reads `<tool_call>(.*)` beside the closed
blocks."""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from picovllm.entrypoints.openai.tool_parsers.base import TOOL_CALL_OPEN, UNPARSED, BlockParser, ToolCall

if TYPE_CHECKING:
    from picovllm.entrypoints.openai.tool_parsers.policy import ToolPolicy

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class HermesParser(BlockParser):
    name = "hermes"
    block_re = TOOL_CALL_RE

    def block_call(self, policy: ToolPolicy, block: str) -> ToolCall | None:
        """The call a complete <tool_call> block's JSON makes, or None if it makes none."""
        try:
            obj = json.loads(block)
        except UNPARSED:
            return None
        return policy.call_of(obj)

    def unclosed_call(self, policy: ToolPolicy, text: str, after: int) -> tuple[int, ToolCall | None]:
        at = text.find(TOOL_CALL_OPEN, after)
        if at < 0:
            return -1, None
        return at, self.block_call(policy, text[at + len(TOOL_CALL_OPEN):])
