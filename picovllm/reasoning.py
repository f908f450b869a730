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

    def begin(self, prompt_ids: Sequence[int]) -> tuple[str, int]:
        """(phase, progress) where the prompt leaves the output (progress: none here)."""
        return self.phase(prompt_ids), 0

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.start, self.end

    def advance(self, phase: str, progress: int, token: int) -> tuple[bool, str, int]:
        """A sampled token against the gate, before the answer: (whether it is the think block's: its start at a
        first token that may open one, anything inside it, its end included; the phase after it; progress, unused
        here)."""
        if phase == MAY_OPEN:
            return (True, REASONING, 0) if token == self.start else (False, phase, 0)
        return True, ANSWER if token == self.end else phase, 0


class HarmonyTags:
    """GPT-OSS's harmony replies: everything before the final channel's body (analysis and commentary messages,
    headers included) is reasoning; the answer is the body after a `<|channel|>final ... <|message|>` header, where
    vLLM's openai_gptoss parser ends the reasoning (as it, up to MAX_GAP tokens between `final` and `<|message|>`:
    `<|channel|>final <|constrain|>json<|message|>`). The gate of ThinkTags' kind (begin, phase, advance) for
    structured outputs. Progress through a header: 0 none; 1 after <|channel|>; 1 + k after k tokens of the word
    `final`; from 1 + len(word) on, inside the final header (1 + len(word) + the tokens since the word)."""
    MAX_GAP = 20

    def __init__(self, channel: int, word: Sequence[int], message: int, resets: frozenset[int],
                 markers: frozenset[int]) -> None:
        self.channel, self.word, self.message = channel, tuple(word), message
        self.resets = resets          # tokens that end any header: <|start|>, <|end|>, <|return|>, <|call|>
        self.markers = markers        # every harmony marker the tokenizer has
        self.header = 1 + len(self.word)

    @classmethod
    def of(cls, tokenizer, what: str) -> "HarmonyTags":
        """ValueError naming `what` (the field that asked) where the tokenizer does not have harmony's markers
        (<|start|>, <|end|>, <|message|>, <|channel|>: what the chat server reads harmony by)."""
        ids = {m: tokenizer.encode(m, add_special_tokens=False) for m in HARMONY_MARKERS}
        needed = HARMONY_MARKERS[:4]
        if any(len(ids[m]) != 1 for m in needed):
            raise ValueError(f"{what}: the tokenizer has no harmony markers ({', '.join(needed)}) as tokens of their "
                             f"own (the model does not reply in GPT-OSS's harmony format)")
        one = {m: i[0] for m, i in ids.items() if len(i) == 1}
        final = tokenizer.encode(HARMONY_FINAL, add_special_tokens=False)
        word = final[1:-1]     # "final" between the two markers
        if final[:1] != [one["<|channel|>"]] or final[-1:] != [one["<|message|>"]] or not word:
            raise ValueError(f"{what}: the tokenizer does not encode {HARMONY_FINAL!r} as <|channel|>, final, "
                             f"<|message|>")
        resets = frozenset(one[m] for m in ("<|start|>", "<|end|>", "<|return|>", "<|call|>") if m in one)
        return cls(one["<|channel|>"], word, one["<|message|>"], resets, frozenset(one.values()))

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self.markers) + self.word

    def begin(self, prompt_ids: Sequence[int]) -> tuple[str, int]:
        """(phase, progress) where the prompt leaves the output: the answer where it ends inside a final message's
        body or has no marker at all (a plain-text prompt); else reasoning, part way through a final header if it
        ends in one (`<|start|>assistant<|channel|>final`)."""
        begin = max((i for i, t in enumerate(prompt_ids) if t in self.resets), default=-1)
        if begin < 0 and not any(t in self.markers for t in prompt_ids):
            return ANSWER, 0
        phase, progress = REASONING, 0
        for t in prompt_ids[begin + 1:]:       # since the last message boundary
            if phase == REASONING:
                _, phase, progress = self.advance(phase, progress, t)
        return phase, progress

    def phase(self, prompt_ids: Sequence[int]) -> str:
        return self.begin(prompt_ids)[0]

    def advance(self, phase: str, progress: int, token: int) -> tuple[bool, str, int]:
        """A sampled token before the answer: every one is reasoning, the final header's <|message|> included, after
        which the answer starts (the class doc says what progress counts)."""
        if token == self.channel:
            return True, phase, 1
        if token in self.resets:
            return True, phase, 0
        if 1 <= progress < self.header:                   # <|channel|> and part of "final" so far
            return True, phase, progress + 1 if token == self.word[progress - 1] else 0
        if progress >= self.header:                       # inside the final header
            if token == self.message:
                return True, ANSWER, 0
            return True, phase, progress + 1 if progress - self.header < self.MAX_GAP else 0
        return True, phase, 0


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
