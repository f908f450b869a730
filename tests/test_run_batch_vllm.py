"""`picovllm run-batch` against vLLM's `vllm run-batch` and OpenAI's batch file format: what a vLLM user's file and
command line get (oracles: LLM.generate on the same prompt, hand-written expectations for the format)."""
import asyncio
import json
import re
import socket

import pytest

from picovllm import LLM, SamplingParams
from picovllm.entrypoints.cli import main as cli_main
from serving_fixtures import file_server, free_port, http_server

GREEDY = dict(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    from serving_fixtures import build_tiny_chat_model
    return build_tiny_chat_model(str(tmp_path_factory.mktemp("chat") / "model"))


@pytest.fixture(scope="module")
def reference(chat_model):
    """A prompt's greedy text, as LLM.generate gives it."""
    llm = LLM(chat_model, num_kv_blocks=64)
    return lambda prompt: llm.generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text


def _line(custom_id: str, prompt: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, **GREEDY, **body}}, ensure_ascii=False)


def _run(argv: list[str]) -> int:
    return cli_main(["run-batch", *argv, "--num-kv-blocks", "64"])


def _records(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_bytes_that_are_not_utf8_cost_only_their_line(chat_model, reference, tmp_path, capsys):
    """A line with bytes that are not UTF-8 is an error line naming the byte; the lines around it run (a file
    with such a line had lost every line: one decode error for the whole file). A byte-order mark before the first
    line, as Windows editors write it, is no part of the line. `picovllm batch` reads its file the same way."""
    inp, out, bad = tmp_path / "in.jsonl", tmp_path / "out.jsonl", _line("bad", "caf\xe9")
    at = bad.index("\xe9") + 1
    inp.write_bytes(b"\xef\xbb\xbf" + _line("a", "hi").encode() + b"\n" + bad.encode("latin-1") + b"\n" +
                    _line("b", "yo").encode() + b"\n")
    assert _run(["-i", str(inp), "-o", str(out), "--model", chat_model]) == 1
    recs = _records(out)
    assert [r["custom_id"] for r in recs] == ["a", None, "b"]
    assert recs[1]["response"] is None
    assert recs[1]["error"] == {"code": "invalid_request",
                                "message": f"line 2: not UTF-8 text (byte 0xe9 at character {at})"}
    assert [recs[i]["response"]["body"]["choices"][0]["text"] for i in (0, 2)] == [reference("hi"), reference("yo")]

    inp.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "hi", **GREEDY}).encode() + b"\n" +
                    b'{"prompt": "caf\xe9"}\n' + json.dumps({"prompt": "yo", **GREEDY}).encode() + b"\n")
    assert cli_main(["batch", "-i", str(inp), "-o", str(out), "--model", chat_model, "--num-kv-blocks", "64",
                     "--no-progress"]) == 1
    recs = _records(out)
    assert recs[1]["error"] == "line 2: not UTF-8 text (byte 0xe9 at character 16)"
    assert [recs[i]["text"] for i in (0, 2)] == [reference("hi"), reference("yo")]


