"""A thinking model's think block (`<think> ... </think>` before its answer, Qwen3's and DeepSeek-R1's): the tags
and where a prompt leaves its output, shared by the engine (structured outputs' grammar governs the answer after the
block: layers/structured_output.py) and the chat server (the block apart from the answer:
entrypoints/openai/reasoning.py). Torch-free."""
from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")     # vLLM's --reasoning-parser names; both by the rules here
PROMPT_TAIL = 16      # the prompt's last tokens, decoded, tell where it leaves the output

# where the output starts: inside a block the prompt opened (DeepSeek-R1's template, Qwen3.5's), after one it closed
# (Qwen3's with thinking off: an empty block), or where the model may open one (Qwen3's older template)
REASONING, ANSWER, MAY_OPEN = "reasoning", "answer", "may_open"


def think_token_ids(tokenizer, what: str) -> tuple[int, int]:
    """The ids of <think> and </think>, each a token of its own; ValueError naming `what` (the field that asked for
    them) where the tokenizer has no such tokens."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (THINK_START, THINK_END)]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"{what}: the tokenizer has no {THINK_START} and {THINK_END} tokens (the model does not "
                         f"reason in think blocks)")
    return ids[0][0], ids[1][0]


def reasoning_phase(prompt_tail: str) -> str:
    """Where the output starts, from the prompt's last tokens decoded: inside a block if it ends with <think> (and
    whitespace), after one if it ends with </think>, else where the model may open one. An unclosed <think> further
    back (an earlier message's) opens nothing."""
    tail = prompt_tail.rstrip()
    return REASONING if tail.endswith(THINK_START) else ANSWER if tail.endswith(THINK_END) else MAY_OPEN
