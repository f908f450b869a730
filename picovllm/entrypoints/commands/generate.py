"""`picovllm generate`, `picovllm chat` and `picovllm batch`: text generation from the terminal or a file."""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

from picovllm.entrypoints.commands.args import (add_model_and_engine_args, add_sampling_args, engine_kwargs,
                                                 flags_given, sampling_kwargs, sampling_params)
from picovllm.disagg.cli import add_disagg_arguments

# The engine flags `generate --disagg` hands its two engines (disagg.cli.disagg_options; test_cli checks the two
# agree), and one no engine reads: the others would be dropped there, so they are refused
DISAGG_ENGINE_FLAGS = ("dtype", "max_model_len", "block_size", "num_kv_blocks", "disk_cache", "kv_cache_dtype",
                       "revision", "download_dir", "hf_overrides", "max_logprobs", "speculative_config",
                       "trust_remote_code")


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
                                          "history, /exit (or end of input) quits, /help lists these.")
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(p, max_tokens=512)
    add_model_and_engine_args(p)
    p.set_defaults(func=run_chat)

    p = subparsers.add_parser("batch", help="generate for every line of a JSONL file",
                              description="Each input line is {\"prompt\": str} or {\"prompt_token_ids\": [...]} "
                                          "or {\"messages\": [...]}, optionally with SamplingParams fields "
                                          "(temperature, max_tokens, ...) overriding the flags, and an \"id\". "
                                          "Output lines come in input order, each written as soon as it "
                                          "and all before it are done (the file is read a window at a time).")
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


def _has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def _messages(system: str | None, history: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + history


# -- generate ------------------------------------------------------------------------------------
def run_generate(args: argparse.Namespace) -> int:
    """One prompt, colocated or (--disagg) with P and D in processes of their own: the same prompt handling
    (chat template by default, --no-chat, --system), the same text on stdout, timings on stderr with --stats."""
    _check_disagg_flags(args)
    if args.chat is False and args.system is not None:     # before the model loads
        raise ValueError("--system is the chat template's system message: it does not apply with --no-chat")
    params = sampling_params(args)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.disagg:
        return _generate_disaggregated(args, text, params)
    from picovllm.entrypoints.streaming import StreamedRequest

    llm = _make_llm(args)
    prompt = _prompt(llm.get_tokenizer(), text, args)
    t0 = time.time()
    stream = StreamedRequest(llm.engine, prompt, params)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        _print_stats(stream.output, time.time() - t0)
    return 0


def _check_disagg_flags(args: argparse.Namespace) -> None:
    """ValueError naming a flag the mode would ignore: a disaggregation flag without --disagg, an engine flag that
    --disagg does not hand its engines."""
    if not args.disagg:
        given = flags_given(args, lambda p: add_disagg_arguments(p, switch=False))
        if given:
            raise ValueError(f"{given[0]} applies to --disagg only")
        return
    kept = {"--" + name.replace("_", "-") for name in DISAGG_ENGINE_FLAGS}
    given = [flag for flag in flags_given(args, add_model_and_engine_args) if flag not in kept | {"--model"}]
    if given:
        raise ValueError(f"{given[0]} does not apply with --disagg (its engines take --model, "
                         f"{', '.join(sorted(kept - {'--trust-remote-code'}))} and the disaggregation flags)")


def _prompt(tokenizer, text: str, args: argparse.Namespace) -> str | list[int]:
    """The text as the model gets it: through the chat template when --chat (default: the model has one)."""
    from picovllm.entrypoints.llm import chat_prompt_ids

    use_chat = _has_chat_template(tokenizer) if args.chat is None else args.chat
    if not use_chat:
        if args.system is not None:     # it would be dropped without a word
            raise ValueError("--system is the chat template's system message, and --model has no chat template "
                             "(--chat-less prompts take no system message)")
        return text
    return chat_prompt_ids(tokenizer, _messages(args.system, [{"role": "user", "content": text}]))


def _generate_disaggregated(args: argparse.Namespace, text: str, params) -> int:
    from picovllm.disagg.cli import disagg_options
    from picovllm.disagg.driver import DisaggLLM
    from picovllm.loader import open_model_source

    source = open_model_source(args.model, args.disk_cache, revision=args.revision,   # the tokenizer, for the
                               download_dir=args.download_dir, hf_overrides=args.hf_overrides)   # chat template
    tokenizer = source.load_tokenizer() if source.load_tokenizer is not None else None
    prompt = _prompt(tokenizer, text, args)
    with DisaggLLM(args.model, **disagg_options(args)) as llm:
        t0 = time.time()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    if out.error:
        print(f"picovllm generate: error: {out.error}", file=sys.stderr)
        return 1
    sys.stdout.write(out.outputs[0].text + "\n")
    if args.stats:
        _print_stats(out, time.time() - t0)
    return 0


def _print_stats(out, seconds: float) -> None:
    comp, m = out.outputs[0], out.metrics
    n = len(comp.token_ids)
    line = f"[{n} tokens in {seconds:.2f} s, {n / max(seconds, 1e-9):.1f} tok/s, finish_reason={comp.finish_reason}"
    if m is not None and m.ttft is not None:
        itl = m.itls
        line += (f", TTFT {m.ttft * 1e3:.1f} ms, ITL mean {statistics.mean(itl) * 1e3 if itl else 0:.1f} ms, "
                 f"max {max(itl) * 1e3 if itl else 0:.1f} ms")
    print(line + "]", file=sys.stderr)


# -- chat ----------------------------------------------------------------------------------------
def run_chat(args: argparse.Namespace) -> int:
    from picovllm.entrypoints.streaming import StreamedRequest

    llm = _make_llm(args)
    if not _has_chat_template(llm.get_tokenizer()):
        raise ValueError("--model has no chat template: use `picovllm generate --no-chat` instead")
    params = sampling_params(args)
    interactive = sys.stdin.isatty()
    usage = "picovllm chat: one message per line; /reset clears the history, /exit quits, /help says this."
    if interactive:
        print(usage, file=sys.stderr)
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
        if line == "/help":          # not a message for the model
            print(usage, file=sys.stderr)
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
    """Every line of --input through the engine, streamed (batch_io.stream_batch): a window of lines per request
    the engine may hold, each output line written once it and all before it are done."""
    from picovllm.entrypoints.batch_io import check_input, check_not_input, check_output, read_lines, stream_batch
    from picovllm.entrypoints.openai.run_batch import WINDOW_PER_SLOT

    check_input(args.input, "--input")
    check_output(args.output, "--output")
    check_not_input(args.output, args.input, "--output", "--input")
    llm = _make_llm(args)
    with contextlib.ExitStack() as stack:      # the output opened once the model has loaded: a failed load costs none
        out_file = sys.stdout if args.output == "-" else stack.enter_context(open(args.output, "w"))
        lines = stack.enter_context(contextlib.closing(read_lines(args.input)))

        def write(rec: dict) -> None:
            out_file.write(json.dumps(rec) + "\n")
            out_file.flush()        # a run cut short keeps every line it answered

        written, failed = stream_batch(llm, lines, sampling_kwargs(args), write,
                                       WINDOW_PER_SLOT * llm.engine.config.max_num_seqs, use_tqdm=not args.no_progress)
    if failed:
        print(f"picovllm batch: {failed} of {written} lines failed (see their \"error\" field)", file=sys.stderr)
    return 1 if failed else 0
