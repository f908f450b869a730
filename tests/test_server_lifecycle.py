"""Server lifecycle: the API key is enforced; SIGTERM lets short requests finish, aborts long ones after the
grace period (their streams still end cleanly), refuses new connections, and exits 0 with nothing left."""
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from serving_fixtures import ServerProcess, build_tiny_chat_model, chat_model  # noqa: F401 - a fixture

KEY = "sk-test-123"
GRACE = 2.5   # --shutdown-timeout


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    # 32768 positions so one request can run far longer than the shutdown grace period, even on a fast CPU
    return build_tiny_chat_model(str(tmp_path_factory.mktemp("tinylong") / "model"), max_position_embeddings=32768)


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def assert_exited(pids, timeout_s: float = 10.0) -> None:
    """Every one of pids ends within timeout_s of the server's exit (multiprocessing's resource tracker, a child of
    a server with an engine process, ends on its own once the server's end of its pipe has closed)."""
    deadline = time.time() + timeout_s
    while [p for p in pids if os.path.exists(f"/proc/{p}")] and time.time() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if os.path.exists(f"/proc/{p}")]
    assert not left, f"children {left} outlived the server"


def stream_tokens(url: str, body: dict, result: dict, first: threading.Event) -> None:
    """Read an SSE completion stream to its end, recording text, finish_reason and whether [DONE] came."""
    text, finish, done = "", None, False
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    ch = json.loads(line[6:])
                    text += ch["choices"][0]["text"]
                    finish = ch["choices"][0]["finish_reason"] or finish
                    first.set()
    except Exception as e:  # noqa: BLE001 - recorded for the assertion
        result["error"] = repr(e)
    result.update(text=text, finish=finish, done=done)
    first.set()


def test_api_key_and_graceful_sigterm(long_context_model, tmp_path):
    srv = ServerProcess(long_context_model, str(tmp_path / "server.log"), "--api-key", KEY, "--shutdown-timeout",
                        str(GRACE), "--num-kv-blocks", "4096", "--max-model-len", "32768",
                        "--allowed-origins", '["http://app.example"]')
    try:
        model = long_context_model
        # CORS: a browser's preflight carries no API key and is answered for the allowed origin only
        ask = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
        pre = httpx.options(srv.url + "/v1/completions", headers={"origin": "http://app.example", **ask})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://app.example"
        pre = httpx.options(srv.url + "/v1/completions", headers={"origin": "http://evil.example", **ask})
        assert pre.status_code == 400 and "access-control-allow-origin" not in pre.headers
        r = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1},
                       headers={"origin": "http://app.example", "authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        wrong = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=model, prompt="hi", max_tokens=2)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"})       # no key at all
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200      # open to probes
        assert httpx.get(srv.url + "/metrics").status_code == 200     # and to scrapers
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
        assert ok.completions.create(model=model, prompt="hi", max_tokens=3,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 3

        kids = children_of(srv.proc.pid)
        runs = {"short": {"max_tokens": 20}, "long": {"max_tokens": 30000}}
        results, threads = {}, []
        for name, extra in runs.items():
            results[name], first = {}, threading.Event()
            body = {"model": model, "prompt": "Tell me a story", "temperature": 0, "stream": True,
                    "ignore_eos": True, **extra}
            t = threading.Thread(target=stream_tokens, args=(srv.url, body, results[name], first))
            t.start()
            assert first.wait(30)
            threads.append(t)
        t0 = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):          # no longer accepting
            httpx.get(srv.url + "/health", timeout=5)
        for t in threads:
            t.join(30)
        assert srv.proc.wait(30) == 0, srv.log()
        elapsed = time.time() - t0
    finally:
        code = srv.stop()
    assert code == 0
    short, long = results["short"], results["long"]
    assert "error" not in short and short["finish"] == "length" and short["done"], short
    assert "error" not in long and long["finish"] == "abort" and long["done"], long   # cut off, but cleanly
    assert GRACE <= elapsed < GRACE + 5, elapsed
    assert "aborting the requests still running" in srv.log()
    assert_exited(kids)
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=5)



