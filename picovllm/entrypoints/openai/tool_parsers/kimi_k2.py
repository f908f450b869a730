"""The kimi_k2 section format, for a tokenizer with a `<|tool_calls_section_begin|>` token (Moonshot's Kimi-K2): the
calls stand between `<|tool_calls_section_begin|>` and `<|tool_calls_section_end|>`, each as
`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`. The call's id is
`functions.NAME:IDX` as the model wrote it (vLLM's; Kimi's template writes it back in the next turn). The markers are
special tokens, kept in the text for this parser; where no call comes, the content is the text without them."""
from __future__ import annotations

import re

from picovllm.entrypoints.openai.tool_parsers.base import SectionFormat, SectionParser

KIMI_K2 = SectionFormat(begin="<|tool_calls_section_begin|>", end="<|tool_calls_section_end|>",
                        call_begin="<|tool_call_begin|>", call_end="<|tool_call_end|>",
                        sep="<|tool_call_argument_begin|>")
KIMI_ID_RE = re.compile(r"(?:functions\.)?(.+):\d+")


class KimiK2Parser(SectionParser):
    name = "kimi_k2"
    fmt = KIMI_K2

    def parts(self, inside: str) -> tuple[str, str, str | None] | None:
        """functions.NAME:IDX, the call's id as well, then its arguments."""
        head, sep, args = inside.partition(self.fmt.sep)
        m = KIMI_ID_RE.fullmatch(head.strip()) if sep else None
        return (m.group(1), args, head.strip()) if m else None
