"""What every tool-call parser shares: a call (ToolCall), the contract a format's parser keeps (ToolParser), the two
shapes most formats take, and the text helpers they and the streaming reader use. BlockParser reads `<tool_call>`
blocks, each call on its own (hermes, glm45, qwen3_coder); SectionParser reads a calls section whose markers are
special tokens of the model's tokenizer (SectionFormat: deepseek_v3, deepseek_v31, kimi_k2). A format of neither
shape (llama3_json, mistral) is read whole once the output ends."""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from picovllm.entrypoints.openai.tool_parsers.policy import ToolPolicy

TOOL_CALL_OPEN = "<tool_call>"
BLOCK_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)     # a closed block: its inside is group 1


@dataclass
class ToolCall:
    name: str
    arguments: str        # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """One calls' format under tool_choice "auto" (a name of registry.TOOL_PARSERS, vLLM's --tool-call-parser).
    A parser holds no state: the request's ToolPolicy (its tools, parallel_tool_calls, id style) comes with each
    call. Streamed (AutoToolStream), a BlockParser's calls go out as each block closes, a SectionParser's as each
    call's end marker comes, any other parser's when the output ends (held_content_end says how far the content
    may go out before then)."""
    name: str
    special_markers = False    # its markers are special tokens: the server keeps them in the text for the parser

    def parse(self, policy: ToolPolicy, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output. Only calls that parse and name an offered tool with an object for
        arguments (never a call with broken arguments: such text stays content), at most one where
        parallel_tool_calls is false."""
        raise NotImplementedError

    def held_content_end(self, text: str) -> int:
        """A parser of neither shape, streamed: how far the content of a text still growing may go out (the calls
        and the rest of the content come when the output ends)."""
        raise NotImplementedError


class BlockParser(ToolParser):
    """A format whose calls are `<tool_call>` blocks (block_re), each block's inside read on its own (block_call);
    the content is the text before the first call, trailing whitespace dropped."""
    block_re: re.Pattern = BLOCK_RE
    block_close = "</tool_call>"     # every block_re match ends in it (AutoToolStream searches new text for it)

    def block_call(self, policy: ToolPolicy, block: str) -> ToolCall | None:
        """The call a complete block's inside makes, or None if it makes none."""
        raise NotImplementedError

    def unclosed_call(self, policy: ToolPolicy, text: str, after: int) -> tuple[int, ToolCall | None]:
        """A last block (after `after`) that the output never closed, read as a call: where it opens, and the call
        or None. Only hermes reads one."""
        return -1, None

    def parse(self, policy: ToolPolicy, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, first, end = [], None, 0
        for m in self.block_re.finditer(text):
            call = self.block_call(policy, m.group(1))
            end = m.end()
            if call is not None:
                calls.append(call)
                first = m.start() if first is None else first
        open_at, call = self.unclosed_call(policy, text, end)
        if call is not None:
            calls.append(call)
            first = open_at if first is None else first
        if not calls:
            return text, []
        content = text[:first].rstrip()
        return content or None, calls if policy.parallel else calls[:1]


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


class SectionParser(ToolParser):
    """A format of a calls section (fmt): the content before the section; each complete call after its start that
    names an offered tool with an object for arguments (one cut short or broken is left out). No call: all content,
    the markers out (what skip_special_tokens would have shown)."""
    fmt: SectionFormat
    special_markers = True

    def parts(self, inside: str) -> tuple[str, str, str | None] | None:
        """A call's (name, arguments' JSON text, the model's id for it or None), or None where it has no such
        parts."""
        raise NotImplementedError

    def parse(self, policy: ToolPolicy, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.fmt.begin)
        calls = [] if start < 0 else [self.section_call(policy, m.group(1))
                                      for m in self.fmt.call_re.finditer(text, start)]
        calls = [c for c in calls if c is not None]
        if not calls:
            return self.fmt.without_markers(text), []
        content = self.fmt.without_markers(text[:start]).rstrip()
        return content or None, calls if policy.parallel else calls[:1]

    def section_call(self, policy: ToolPolicy, inside: str) -> ToolCall | None:
        """The call a complete call of the section makes (its inside, between its markers), or None."""
        parts = self.parts(inside)
        if parts is None:
            return None
        name, args, given_id = parts
        try:
            arguments = json.loads(args)
        except UNPARSED:
            return None
        call = policy.call_of({"name": name, "arguments": arguments})
        if call is not None and given_id is not None:
            call.id = given_id
        return call


def without_markers(text: str, markers: Sequence[str]) -> str:
    """text as the client may see it: a format's markers (special tokens, kept in the text for its parser) out, as
    skip_special_tokens would have shown it."""
    for marker in markers:
        text = text.replace(marker, "")
    return text


# what json.loads raises for text it does not take: not JSON (JSONDecodeError, a ValueError), or JSON Python's json
# cannot hold (an integer past its 4,300 digits: ValueError; nesting past the recursion limit: RecursionError)
UNPARSED = (ValueError, RecursionError)


def json_or_text(text: str) -> Any:
    """text's JSON value where it parses, else text itself (also where Python's json cannot hold it: an integer past
    its 4300 digits, nesting past the recursion limit)."""
    try:
        return json.loads(text)
    except UNPARSED:
        return text


def partial_tag(text: str, tag: str = TOOL_CALL_OPEN) -> int:
    """How many characters at the end of text could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
