"""GPT-OSS's replies (OpenAI's harmony format) apart: reasoning, answer and tool calls, as vLLM serves them.

A harmony reply is a run of messages, each `<|start|>{header}<|message|>{body}` ended by `<|end|>` (or by the stop
tokens `<|return|>`, after the answer, and `<|call|>`, after a tool call). The prompt ends with
`<|start|>assistant`, so the first message's header starts at its `<|channel|>`:

    <|channel|>analysis<|message|>2+2? Simple.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The header names the channel (`analysis`: reasoning; `final`: the answer; `commentary`: a tool call's preamble, or
the call itself) and, for a call, its recipient (`to=functions.NAME`, before or after the channel). This module
reads the reply's text with its special tokens kept (the chat endpoint asks the engine for them: the server sees
the markers, the client never does):

- `analysis` bodies are the message's `reasoning` (and `reasoning_content`);
- `final` and `commentary` bodies without a recipient are its `content`;
- a body sent to `functions.NAME`, a tool the request offered (tool_choice "auto"), whose JSON parses to an object,
  is a tool call; any other (a tool not offered, broken arguments, arguments max_tokens cut short, built-in tools
  such as `browser.search` the API cannot offer) stays text, where its channel's text goes: never a call with
  broken arguments;
- a reply without a harmony header (structured outputs and tool_choice "required" or a named function constrain
  the whole reply to JSON) is all content;
- a prompt that ends inside a message's body (an assistant message continued: continue_final_message) leaves the
  reply in that message: its text goes where that message's channel says, up to its end.

Streamed, each piece goes out as soon as no marker can still be starting in it, and each call whole once its
message ends. Torch-free.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from picovllm.entrypoints.openai.tool_calls import UNPARSED, ToolCall, ToolPolicy, partial_tag
from picovllm.reasoning import HarmonyTags

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, RETURN = "<|call|>", "<|return|>"
MARKERS = (START, END, MESSAGE, CHANNEL, "<|constrain|>", CALL, RETURN)
BODY_ENDS = (END, CALL, RETURN, START)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


def _header_fields(header: str) -> tuple[str | None, str | None]:
    """A message header's channel and recipient (None where it names none)."""
    channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


def speaks_harmony(tokenizer) -> bool:
    """Whether a tokenizer has harmony's markers, each a single token (GPT-OSS's o200k_harmony): what the engine's
    grammar gate needs too (picovllm/reasoning.py's HarmonyTags)."""
    if tokenizer is None:
        return False
    try:
        HarmonyTags.of(tokenizer, "harmony")
        return True
    except Exception:      # no such markers, or a tokenizer that cannot encode: no harmony
        return False


@dataclass
class HarmonyDelta:
    """What a piece of a reply gave, in the order the reply wrote it: ("reasoning" | "content", text) and ("call",
    ToolCall) parts, a run of one kind's text as one part (a piece may end one message and start the next: content,
    then analysis); its reasoning, content and calls read from them."""
    parts: list[tuple[str, str | ToolCall]] = field(default_factory=list)

    def add(self, kind: str, what: str | ToolCall) -> None:
        if kind != "call" and self.parts and self.parts[-1][0] == kind:
            self.parts[-1] = (kind, self.parts[-1][1] + what)
        else:
            self.parts.append((kind, what))

    @property
    def reasoning(self) -> str:
        return "".join(what for kind, what in self.parts if kind == "reasoning")

    @property
    def content(self) -> str:
        return "".join(what for kind, what in self.parts if kind == "content")

    @property
    def calls(self) -> list[ToolCall]:
        return [what for kind, what in self.parts if kind == "call"]


