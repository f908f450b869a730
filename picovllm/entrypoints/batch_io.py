"""The JSONL format of `picovllm batch`: one request per input line, one result per output line.

Input line: exactly one of "prompt" (text), "prompt_token_ids" (list of ints) or "messages" (a chat
conversation, run through the model's chat template); optional "id" (echoed back) and any
SamplingParams field (temperature, max_tokens, stop, seed, penalties, logit_bias with string keys, n,
prompt_logprobs, ...) overriding the command's flags.
Output line: "index", "id", "num_prompt_tokens", then the sample's "text", "token_ids", "finish_reason",
"stop_reason" (and "logprobs") -- or, with n > 1, "outputs": a list of those, one per sample -- and
"prompt_logprobs" when asked for ({token id: logprob} per prompt token, null for the first).
A bad line becomes an output line with an "error" naming the field; the other lines still run.
stream_batch runs a file as it reads it: a window of lines at a time, each output line written once it and every
line before it are done, so memory does not grow with the file and a run cut short keeps what it wrote.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from picovllm.outputs import RequestOutput, json_logprob
from picovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from picovllm.entrypoints.parallel_sampling import SampleBatch

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
SAMPLING_KEYS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_NOT_UTF8 = re.compile("[\udc80-\udcff]")     # read_lines' escapes of bytes that are not UTF-8


@dataclass
class BatchItem:
    index: int                               # 0-based line number among non-empty lines
    line: int = 0                            # 1-based line number in the file (what an error names)
    id: object | None = None
    prompt: str | list[int] | None = None    # what goes to Engine.add_request
    params: SamplingParams | None = None
    error: str | None = None


def parse_line(index: int, line: str, defaults: dict, llm, line_number: int) -> BatchItem:
    item = BatchItem(index, line_number)
    try:
        why = utf8_error(line)
        if why is not None:
            raise ValueError(why)
        rec = json.loads(line)
        if not isinstance(rec, dict):
            raise ValueError("each line must be a JSON object")
        item.id = rec.get("id")
        unknown = sorted(set(rec) - set(PROMPT_KEYS) - SAMPLING_KEYS - {"id"})
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r}")
        given = [k for k in PROMPT_KEYS if k in rec]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(PROMPT_KEYS)}")
        key = given[0]
        if key == "messages":     # a ValueError naming messages[i].<field> if a message is not one
            item.prompt = llm.apply_chat_template(rec[key])
        elif key == "prompt" and not isinstance(rec[key], str):
            raise ValueError("field 'prompt' must be a string (token ids go in 'prompt_token_ids')")
        elif key == "prompt_token_ids" and not (isinstance(rec[key], list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in rec[key])):
            raise ValueError("field 'prompt_token_ids' must be a list of int token ids (text goes in 'prompt')")
        else:
            item.prompt = rec[key]
        item.params = SamplingParams(**{**defaults, **{k: v for k, v in rec.items() if k in SAMPLING_KEYS}})
    except (ValueError, TypeError) as e:       # json.JSONDecodeError is a ValueError
        item.error = f"line {item.line}: {e}"
    return item


# Before any work, so that a mistyped path costs no model load and loses no results: ValueError naming the flag.
def check_input(path: str, flag: str) -> None:
    """The input file (a path, or "-" for stdin) is there to read: a regular file, or anything else open() reads
    lines from (a named pipe, /dev/stdin, a shell's process substitution `<(...)`), as vLLM's run-batch opens it."""
    if path == "-":
        return
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path!r}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r}: is a folder, not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag} {path!r}: not readable")


def check_output(path: str | None, flag: str) -> None:
    """The output file's folder is there to write into (a path, "-" for stdout, or None for none)."""
    if path is not None and path != "-":
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"{flag} {path!r}: cannot write a file there (no such folder, or not writable)")


def check_not_input(output: str, input: str, flag: str, input_flag: str) -> None:
    """The output file is not the input file, which is read as the output is written (opening it would empty it).
    stdin/stdout ("-") and URLs are never the same file."""
    local = "-" not in (input, output) and not is_url(input) and not is_url(output)
    if local and os.path.exists(output) and os.path.samefile(input, output):
        raise ValueError(f"{flag} {output!r} is {input_flag}: the input is read as the output is written; give "
                         f"another path")


