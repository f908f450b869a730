"""`picovllm generate`, `picovllm chat` and `picovllm batch`: text generation from the terminal or a file."""
from __future__ import annotations

import argparse
import json
import sys
import time

from picovllm.entrypoints.commands.args import (add_model_and_engine_args, add_sampling_args, engine_kwargs,
                                                 sampling_kwargs, sampling_params)
from picovllm.disagg.cli import add_disagg_arguments, run_disagg_generate


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate from one prompt, streaming the text",
                              description="Generate from one prompt and stream the text to stdout.")
    p.add_argument("prompt", help="the prompt ('-' reads it from stdin)")
    _add_chat_args(p)
    p.add_argument("--stats", action="store_true", help="print token count, time and finish reason to stderr")
    add_sampling_args(p)
    add_model_and_engine_args(p)
    add_disagg_arguments(p)
    p.set_defaults(func=run_generate)

    p = subparsers.add_parser("chat", help="interactive multi-turn chat on stdin/stdout",
                              description="Chat with the model: one user turn per line; /reset clears the "
                                          "history, /exit (or end of input) quits.")
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(p, max_tokens=512)
    add_model_and_engine_args(p)
    p.set_defaults(func=run_chat)

    p = subparsers.add_parser("batch", help="generate for every line of a JSONL file",
                              description="Each input line is {\"prompt\": str} or {\"prompt_token_ids\": [...]} "
                                          "or {\"messages\": [...]}, optionally with SamplingParams fields "
                                          "(temperature, max_tokens, ...) overriding the flags, and an \"id\". "
                                          "Output lines come in input order.")
    p.add_argument("--input", "-i", required=True, help="input JSONL file ('-' for stdin)")
    p.add_argument("--output", "-o", default="-", help="output JSONL file (default: stdout)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_sampling_args(p)
    add_model_and_engine_args(p)
    p.set_defaults(func=run_batch)


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: when the model has one)")
    p.add_argument("--system", default=None, help="system prompt (with --chat)")


def _make_llm(args: argparse.Namespace):
    from picovllm.entrypoints.llm import LLM
    return LLM(**engine_kwargs(args))


def _has_chat_template(llm) -> bool:
    tok = llm.get_tokenizer()
    return tok is not None and bool(getattr(tok, "chat_template", None))


def _messages(system: str | None, history: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + history


# -- generate ------------------------------------------------------------------------------------
def run_generate(args: argparse.Namespace) -> int:
    if args.disagg:   # P and D engines in their own processes; the raw prompt, no chat template
        args.prompts = [sys.stdin.read() if args.prompt == "-" else args.prompt]
        return run_disagg_generate(args)
    from picovllm.entrypoints.streaming import StreamedRequest

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = sampling_params(args)
    llm = _make_llm(args)
    use_chat = _has_chat_template(llm) if args.chat is None else args.chat
    if use_chat:
        prompt = llm.apply_chat_template(_messages(args.system, [{"role": "user", "content": prompt}]))
    t0 = time.time()
    stream = StreamedRequest(llm.engine, prompt, params)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        out = stream.output
        n, dt = len(out.outputs[0].token_ids), time.time() - t0
        print(f"[{n} tokens in {dt:.2f} s, {n / max(dt, 1e-9):.1f} tok/s, finish_reason={out.outputs[0].finish_reason}]",
              file=sys.stderr)
    return 0


# -- chat ----------------------------------------------------------------------------------------
def run_chat(args: argparse.Namespace) -> int:
    from picovllm.entrypoints.streaming import StreamedRequest

    llm = _make_llm(args)
    if not _has_chat_template(llm):
        raise ValueError("--model has no chat template: use `picovllm generate --no-chat` instead")
    params = sampling_params(args)
    interactive = sys.stdin.isatty()
    if interactive:
        print("picovllm chat: one message per line; /reset clears the history, /exit quits.", file=sys.stderr)
    history: list[dict] = []
    while True:
        line = _read_line(interactive)
        if line is None or line.strip() in ("/exit", "/quit"):
            return 0
        line = line.strip()
        if not line:
            continue
        if line == "/reset":
            history = []
            continue
        history.append({"role": "user", "content": line})
        try:
            ids = llm.apply_chat_template(_messages(args.system, history))
            reply = []
            for piece in StreamedRequest(llm.engine, ids, params):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except ValueError as e:          # e.g. the conversation outgrew max_model_len
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})


def _read_line(interactive: bool) -> str | None:
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return line if line else None


# -- batch ---------------------------------------------------------------------------------------
def run_batch(args: argparse.Namespace) -> int:
    from picovllm.entrypoints.batch_io import read_batch, result_record

    llm = _make_llm(args)
    items = read_batch(args.input, sampling_kwargs(args), llm)
    ids: list[str] = []
    for item in items:
        if item.error is None:
            try:
                ids.append(llm.engine.add_request(item.prompt, item.params))
            except ValueError as e:
                item.error = f"line {item.index + 1}: {e}"
    outputs = iter(llm._run(ids, use_tqdm=not args.no_progress))
    out_file = sys.stdout if args.output == "-" else open(args.output, "w")
    try:
        for item in items:
            out = None if item.error is not None else next(outputs)
            out_file.write(json.dumps(result_record(item, out)) + "\n")
    finally:
        if out_file is not sys.stdout:
            out_file.close()
    failed = sum(item.error is not None for item in items)
    if failed:
        print(f"picovllm batch: {failed} of {len(items)} lines failed (see their \"error\" field)", file=sys.stderr)
    return 1 if failed else 0
