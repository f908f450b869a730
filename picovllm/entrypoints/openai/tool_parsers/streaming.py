"""tool_choice "auto", streamed (AutoToolStream): the content as it is generated and each call as soon as the
calls' format lets it be read. A block format's call (hermes, glm45, qwen3_coder) goes out as soon as its block
closes, a section format's (deepseek_v3, deepseek_v31, kimi_k2) as soon as its end marker comes, llama3_json's and
mistral's when the output ends. The chat server turns each call into one OpenAI tool_calls delta."""
from __future__ import annotations

from picovllm.entrypoints.openai.tool_parsers.base import (TOOL_CALL_OPEN, BlockParser, SectionParser, ToolCall,
                                                           ToolParser, partial_tag)
from picovllm.entrypoints.openai.tool_parsers.policy import ToolPolicy
from picovllm.entrypoints.openai.tool_parsers.registry import tool_parser


class AutoToolStream:
    """tool_choice "auto", streamed: feed() the whole text so far, get the new content and the calls whose
    blocks closed since (llama3_json and mistral: the calls at the end). What it gives adds up to
    ToolPolicy.parse of the final text: content is held back only where a call may be starting, where trailing
    whitespace may end the content, and the `hold` characters a stop string could still trim."""

    def __init__(self, policy: ToolPolicy, hold: int = 0) -> None:
        self.policy, self.hold = policy, hold
        self.sent = 0            # characters of content sent
        self.scanned = 0         # the text up to here has been searched for complete blocks
        self.content_end: int | None = None   # where the first call's block starts: content ends there
        self.num_calls = 0
        # So that a feed reads what is new rather than the whole text again (a long block still open was searched
        # from its start at every token: 84 us a feed at 2,000 tokens):
        self.fed = 0             # the length of the text the last feed read
        self.open_at = -1        # an opening tag found at or after `scanned` (-1: none known)
        self.open_searched = 0   # none opens between `scanned` and here

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        if not finished:     # a stop string could still cut the last `hold` characters (and a block there)
            text = text[:max(0, len(text) - self.hold)]
        if len(text) < self.fed:      # shorter than before (a stop string cut it): what was found past it is gone
            self.fed, self.open_at, self.open_searched = len(text), -1, min(self.open_searched, len(text))
        parser = tool_parser(self.policy.parser)
        if isinstance(parser, SectionParser):
            return self._feed_section(parser, text, finished)
        if isinstance(parser, BlockParser):
            return self._feed_blocks(parser, text, finished)
        return self._feed_whole(parser, text, finished)

    def _feed_blocks(self, parser: BlockParser, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """The block formats: each call once its block closes; the content up to where a block is or may be
        starting, and, once a call came, up to its block."""
        calls, close = [], parser.block_close
        # a block that closes now ends in a closing tag that ends past the text read before (every block_re ends in
        # block_close; one that closed before was found then)
        closing = finished or text.find(close, max(self.scanned, self.fed - len(close) + 1)) >= 0
        self.fed = len(text)
        for m in parser.block_re.finditer(text, self.scanned) if closing else ():
            self.scanned = m.end()
            call = parser.block_call(self.policy, m.group(1))
            if call is None or (self.num_calls and not self.policy.parallel):
                continue
            self.content_end = m.start() if self.content_end is None else self.content_end
            self.num_calls += 1
            calls.append(call)
        if finished:      # a last block never closed (BlockParser.unclosed_call)
            at, call = parser.unclosed_call(self.policy, text, self.scanned)
            if call is not None and not (self.num_calls and not self.policy.parallel):
                self.content_end = at if self.content_end is None else self.content_end
                self.num_calls += 1
                calls.append(call)
        if self.content_end is not None:          # a call came: the content is what stood before it
            end = _before_spaces(text, min(self.content_end, len(text)))
        elif finished:
            end = len(text)
        else:
            end = len(text)
            tag = self._open_tag(text)
            if tag >= 0:                          # a block still open: it may become a call
                end = min(end, tag)
            else:                                 # a tag may be starting at the end
                end = min(end, len(text) - partial_tag(text))
            end = _before_spaces(text, end)
        new = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return new, calls

    def _open_tag(self, text: str) -> int:
        """Where the first opening tag at or after `scanned` is, or -1: searched for in what is new only."""
        if self.open_at < self.scanned:           # none known past the blocks read
            at = text.find(TOOL_CALL_OPEN, max(self.scanned, self.open_searched))
            self.open_searched = max(self.scanned, len(text) - len(TOOL_CALL_OPEN) + 1) if at < 0 else at
            self.open_at = at
        return self.open_at if self.open_at >= self.scanned else -1

    def _feed_section(self, parser: SectionParser, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """The section formats: each call once its end marker comes; the content (the markers out) up to where the
        first marker is or may be starting, and, once a call came, up to its section's start."""
        fmt, calls = parser.fmt, []
        start = text.find(fmt.begin)
        # a call that completes now ends in a call_end that ends past the text read before
        closing = finished or text.find(fmt.call_end, max(self.scanned, start, self.fed - len(fmt.call_end) + 1)) >= 0
        self.fed = len(text)
        for m in fmt.call_re.finditer(text, max(self.scanned, start)) if start >= 0 and closing else ():
            self.scanned = m.end()
            call = parser.section_call(self.policy, m.group(1))
            if call is None or (self.num_calls and not self.policy.parallel):
                continue
            self.content_end = start
            self.num_calls += 1
            calls.append(call)
        if self.content_end is not None:
            content = fmt.without_markers(text[:self.content_end]).rstrip()
        elif finished:
            content = fmt.without_markers(text)
        else:        # no marker before the end: the text so far is content as it stands
            content = text[:fmt.content_end(text)].rstrip()
        new = content[self.sent:]
        self.sent = max(self.sent, len(content))
        return new, calls

    def _feed_whole(self, parser: ToolParser, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """llama3_json and mistral: the content up to where calls may start; the calls once the output ends."""
        calls = []
        if finished:      # the content sent so far is a prefix of the parse's (no marker stood before it)
            content, calls = self.policy.parse(text)
            self.num_calls = len(calls)
            new = (content or "")[self.sent:]
            self.sent = max(self.sent, len(content or ""))
            return new, calls
        end = parser.held_content_end(text)
        new = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return new, calls


def _before_spaces(text: str, end: int) -> int:
    """len(text[:end].rstrip()), without the copy."""
    while end and text[end - 1].isspace():
        end -= 1
    return end
