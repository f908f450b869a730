"""Streamed tool calls (tool_choice "auto"): the chat server's AutoToolStream.feed at each token, by output length.

    python benchmarks/tool_stream.py [--at 100 2000] [--parsers hermes mistral llama3_json deepseek_v3]

The server feeds a request's whole text so far at every token, on its event loop: a feed should cost what the new
token adds, not what the text holds (the section formats still look for their markers in the whole text before a
call comes). Two texts a parser: prose, and a call whose block (or section) is still open,
its arguments growing (a tool writing a long file). Prints the median us a feed over 200 tokens of 4 characters
around each length.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OPEN = {"hermes": '<tool_call>{"name": "f", "arguments": {"x": "',
        "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {"x": "',
        "llama3_json": '{"name": "f", "parameters": {"x": "',
        "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"x\": \""}


def per_feed_us(policy, head: str, tokens: int) -> float:
    from picovllm.entrypoints.openai.tool_parsers.streaming import AutoToolStream
    stream, text = AutoToolStream(policy), head
    stream.feed(text, False)
    times = []
    for _ in range(tokens):
        text += "abcd"
        t0 = time.perf_counter()
        stream.feed(text, False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--at", type=int, nargs="+", default=[100, 2000], help="output lengths, tokens of 4 characters")
    p.add_argument("--parsers", nargs="+", default=list(OPEN))
    args = p.parse_args()
    from picovllm.entrypoints.openai.tool_parsers.policy import ToolPolicy
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for parser in args.parsers:
        policy = ToolPolicy(tools, "auto", parser=parser)
        for kind, start in (("prose", "word "), ("open call", OPEN[parser])):
            row = [f"{n}: {per_feed_us(policy, start + 'abcd' * n, 200):6.2f}" for n in args.at]
            print(f"  {parser:12s} {kind:9s} us a feed at " + ", ".join(row))


if __name__ == "__main__":
    main()
