"""DeepSeek's section formats, for a tokenizer with a `<｜tool▁calls▁begin｜>` token. The calls stand between
`<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, each between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`.
deepseek_v3 (DeepSeek-V3, R1-0528) writes a call as `function<｜tool▁sep｜>NAME` then its arguments in a ```json
fence; deepseek_v31 (DeepSeek-V3.1, whose template writes NAME right after `<｜tool▁call▁begin｜>`) as
`NAME<｜tool▁sep｜>{...}`. The markers are special tokens, kept in the text for these parsers; where no call comes,
the content is the text without them."""
from __future__ import annotations

import re

from picovllm.entrypoints.openai.tool_parsers.base import SectionFormat, SectionParser

DEEPSEEK = SectionFormat(begin="<｜tool▁calls▁begin｜>", end="<｜tool▁calls▁end｜>", call_begin="<｜tool▁call▁begin｜>",
                         call_end="<｜tool▁call▁end｜>", sep="<｜tool▁sep｜>")
DEEPSEEK_V3_CALL_RE = re.compile(r"\s*function\s*<｜tool▁sep｜>\s*([^\n`]+?)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


class DeepseekV3Parser(SectionParser):
    name = "deepseek_v3"        # function<｜tool▁sep｜>NAME, then ```json {...} ```
    fmt = DEEPSEEK

    def parts(self, inside: str) -> tuple[str, str, str | None] | None:
        m = DEEPSEEK_V3_CALL_RE.fullmatch(inside)
        return (m.group(1), m.group(2), None) if m else None


class DeepseekV31Parser(SectionParser):
    name = "deepseek_v31"       # NAME<｜tool▁sep｜>{...}
    fmt = DEEPSEEK

    def parts(self, inside: str) -> tuple[str, str, str | None] | None:
        head, sep, args = inside.partition(self.fmt.sep)
        return (head.strip(), args, None) if sep else None
