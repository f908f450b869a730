"""A thinking model's think block (`<think> ... </think>` before its answer, Qwen3's and DeepSeek-R1's), or GPT-OSS's
harmony messages before its final one: the tokens and where a prompt leaves its output, shared by the engine
(structured outputs' grammar governs the answer after the reasoning: layers/structured_output.py) and the chat server
(the block apart from the answer: entrypoints/openai/reasoning.py; harmony's messages: harmony.py). Torch-free."""
from __future__ import annotations

from collections.abc import Sequence

THINK_START, THINK_END = "<think>", "</think>"
HARMONY_PARSER = "openai_gptoss"      # GPT-OSS's harmony replies (HarmonyTags), vLLM's name
# vLLM's --reasoning-parser names: think blocks by ThinkTags' rules, harmony by HarmonyTags'
REASONING_PARSERS = ("qwen3", "deepseek_r1", "glm45", HARMONY_PARSER)
# harmony's markers, each a token of its own in GPT-OSS's o200k_harmony; FINAL opens the answer's body
HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
HARMONY_FINAL = "<|channel|>final<|message|>"

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

    def advance(self, phase: str, progress: int, token: int) -> tuple[bool, str, int]:
        """A sampled token against the gate, before the answer: (whether it is the think block's: its start at a
        first token that may open one, anything inside it, its end included; the phase after it; progress, unused
        here)."""
        if phase == MAY_OPEN:
            return (True, REASONING, 0) if token == self.start else (False, phase, 0)
        return True, ANSWER if token == self.end else phase, 0


class HarmonyTags:
    """GPT-OSS's harmony replies: everything before the final channel's body (analysis and commentary messages,
    headers included) is reasoning; the answer is the body after `<|channel|>final<|message|>`, where vLLM's
    openai_gptoss parser ends the reasoning. The gate of ThinkTags' kind (phase, advance) for structured outputs."""

    def __init__(self, final: Sequence[int], message: int, markers: frozenset[int]) -> None:
        self.final, self.message, self.markers = tuple(final), message, markers

    @classmethod
    def of(cls, tokenizer, what: str) -> "HarmonyTags":
        """ValueError naming `what` (the field that asked) where the tokenizer does not have harmony's markers."""
        ids = [tokenizer.encode(m, add_special_tokens=False) for m in HARMONY_MARKERS]
        if any(len(i) != 1 for i in ids):
            raise ValueError(f"{what}: the tokenizer has no harmony markers ({', '.join(HARMONY_MARKERS)}) as tokens "
                             f"of their own (the model does not reply in GPT-OSS's harmony format)")
        markers = {m: i[0] for m, i in zip(HARMONY_MARKERS, ids)}
        return cls(tokenizer.encode(HARMONY_FINAL, add_special_tokens=False), markers["<|message|>"],
                   frozenset(markers.values()))

    def phase(self, prompt_ids: Sequence[int]) -> str:
        """Where the output starts: in the answer where the prompt ends inside a final message's body (its last
        marker the <|message|> of `<|channel|>final<|message|>`) or has no marker at all (a plain-text prompt);
        else (a header opened: `<|start|>assistant`; another channel's body; a message ended) reasoning."""
        n = len(self.final)
        for i in range(len(prompt_ids) - 1, -1, -1):
            if prompt_ids[i] in self.markers:
                final = prompt_ids[i] == self.message and tuple(prompt_ids[max(0, i - n + 1):i + 1]) == self.final
                return ANSWER if final else REASONING
        return ANSWER

    def advance(self, phase: str, progress: int, token: int) -> tuple[bool, str, int]:
        """A sampled token before the answer: every one is reasoning, the final header's last included, after which
        the answer starts; progress: how much of the final header the tokens so far end with."""
        if token == self.final[progress]:
            progress += 1
            if progress == len(self.final):
                return True, ANSWER, 0
            return True, phase, progress
        return True, phase, 1 if token == self.final[0] else 0


def reasoning_gate(tokenizer, parser: str, what: str) -> ThinkTags | HarmonyTags:
    """The gate a reasoning parser's name stands for (HarmonyTags for openai_gptoss, else ThinkTags); ValueError
    naming `what` where the tokenizer lacks its tokens."""
    return (HarmonyTags if parser == HARMONY_PARSER else ThinkTags).of(tokenizer, what)


def think_token_ids(tokenizer, what: str) -> tuple[int, int]:
    """The ids of <think> and </think>, each a token of its own; ValueError naming `what` (the field that asked for
    them) where the tokenizer has no such tokens."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (THINK_START, THINK_END)]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"{what}: the tokenizer has no {THINK_START} and {THINK_END} tokens (the model does not "
                         f"reason in think blocks)")
    return ids[0][0], ids[1][0]