def test_a_custom_id_used_twice_is_refused_on_its_later_lines(chat_model, reference, tmp_path, capsys):
    """OpenAI's custom_id "must be unique for each request in a batch": it is what maps an output line to its request.
    A later line with an earlier one's custom_id (even a line that was refused) gets an error naming the field and
    the first line; the first runs."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    get = json.dumps({"custom_id": "g", "method": "GET", "url": "/v1/completions", "body": {}})
    inp.write_text("\n".join([_line("a", "hi"), _line("b", "yo"), _line("a", "again"), get, _line("g", "hi")]))
    assert _run(["-i", str(inp), "-o", str(out), "--model", chat_model]) == 1
    recs = _records(out)
    assert [r["custom_id"] for r in recs] == ["a", "b", "a", "g", "g"]
    assert [r["response"]["body"]["choices"][0]["text"] for r in recs[:2]] == [reference("hi"), reference("yo")]
    for rec, first, line in ((recs[2], 1, 3), (recs[4], 4, 5)):
        assert rec["response"] is None and rec["error"]["code"] == "duplicate_custom_id", rec
        assert rec["error"]["message"].startswith(f"line {line}: custom_id {rec['custom_id']!r} is line {first}'s")


def test_the_file_is_read_as_room_frees_up_not_all_at_once(tmp_path):
    """Memory does not grow with the file: while the first request is held, run_requests reads no more than its
    window of lines (WINDOW_PER_SLOT per request the engine may hold) and writes none; then every line is written,
    in order. (The whole file had been read, and a task made for every line, before the first answer.)"""
    from fastapi import FastAPI

    from picovllm.entrypoints.openai.run_batch import WINDOW_PER_SLOT, run_requests

    async def scenario():
        app, release, read, written = FastAPI(), asyncio.Event(), [], []

        @app.post("/v1/completions")
        async def complete(body: dict) -> dict:
            if body["prompt"] == "0":
                await release.wait()
            return {"prompt": body["prompt"]}

        def lines():
            for i in range(600):
                read.append(i)
                yield i + 1, _line(f"r{i}", str(i))

        run = asyncio.ensure_future(run_requests(app, lines(), 2, written.append))
        for _ in range(100):
            await asyncio.sleep(0.02)
        held = len(read), len(written)
        release.set()
        return held, await run, written

    (read_while_held, written_while_held), counts, written = asyncio.run(scenario())
    assert written_while_held == 0 and read_while_held <= WINDOW_PER_SLOT * 2 + 1, read_while_held
    assert [r["custom_id"] for r in written] == [f"r{i}" for i in range(600)]
    assert [r["response"]["body"]["prompt"] for r in written] == [str(i) for i in range(600)]
    assert (counts.lines, counts.failed) == (600, 0)


def test_output_url_goes_through_a_file_in_output_tmp_dir(chat_model, tmp_path, capsys):
    """vLLM's --output-tmp-dir: an http(s) output is written to a file in that folder, then PUT (the whole output is
    never held in memory); the file is gone once the PUT is taken, and kept, its path in the error, when it is
    not. An http(s) input is fetched into that folder too, and removed. The input file given as the output file is
    refused before any work (lines are read as the output is written)."""
    spool, inp, local = tmp_path / "spool", tmp_path / "in.jsonl", tmp_path / "local.jsonl"
    spool.mkdir()
    inp.write_text("\n".join([_line("a", "hi"), _line("b", "yo")]) + "\n")
    seen = {}

    def get(path: str) -> tuple[int, bytes]:
        seen["while GET"] = sorted(p.name for p in spool.iterdir())
        return 200, inp.read_bytes()

    def put(path: str, body: bytes) -> int:
        seen["while PUT"] = sorted(p.name for p in spool.iterdir())
        seen[path] = body.decode()
        return 200 if path == "/out.jsonl" else 403

    with file_server(get, put) as url:
        assert _run(["-i", str(inp), "-o", str(local), "--model", chat_model]) == 0
        assert _run(["-i", f"{url}/in.jsonl", "-o", f"{url}/out.jsonl", "--output-tmp-dir", str(spool),
                     "--model", chat_model]) == 0
        assert [json.loads(x)["response"]["body"]["choices"] for x in seen["/out.jsonl"].splitlines()] == \
            [r["response"]["body"]["choices"] for r in _records(local)]
        names = [re.fullmatch(r"(picovllm_batch_(?:input|output))_.*\.jsonl", n)[1] for n in seen["while PUT"]]
        assert names == ["picovllm_batch_input", "picovllm_batch_output"] and len(seen["while GET"]) == 1, seen
        assert list(spool.iterdir()) == []
        capsys.readouterr()
        assert _run(["-i", str(inp), "-o", f"{url}/locked.jsonl", "--output-tmp-dir", str(spool),
                     "--model", chat_model]) == 2
        err = capsys.readouterr().err
        kept = re.search(r"PUT failed: the server answered 403 Forbidden; the output is kept in (\S+)", err)
        assert kept and "Traceback" not in err, err
        assert [r["custom_id"] for r in map(json.loads, open(kept.group(1)))] == ["a", "b"]
    for argv, says in ((["-i", str(inp), "-o", str(local), "--output-tmp-dir", str(tmp_path / "nope")],
                        "--output-tmp-dir '.*nope': no such folder"),
                       (["-i", str(inp), "-o", str(inp)], "--output-file '.*in.jsonl' is --input-file")):
        rc = _run([*argv, "--model", str(tmp_path / "no-model")])
        err = capsys.readouterr().err
        assert rc == 2 and re.search(says, err) and "Traceback" not in err, err


def test_output_put_follows_a_redirect_with_the_whole_file(tmp_path):
    """An output URL that redirects its PUT (307, 308, and 301, which httpx follows with a PUT too) gets the whole file
    at the place it names, as a PUT of the whole text did before the output was streamed from its file (the body was
    then an iterator, read once: the second request declared the file's length and sent nothing)."""
    import http.server

    from picovllm.entrypoints.batch_io import upload
    text = "".join(_line(f"r{i}", "x" * 100) + "\n" for i in range(2000))     # several of upload's chunks
    out = tmp_path / "out.jsonl"
    out.write_text(text)
    got = {}

    class Redirecting(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            body = self.rfile.read(int(self.headers["content-length"]))
            if self.path.startswith("/moved"):
                self.send_response(int(self.path.rsplit("/", 1)[1]))
                self.send_header("Location", "/final")
            else:
                got.setdefault(self.path, []).append(body.decode())
                self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    with http_server(Redirecting) as url:
        for status in (301, 307, 308):
            upload(f"{url}/moved/{status}", str(out), "--output-file")
    assert got == {"/final": [text] * 3}


def test_enable_metrics_serves_prometheus_metrics_while_the_batch_runs(chat_model, tmp_path, capsys, monkeypatch):
    """vLLM's --enable-metrics --url --port: serve's /metrics (vLLM's series) on that port while the batch runs, and
    nothing else there; a port in use is refused before the model loads."""
    import httpx

    from picovllm.entrypoints.openai.serving_completion import CompletionHandler
    real, port, scraped = CompletionHandler.__call__, free_port(), []

    async def scraping(self, req, *rest):
        if req.prompt == "look":
            async with httpx.AsyncClient() as client:
                scraped.append(await client.get(f"http://127.0.0.1:{port}/metrics"))
                scraped.append(await client.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}))
        return await real(self, req, *rest)

    monkeypatch.setattr(CompletionHandler, "__call__", scraping)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([_line("a", "hi"), _line("b", "look")]) + "\n")
    assert _run(["-i", str(inp), "-o", str(out), "--model", chat_model, "--enable-metrics", "--url", "127.0.0.1",
                 "--port", str(port), "--max-concurrency", "1"]) == 0     # one at a time: a is done when b runs
    metrics, other = scraped
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
    assert re.search(r"vllm:request_success_total\{.*\} 1\.0", metrics.text), metrics.text     # line a's, done
    assert other.status_code == 404
    assert f"metrics at http://127.0.0.1:{port}/metrics" in capsys.readouterr().err
    with socket.create_server(("127.0.0.1", 0)) as busy:
        rc = _run(["-i", str(inp), "-o", str(out), "--model", str(tmp_path / "no-model"), "--enable-metrics",
                   "--port", str(busy.getsockname()[1])])
    err = capsys.readouterr().err
    assert rc == 2 and "--enable-metrics: cannot listen on --url '127.0.0.1' --port" in err, err