def test_sigterm_aborts_waiting_samples_and_beam_searches(long_context_model, tmp_path):
    """One slot (--max-num-seqs 1), held by a long stream; an n=2 request and a beam search wait behind it. At the
    grace period's end every waiting sample is aborted, not started: the n=2 request's second sample had started
    after the abort and run to its length, and the beam search had failed with a 500 (or kept adding steps)."""
    srv = ServerProcess(long_context_model, str(tmp_path / "server.log"), "--api-key", KEY, "--shutdown-timeout",
                        str(GRACE), "--num-kv-blocks", "4096", "--max-model-len", "32768", "--max-num-seqs", "1")
    auth = {"Authorization": f"Bearer {KEY}"}
    results, threads = {}, []
    try:
        first = threading.Event()
        body = {"prompt": "Tell me a story", "stream": True, "ignore_eos": True, "max_tokens": 30000}
        t = threading.Thread(target=stream_tokens, args=(srv.url, body, results.setdefault("long", {}), first))
        t.start()
        assert first.wait(30)
        threads.append(t)

        def post(name, extra):
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi there", "max_tokens": 4000,
                                                              "ignore_eos": True, "n": 2, **extra},
                           headers=auth, timeout=60)
            results[name] = (r.status_code, r.json())

        for name, extra in (("n2", {}), ("beam", {"use_beam_search": True})):
            threads.append(threading.Thread(target=post, args=(name, extra)))
            threads[-1].start()
        time.sleep(1.0)                    # both waiting behind the long one
        t0 = time.time()
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert srv.proc.wait(30) == 0, srv.log()
        elapsed = time.time() - t0
    finally:
        srv.stop()
    status, n2 = results["n2"]
    assert status == 200 and [(c["finish_reason"], c["text"]) for c in n2["choices"]] == [("abort", "")] * 2, n2
    assert n2["usage"]["completion_tokens"] == 0
    status, beam = results["beam"]
    assert status == 503 and "shutting down" in beam["error"]["message"], beam
    assert results["long"]["finish"] == "abort" and results["long"]["done"]
    assert elapsed < GRACE + 3, elapsed


@pytest.mark.parametrize("mode", ["--engine-process", "--no-engine-process"])
def test_a_second_signal_aborts_at_once_and_exits_quietly(long_context_model, tmp_path, mode):
    """Ctrl-C twice: the second signal does not wait out the grace period: what runs is aborted at once, its stream
    still ends cleanly (finish_reason "abort", [DONE]), and the server exits 0 without a traceback. It had cancelled
    the server's tasks: tracebacks, the stream cut without its end, exit 0."""
    srv = ServerProcess(long_context_model, str(tmp_path / "server.log"), mode, "--shutdown-timeout", "60",
                        "--num-kv-blocks", "4096", "--max-model-len", "32768")
    result, first = {}, threading.Event()
    body = {"prompt": "Tell me a story", "stream": True, "ignore_eos": True, "max_tokens": 30000}
    try:
        t = threading.Thread(target=stream_tokens, args=(srv.url, body, result, first))
        t.start()
        assert first.wait(30)
        kids = children_of(srv.proc.pid)
        t0 = time.time()
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        srv.proc.send_signal(signal.SIGINT)
        t.join(30)
        assert srv.proc.wait(30) == 0, srv.log()
        elapsed = time.time() - t0
    finally:
        srv.stop()
    assert result["finish"] == "abort" and result["done"] and "error" not in result, result
    assert elapsed < 15, elapsed
    assert "Traceback" not in srv.log(), srv.log()
    assert_exited(kids)


# A sitecustomize that makes every Engine of its processes wait BUILD_DELAY_S before it builds, after writing a file
# named by the building process's pid: an engine process stopped mid-build, found without timing guesses.
SLOW_BUILD = '''
import os, time
if os.environ.get("PICOVLLM_TEST_BUILD_MARKS"):
    import picovllm.engine.llm_engine as _m
    _init = _m.Engine.__init__
    def _slow(self, *a, **k):
        open(os.path.join(os.environ["PICOVLLM_TEST_BUILD_MARKS"], str(os.getpid())), "w").close()
        time.sleep(float(os.environ["PICOVLLM_TEST_BUILD_DELAY"]))
        _init(self, *a, **k)
    _m.Engine.__init__ = _slow
'''
BUILD_DELAY_S = 120


