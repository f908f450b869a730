"""Reasoning outputs (vLLM's `--reasoning-parser`): a thinking model's reasoning apart from its answer.

Qwen3, DeepSeek-R1 and GLM-4.5 (and their distills, QwQ) reason inside `<think> ... </think>` before they answer;
with a parser the chat endpoint returns that part as the message's `reasoning` (and `reasoning_content`, the name
vLLM used first and clients still read), the rest as `content`, and the Responses endpoint a `reasoning` item before
the message. One rule serves every parser:

- the prompt's last think tag or turn boundary (a special token) is a `<think>`: DeepSeek-R1's template and
  Qwen3.5's open the block there (and an assistant message continued inside its block), the output starts in it;
- else an output that starts (after whitespace) with `<think>` opens one (Qwen3's older template lets the model
  write it);
- else the output is all content (Qwen3 with `chat_template_kwargs: {"enable_thinking": false}`: its template
  closes an empty block in the prompt);
- inside the block, everything before the first `</think>` is reasoning, everything after it content; a block that
  never closes (max_tokens cut it) is all reasoning, and the content null (as vLLM's).

A `<think>` the model writes at the start of a block it is already in (prompt-opened) is dropped, as vLLM does.
The streamed pieces add up to the whole answer's split: a piece that may be the start of a tag waits for the next.
A request whose output a grammar governs (structured outputs, tool_choice "required" or a named function) is split
the same way: the server gives its constraint the parser (StructuredOutputsParams.reasoning_parser, serving.py's
SampleGroup), and the engine, colocated or P and D, holds the grammar back until the block ends
(layers/structured_output.py), as vLLM does.
"""
from __future__ import annotations

from picovllm.entrypoints.openai.tool_calls import partial_tag
from picovllm.reasoning import REASONING, REASONING_PARSERS, THINK_END, THINK_START, ThinkTags

__all__ = ["PARSERS", "ReasoningSplitter", "opened_in_prompt", "split_reasoning"]
START, END, PARSERS = THINK_START, THINK_END, REASONING_PARSERS
HELP = ("split a thinking model's <think> ... </think> from its answer: chat's message.reasoning (and "
        "reasoning_content), a reasoning item in /v1/responses (vLLM's flag: qwen3, deepseek_r1, glm45; "
        "openai_gptoss: GPT-OSS's harmony, which the server reads without the flag too)")


def opened_in_prompt(tags: ThinkTags, prompt_ids: list[int]) -> bool:
    """Whether the prompt opens a think block for the output (picovllm/reasoning.py's ThinkTags.phase, as the
    engine's grammar gate reads it)."""
    return tags.phase(prompt_ids) == REASONING


class ReasoningSplitter:
    """One output's text, piece by piece, into (reasoning, content) pieces."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened            # the prompt left a block open: no <think> needed
        self.state = "start"            # start (nothing decided yet), reasoning, content
        self.buf = ""                   # text not yet given out
        self.saw_end = False

    def feed(self, piece: str, finished: bool) -> tuple[str, str]:
        """The reasoning and the content this piece (with whatever waited) gives out; finished: the last piece."""
        self.buf += piece
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(START):
                self.buf, self.state = head[len(START):], "reasoning"
            elif (head and not START.startswith(head)) or finished:
                self.state = "reasoning" if self.opened else "content"
            else:
                return "", ""           # whitespace or the start of <think> so far: wait
        if self.state == "reasoning":
            end = self.buf.find(END)
            if end >= 0:
                reasoning, self.buf = self.buf[:end], self.buf[end + len(END):]
                self.state, self.saw_end = "content", True
            else:
                keep = 0 if finished else partial_tag(self.buf, END)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
        content, self.buf = self.buf, ""
        return reasoning, content

    @property
    def reasoned(self) -> bool:
        """Whether the output had a reasoning block (so far)."""
        return self.state == "reasoning" or self.saw_end


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str | None]:
    """A finished output's (reasoning, content): None where it has none (no block: reasoning None; a block that
    never closed: content None), as vLLM's."""
    s = ReasoningSplitter(opened)
    reasoning, content = s.feed(text, True)
    if not s.reasoned:
        return None, content
    return reasoning, (content if s.saw_end else None)