def test_vllm_run_batch_flags_and_progress(chat_model, reference, tmp_path, capsys):
    """vLLM's run-batch flags beyond the engine's: --served-model-name with several names (a body may name any,
    replies name the first), --enable-log-requests and --max-log-len, and those that mean what picovllm does
    anyway (--response-role assistant, --enable-prompt-tokens-details, --enable-force-include-usage,
    --disable-log-requests); another --response-role is refused naming the flag. A progress line on stderr, as
    vLLM's "Running batch" bar (--no-progress: none); an empty file an empty output."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([_line("a", "hi", model="second"), _line("b", "yo", model="first")]) + "\n")
    assert _run(["-i", str(inp), "-o", str(out), "--model", chat_model, "--served-model-name", "first", "second",
                 "--enable-log-requests", "--max-log-len", "4", "--response-role", "assistant",
                 "--enable-prompt-tokens-details", "--enable-force-include-usage", "--disable-log-requests"]) == 0
    recs = _records(out)
    assert [r["response"]["body"]["model"] for r in recs] == ["first", "first"]
    assert [r["response"]["body"]["choices"][0]["text"] for r in recs] == [reference("hi"), reference("yo")]
    assert "prompt_tokens_details" in recs[0]["response"]["body"]["usage"]
    assert re.search(r"^Running batch: 2/2 requests done", capsys.readouterr().err, re.M)

    with pytest.raises(SystemExit) as refused:
        _run(["-i", str(inp), "-o", str(out), "--response-role", "user"])
    assert refused.value.code == 2 and "--response-role: 'user' is not supported" in capsys.readouterr().err

    inp.write_text("")
    assert _run(["-i", str(inp), "-o", str(out), "--model", chat_model, "--no-progress"]) == 0
    assert out.read_text() == "" and "Running batch" not in capsys.readouterr().err


def test_vllm_urls_picovllm_does_not_serve_are_refused_by_name():
    """vLLM's run-batch also takes /score, /v1/score, /rerank, /v1/rerank and /v2/rerank (pooling models), which
    picovllm does not serve: the line's error says so, naming the url; the other urls are refused as before."""
    from picovllm.entrypoints.openai.run_batch import parse_request
    for url in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        head, error = parse_request(json.dumps({"custom_id": "s", "method": "POST", "url": url, "body": {}}), 7)
        assert head == {"custom_id": "s"} and error["code"] == "invalid_request"
        assert error["message"].startswith(f"line 7: url {url!r}: picovllm serves no score or rerank endpoint"), error
    _, error = parse_request(json.dumps({"custom_id": "m", "method": "POST", "url": "/v1/models", "body": {}}), 8)
    assert error["message"].startswith("line 8: url must be one of /v1/chat/completions, /v1/completions")
