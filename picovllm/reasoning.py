"""A thinking model's think block (`<think> ... </think>` before its answer, Qwen3's and DeepSeek-R1's): the tags
and where a prompt leaves its output, shared by the engine (structured outputs' grammar governs the answer after the
block: layers/structured_output.py) and the chat server (the block apart from the answer:
entrypoints/openai/reasoning.py). Torch-free."""
from __future__ import annotations

from collections.abc import Sequence

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1", "glm45")    # vLLM's --reasoning-parser names; all by the rules here

# where the output starts: inside a block the prompt opened (DeepSeek-R1's template, Qwen3.5's; or an assistant
# message continued inside its block), after one it closed (Qwen3's with thinking off: an empty block; or an answer
# continued), or where the model may open one (Qwen3's older template)
REASONING, ANSWER, MAY_OPEN = "reasoning", "answer", "may_open"


class ThinkTags:
    """A tokenizer's <think> and </think> ids, and its turn boundaries: its special tokens but these two (the chat
    templates' role and end-of-message markers)."""

    def __init__(self, start: int, end: int, boundaries: frozenset[int] = frozenset()) -> None:
        self.start, self.end, self.boundaries = start, end, boundaries - {start, end}

    @classmethod
    def of(cls, tokenizer, what: str) -> "ThinkTags":
        """ValueError naming `what` (the field that asked for them) where the tokenizer has no such tokens."""
        start, end = think_token_ids(tokenizer, what)
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        special |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                    if getattr(t, "special", False)}
        return cls(start, end, frozenset(special))

    def phase(self, prompt_ids: Sequence[int]) -> str:
        """Where the output starts: scanning back from the prompt's end, the first <think> (inside a block), </think>
        (after one) or turn boundary (a new turn: the model may open one) decides; none: the model may open one. An
        unclosed <think> of an earlier message, behind a boundary, opens nothing."""
        start, end, boundaries = self.start, self.end, self.boundaries
        for t in reversed(prompt_ids):
            if t == start:
                return REASONING
            if t == end:
                return ANSWER
            if t in boundaries:
                return MAY_OPEN
        return MAY_OPEN


def think_token_ids(tokenizer, what: str) -> tuple[int, int]:
    """The ids of <think> and </think>, each a token of its own; ValueError naming `what` (the field that asked for
    them) where the tokenizer has no such tokens."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (THINK_START, THINK_END)]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"{what}: the tokenizer has no {THINK_START} and {THINK_END} tokens (the model does not "
                         f"reason in think blocks)")
    return ids[0][0], ids[1][0]