class HarmonyStream:
    """One reply's text, piece by piece, into reasoning, content and tool calls. policy: the request's tools (calls
    only under tool_choice "auto"; None or another mode: no calls)."""

    def __init__(self, policy: ToolPolicy | None = None, header: str | None = None) -> None:
        """header: the text of the message the prompt leaves open (HarmonyTokens.open_header: its header part way,
        or whole and its <|message|>), read as the reply's start; else None."""
        self.functions = policy.functions if policy is not None and policy.mode == "auto" else {}
        self.parallel = policy.parallel if policy is not None else True
        self.buf = ""
        self.state = "start"       # start (a header may follow), header, body, plain (no harmony: all content)
        self.channel: str | None = None
        self.recipient: str | None = None
        self.args = ""             # a call's body so far
        self.num_calls = 0
        self.reasoned = False      # whether any analysis message came
        if header is not None:
            self.buf, self.state = header, "header"

    def feed(self, piece: str, finished: bool, cut: bool = False) -> HarmonyDelta:
        """What this piece (with whatever waited) gives out. finished: the reply's last piece; cut: it ended
        without its stop token (max_tokens, an abort): a call still open is then not a call."""
        self.buf += piece
        out = HarmonyDelta()
        while True:
            if self.state == "plain":
                if self.buf:
                    out.add("content", self.buf)
                self.buf = ""
                return out
            if self.state == "start":
                head = self.buf.lstrip()
                for marker in (START, CHANNEL):
                    if head.startswith(marker):
                        self.buf, self.state = head[len(START):] if marker == START else head, "header"
                        break
                else:
                    if not head or (not finished and (START.startswith(head) or CHANNEL.startswith(head))):
                        return out         # nothing yet, or a marker may be starting
                    self.state = "plain"
                    continue
            if self.state == "header":
                at = self.buf.find(MESSAGE)
                if at < 0:
                    return out             # a header max_tokens cut short carries no text
                self._open(self.buf[:at])
                self.buf, self.state = self.buf[at + len(MESSAGE):], "body"
            # body: up to the first marker that ends it
            ends = [(i, m) for m in BODY_ENDS if (i := self.buf.find(m)) >= 0]
            if ends:
                at, marker = min(ends)
                self._route(self.buf[:at], out)
                self._close(out, complete=True)
                self.buf = self.buf[at + len(marker):]
                self.state = "header" if marker == START else "start"
                continue
            keep = 0 if finished else max(partial_tag(self.buf, m) for m in BODY_ENDS)
            self._route(self.buf[:len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
            if finished:
                self._close(out, complete=not cut)
            return out

    def _open(self, header: str) -> None:
        self.channel, self.recipient = _header_fields(header)
        self.args = ""
        self.reasoned |= self.channel == "analysis" and self.recipient is None

    def _route(self, text: str, out: HarmonyDelta) -> None:
        if self.recipient is not None:
            self.args += text          # a call's arguments: given out whole when the message ends
        else:
            self._text(text, out)

    def _text(self, text: str, out: HarmonyDelta) -> None:
        if not text:
            return
        if self.channel == "analysis":
            self.reasoned = True
            out.add("reasoning", text)
        else:
            out.add("content", text)

    def _close(self, out: HarmonyDelta, complete: bool) -> None:
        """The message ends: a call to an offered function with an object for arguments is a call, else its text
        goes where its channel's text goes (a built-in tool's call in the reasoning stays reasoning)."""
        if self.recipient is None:
            return
        call = self._call(self.recipient, self.args) if complete else None
        if call is None:
            self._text(self.args, out)
        elif self.parallel or self.num_calls == 0:
            self.num_calls += 1
            out.add("call", call)
        self.recipient, self.args = None, ""

    def _call(self, recipient: str, args: str) -> ToolCall | None:
        name = recipient[len(FUNCTIONS):] if recipient.startswith(FUNCTIONS) else None
        if name not in self.functions:
            return None
        try:
            obj = json.loads(args) if args.strip() else {}
        except UNPARSED:
            return None
        return ToolCall(name, json.dumps(obj, ensure_ascii=False)) if isinstance(obj, dict) else None


def harmony_template_messages(messages: list[dict]) -> list[dict]:
    """Chat messages (template dicts) as GPT-OSS's template takes them: one tool call a message
    (one_call_per_message), and before a call one analysis text. Its template renders a calling message's content
    *as* the analysis and refuses content beside thinking, and transformers copies reasoning_content into thinking;
    so where this server's own reply comes back (reasoning, a commentary preamble as content, a call), the reasoning
    goes as thinking and the preamble, which the template has no place for, is left out."""
    out = []
    for m in one_call_per_message(messages):
        thought = m.get("reasoning_content", m.get("thinking"))
        if m.get("role") == "assistant" and m.get("tool_calls") and m.get("content") and thought:
            m = {k: v for k, v in m.items() if k != "reasoning_content"} | {"content": "", "thinking": thought}
        out.append(m)
    return out


def one_call_per_message(messages: list[dict]) -> list[dict]:
    """Chat messages (template dicts) with each assistant message of several tool calls split into one message a
    call, each followed by its tool result (matched by tool_call_id, else in order): GPT-OSS's chat template renders
    an assistant message's first call only, and harmony writes calls one message each anyway. The first part keeps
    the message's content and reasoning; results that match no call follow the last part, as they came."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        calls = m.get("tool_calls") or []
        if m.get("role") != "assistant" or len(calls) < 2:
            out.append(m)
            i += 1
            continue
        j = i + 1
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        results = list(messages[i + 1:j])
        for k, call in enumerate(calls):
            part = dict(m, tool_calls=[call]) if k == 0 else {"role": "assistant", "content": "", "tool_calls": [call]}
            out.append(part)
            match = next((r for r in results if r.get("tool_call_id") == call.get("id")), None)
            if match is None and results and results[0].get("tool_call_id") is None:
                match = results[0]
            if match is not None:
                results.remove(match)
                out.append(match)
        out.extend(results)
        i = j
    return out


def parse_harmony(text: str, policy: ToolPolicy | None, cut: bool,
                  header: str | None = None) -> tuple[str | None, str | None, list[ToolCall]]:
    """A finished reply's (reasoning, content, calls): reasoning None where no analysis message came, content None
    where there is none (as vLLM's). header: HarmonyStream's."""
    s = HarmonyStream(policy, header)
    d = s.feed(text, True, cut)
    return (d.reasoning if s.reasoned else None), (d.content or None), d.calls


def is_content(header: str) -> bool:
    """Whether a message of this header is content (HarmonyStream's routing): any channel but analysis, to no
    recipient (a call's arguments are not text)."""
    channel, recipient = _header_fields(header)
    return channel != "analysis" and recipient is None


class ContentTokens:
    """Which of a reply's tokens, fed in order, are its content's text (the bodies of content messages: is_content):
    the Responses message's logprobs are theirs, not the headers', the markers' or the analysis'. header: as
    HarmonyStream's. A reply that does not start a harmony message is all content, as HarmonyStream reads it."""

    def __init__(self, marks: "HarmonyTokens", header: str | None = None) -> None:
        self.marks = marks
        self.head: list[int] | None = []        # the open header's ids; None inside a body
        self.prefix = header or ""              # its text from the prompt
        self.content = self.plain = False
        if header is not None and header.endswith(MESSAGE):
            self.head, self.content = None, is_content(header)
        self.first = header is None             # the reply's first token says whether it is harmony at all

    def feed(self, ids: list[int]) -> list[bool]:
        m, out = self.marks, []
        for t in ids:
            if self.first:
                self.first, self.plain = False, t not in (m.start, m.channel)
            if self.plain:
                out.append(True)
            elif self.head is None:           # a body, up to the marker that ends it
                if t in m.ends or t == m.start:
                    self.head, self.prefix = [], ""
                out.append(self.content and t not in m.ends and t != m.start)
            else:
                if t == m.message:
                    header = self.prefix + m.tokenizer.decode(self.head, skip_special_tokens=False)
                    self.head, self.content = None, is_content(header)
                elif t == m.start:
                    self.head, self.prefix = [], ""
                else:
                    self.head.append(t)
                out.append(False)
        return out


class HarmonyTokens:
    """The marker ids, to count a reply's reasoning tokens (usage.completion_tokens_details.reasoning_tokens): the
    tokens of its analysis messages, headers and ends included."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        ids = {m: tokenizer.encode(m, add_special_tokens=False)[0]
               for m in (START, END, MESSAGE, CHANNEL, CALL, RETURN)}
        self.start, self.message, self.channel = ids[START], ids[MESSAGE], ids[CHANNEL]
        self.ends = {ids[END], ids[CALL], ids[RETURN]}

    def open_header(self, prompt_ids: list[int]) -> str | None:
        """The message the prompt leaves open, as HarmonyStream reads it: where the prompt ends inside its body (its
        last marker a <|message|>: continue_final_message), its header (role, channel, recipient) and <|message|>;
        where it ends part way through a header that names a channel (a generation prompt ending in
        `<|start|>assistant<|channel|>final`), that header so far. Else (a bare `<|start|>assistant`, a message
        ended) None: the reply starts a message."""
        for i in range(len(prompt_ids) - 1, -1, -1):
            t = prompt_ids[i]
            if t == self.message:
                begin = i
                while begin > 0 and prompt_ids[begin - 1] != self.start and prompt_ids[begin - 1] not in self.ends:
                    begin -= 1
                return self.tokenizer.decode(prompt_ids[begin:i + 1], skip_special_tokens=False)
            if t == self.start:
                header = self.tokenizer.decode(prompt_ids[i + 1:], skip_special_tokens=False)
                return header if CHANNEL in header else None
            if t in self.ends:
                return None
        return None

    def reasoning_tokens(self, ids: list[int], header: str | None = None) -> int:
        """header: the message the prompt leaves open (open_header), the reply's first message's start: an analysis
        body the reply goes on with counts too."""
        prefix = header or ""
        count, begin, header_end = 0, 0, 0 if prefix.endswith(MESSAGE) else None
        for i, t in enumerate(ids + [self.start]):       # a last message without its end closes at the reply's
            if t == self.message and header_end is None:
                header_end = i
            elif t in self.ends or t == self.start:
                text = prefix + self.tokenizer.decode(ids[begin:header_end], skip_special_tokens=False) \
                    if header_end is not None else ""
                channel, recipient = _header_fields(text)
                if channel == "analysis" and recipient is None:
                    count += min(i + 1, len(ids)) - begin
                begin, header_end, prefix = i + 1, None, ""
        return count