def is_url(path: str) -> bool:
    """An http(s) URL rather than a local path: run-batch GETs its input and PUTs its output there, as vLLM's."""
    return path.startswith(("http://", "https://"))


def download(url: str, folder: str | None, flag: str) -> str:
    """The text at url, streamed into a new file in folder (None: the system's temporary folder), whose path is
    returned: a batch of any size is read from disk, never held in memory. ValueError naming the flag if it cannot
    be had."""
    with tempfile.NamedTemporaryFile("wb", dir=folder, prefix="picovllm_batch_input_", suffix=".jsonl",
                                     delete=False) as f:
        try:
            with _http("GET", url, flag) as r:
                for chunk in r.iter_bytes():
                    f.write(chunk)
        except BaseException:
            f.close()
            os.unlink(f.name)
            raise
    return f.name


def upload(url: str, path: str, flag: str) -> None:
    """PUT the file at path to url, read in chunks (its size as Content-Length); ValueError naming the flag if the
    server does not take it."""
    with _http("PUT", url, flag, content=_FileChunks(path), headers={"content-length": str(os.path.getsize(path))}):
        pass


class _FileChunks:
    """A file's bytes in chunks, read from its start at each iteration: a redirected PUT sends the body again (an
    iterator, read once, would send nothing the second time, under the Content-Length of the whole file)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 16):
                yield chunk


@contextlib.contextmanager
def _http(method: str, url: str, flag: str, **kw) -> Iterator:
    """The answer to a request, its body not yet read, once its status says success; ValueError naming the flag if
    none comes (refused, no such host, timed out, no host) or the status is an error."""
    import httpx
    try:
        with httpx.stream(method, url, follow_redirects=True, timeout=60, **kw) as r:
            if not r.is_success:
                why = f"the server answered {r.status_code} {r.reason_phrase}"
            else:
                why = None
                yield r
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        why = str(e) or type(e).__name__
    if why is not None:
        raise ValueError(f"{flag} {url!r}: {method} failed: {why}")


def read_lines(path: str) -> Iterator[tuple[int, str]]:
    """A JSONL file's (stdin's, path "-") non-blank lines, one at a time, each with its 1-based number: UTF-8, a
    byte-order mark before the first line dropped, a line ending at \\n, \\r\\n or \\r. Bytes that are not UTF-8
    cost only their line: they come as surrogate escapes, which utf8_error names."""
    binary = sys.stdin.buffer if path == "-" else open(path, "rb")
    f = io.TextIOWrapper(binary, encoding="utf-8-sig", errors="surrogateescape", newline=None)
    try:
        yield from ((number, line) for number, line in enumerate(f, 1) if line.strip())
    finally:
        if path == "-":
            f.detach()      # stdin stays open
        else:
            f.close()


def utf8_error(line: str) -> str | None:
    """Why a line read_lines gave is no text (its first byte that is not UTF-8), or None if it is."""
    bad = _NOT_UTF8.search(line)
    if bad is None:
        return None
    return f"not UTF-8 text (byte 0x{ord(bad.group()) - 0xdc00:02x} at character {bad.start() + 1})"


def read_batch(path: str, defaults: dict, llm) -> list[BatchItem]:
    return [parse_line(i, line, defaults, llm, number) for i, (number, line) in enumerate(read_lines(path))]


def stream_batch(llm, lines: Iterable[tuple[int, str]], defaults: dict, write: Callable[[dict], None], window: int,
                 use_tqdm: bool = False) -> tuple[int, int]:
    """Run each numbered line (read_lines') on llm's engine, handing its output record (result_record) to write in
    input order as soon as it and every line before it are done. Lines are read as room frees up, at most `window`
    past the oldest one not yet written; a bad line's record carries its error and the others run. defaults: the
    SamplingParams fields a line does not give. Returns (lines written, lines with an error)."""
    from picovllm.engine.step_loop import StepLoop
    from picovllm.entrypoints.llm import _progress_bar, _TokenRates

    engine, loop = llm.engine, StepLoop(llm.engine, unfinished_outputs=False)
    numbered = enumerate(lines)
    pending: deque[_InFlight] = deque()
    final: dict[str, RequestOutput] = {}       # the finished samples of the lines in pending, by request id
    bar = _progress_bar(use_tqdm, None, "Processed prompts")    # its total is known once the whole file is read
    rates = _TokenRates(engine) if use_tqdm else None
    written = failed = 0
    read_all = False
    try:
        while True:
            for index, (number, text) in islice(numbered, window - len(pending)):
                pending.append(_InFlight.start(parse_line(index, text, defaults, llm, number), engine))
            if len(pending) < window and not read_all:      # the file ended before the window filled
                read_all, bar.total = True, written + len(pending)
            while pending and pending[0].done(final):
                head = pending.popleft()
                rec = result_record(head.item, head.output(final))
                write(rec)
                written, failed = written + 1, failed + ("error" in rec)
                bar.update(1)
            if not pending:
                if read_all:
                    return written, failed
                continue
            for line in pending:
                line.add_ready_siblings()
            if not engine.has_unfinished_requests():     # no step would ever finish the head: never loop forever
                raise RuntimeError(f"line {pending[0].item.line}: its requests left the engine without an output")
            final.update((out.request_id, out) for out in loop.run_once() if out.finished)
            if rates is not None:
                bar.set_postfix_str(rates.text(), refresh=False)
    except BaseException:
        for line in pending:       # the engine as it was before the batch
            line.abort(final)
        raise
    finally:
        bar.close()


@dataclass
class _InFlight:
    """A line read and not yet written: its item and, unless it failed, its samples (one prompt's SampleBatch)."""
    item: BatchItem
    samples: SampleBatch | None = None

    @classmethod
    def start(cls, item: BatchItem, engine) -> _InFlight:
        """The line with its first sample added to the engine (an error naming its line if the engine refuses it)."""
        from picovllm.entrypoints.parallel_sampling import SampleBatch

        if item.error is not None:
            return cls(item)
        samples = SampleBatch(engine)
        try:
            samples.add(item.prompt, item.params)
        except ValueError as e:
            item.error = f"line {item.line}: {e}"
            return cls(item)
        return cls(item, samples)

    def add_ready_siblings(self) -> None:
        if self.samples is not None:
            self.samples.add_ready_siblings()

    def done(self, final: dict[str, RequestOutput]) -> bool:
        return self.samples is None or not self.samples.waiting and all(i in final for i in self.samples.prompts[0].ids)

    def output(self, final: dict[str, RequestOutput]) -> RequestOutput | None:
        """The line's output, its samples' final outputs taken out of final; None for a failed line."""
        if self.samples is None:
            return None
        out = self.samples.outputs(final)[0]
        for rid in self.samples.prompts[0].ids:
            del final[rid]
        return out

    def abort(self, final: dict[str, RequestOutput]) -> None:
        if self.samples is not None:
            self.samples.abort(final)


def result_record(item: BatchItem, out: RequestOutput | None) -> dict:
    rec: dict = {"index": item.index}
    if item.id is not None:
        rec["id"] = item.id
    if out is None:
        rec["error"] = item.error
        return rec
    if out.error is not None:      # the engine ended the request with an error: said, and counted as failed
        rec["error"] = out.error
    rec["num_prompt_tokens"] = len(out.prompt_token_ids)
    samples = [_sample_record(c) for c in out.outputs]
    if len(samples) == 1:
        rec.update(samples[0])
    else:
        rec["outputs"] = samples
    if out.prompt_logprobs is not None:
        rec["prompt_logprobs"] = [None if d is None else _logprob_record(d) for d in out.prompt_logprobs]
    return rec


def _sample_record(comp) -> dict:
    rec = dict(text=comp.text, token_ids=comp.token_ids, finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)
    if comp.logprobs is not None:
        rec["logprobs"] = [_logprob_record(d) for d in comp.logprobs]
    return rec


def _logprob_record(d: dict) -> dict:
    return {str(t): json_logprob(lp.logprob) for t, lp in d.items()}