def _building_server(model: str, tmp_path, *extra: str) -> tuple[ServerProcess, int]:
    """A server whose engine process is building its engine (for BUILD_DELAY_S); and that process's pid."""
    site, marks = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_BUILD)
    srv = ServerProcess(model, str(tmp_path / "server.log"), "--engine-process", *extra, startup_timeout=None,
                        env={"PYTHONPATH": str(site), "PICOVLLM_TEST_BUILD_MARKS": str(marks),
                             "PICOVLLM_TEST_BUILD_DELAY": str(BUILD_DELAY_S)})
    deadline = time.time() + 60
    while not os.listdir(marks):
        assert srv.proc.poll() is None and time.time() < deadline, srv.log()
        time.sleep(0.1)
    engine = int(os.listdir(marks)[0])
    assert engine != srv.proc.pid and engine in children_of(srv.proc.pid)
    return srv, engine


@pytest.mark.parametrize("api_servers", [1, 2])
def test_sigterm_while_the_engine_is_built_stops_its_process(chat_model, tmp_path, api_servers):
    """SIGTERM before the engine is ready: the server exits at once and its engine process with it (it had built on
    for as long as the build took, after the server was gone; with API server processes the server waited 60 s)."""
    extra = ("--api-server-count", str(api_servers)) if api_servers > 1 else ()
    srv, engine = _building_server(chat_model, tmp_path, *extra)
    kids = children_of(srv.proc.pid)
    t0 = time.time()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(20)
    finally:
        srv.stop(signal.SIGKILL)
    assert time.time() - t0 < 20, srv.log()
    assert_exited([engine, *kids], timeout_s=10)
    assert "stopped while the engine was being built" in srv.log()


def test_an_engine_process_whose_server_is_killed_mid_build_ends(chat_model, tmp_path):
    """A server killed outright (SIGKILL: no handler runs) while its engine is built: the engine process sees its
    parent gone and ends, where it had built on and then served no one."""
    srv, engine = _building_server(chat_model, tmp_path)
    srv.stop(signal.SIGKILL)
    assert_exited([engine], timeout_s=10)


def test_a_port_in_use_is_refused_before_the_model_loads(chat_model, tmp_path):
    """The listening socket is bound first: a port in use ends the server at once, naming the flags, where it had
    been found only after the engine was built (minutes for a large model), after a log line saying it served."""
    import socket
    site, marks = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_BUILD)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]     # (the last --port given is the one: ServerProcess gives its own first)
        srv = ServerProcess(chat_model, str(tmp_path / "server.log"), "--engine-process", "--port", str(port),
                            startup_timeout=None, env={"PYTHONPATH": str(site), "PICOVLLM_TEST_BUILD_MARKS":
                                                       str(marks), "PICOVLLM_TEST_BUILD_DELAY": str(BUILD_DELAY_S)})
        try:
            assert srv.proc.wait(60) != 0
        finally:
            srv.stop(signal.SIGKILL)
    finally:
        taken.close()
    assert f"--port {port}: cannot listen there" in srv.log(), srv.log()
    assert not os.listdir(marks), "the engine was being built"


def test_the_fixture_relaunches_a_server_whose_port_was_taken(chat_model, tmp_path, monkeypatch):
    """ServerProcess draws a port, then the server binds it: another process can take it between the two (CI lost a
    run so). The server exits naming the port; the fixture starts it again on another and it serves there."""
    import socket

    import serving_fixtures
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        draws = iter([taken.getsockname()[1], serving_fixtures.free_port()])
        monkeypatch.setattr(serving_fixtures, "free_port", lambda: next(draws))
        srv = ServerProcess(chat_model, str(tmp_path / "server.log"), "--num-kv-blocks", "64")
        try:
            assert srv.port != taken.getsockname()[1]
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        finally:
            assert srv.stop() == 0
    finally:
        taken.close()
