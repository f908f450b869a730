"""picovllm/disagg/http_stream.py: the proxy's and the router's streamed POST, against servers that answer fixed
bytes (hand-written HTTP/1.1: chunked, with a Content-Length, to the end of the connection, broken, not HTTP), and
against uvicorn streaming NDJSON the way a /pd route does. The P/D serving tests run it end to end."""
import asyncio
import json
import socket

import pytest

from picovllm.disagg.http_stream import StreamError, post_stream
from serving_fixtures import free_port


def run_against(answer: bytes, *, path: str = "/pd/prefill", body: bytes = b'{"a": 1}',
                headers: dict | None = None, close: bool = True):
    """Serve `answer` to one connection, POST to it; (the lines read or the exception, what the server got)."""
    got = {}

    async def main():
        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")][0]
                         .split(b":")[1])
            got["head"], got["body"] = head.decode(), await reader.readexactly(length)
            writer.write(answer)
            await writer.drain()
            if close:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            resp = await post_stream(f"http://127.0.0.1:{port}", path, body, headers or {"x-sig": "s"}, 5.0)
            got["status"] = resp.status_code
            try:
                return [line async for line in resp.aiter_lines()]
            finally:
                await resp.aclose()
        except Exception as e:          # noqa: BLE001 - returned for the test to check
            return e
        finally:
            server.close()

    return asyncio.run(main()), got


def test_chunked_lines_split_anywhere_are_rejoined():
    # three lines; chunk boundaries inside a line, between the \r and the \n of none (NDJSON ends lines with \n)
    data = b'{"output": 1}\n{"delta": 2}\n{"delta": 3}\n'
    chunks = [data[:5], data[5:20], data[20:21], data[21:]]
    answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: application/x-ndjson\r\n\r\n" + \
        b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    lines, got = run_against(answer, headers={"content-type": "application/json", "x-pd-signature": "abc"})
    assert lines == ['{"output": 1}', '{"delta": 2}', '{"delta": 3}']
    assert got["status"] == 200 and got["body"] == b'{"a": 1}'
    head = got["head"].split("\r\n")
    assert head[0] == "POST /pd/prefill HTTP/1.1" and "x-pd-signature: abc" in head and "content-length: 8" in head


def test_content_length_and_read_to_the_end():
    lines, got = run_against(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 13\r\n\r\n{\"e\": \"x\"}\nzz")
    assert got["status"] == 400 and lines == ['{"e": "x"}', "zz"]
    lines, _ = run_against(b"HTTP/1.1 200 OK\r\n\r\none\r\ntwo")        # neither: the body ends with the connection
    assert lines == ["one", "two"]


def test_a_broken_or_foreign_answer_is_a_stream_error():
    cut, _ = run_against(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab")
    assert isinstance(cut, StreamError) and "broke" in str(cut)
    short, _ = run_against(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
    assert isinstance(short, StreamError) and "7 bytes short" in str(short)
    foreign, _ = run_against(b"SSH-2.0-OpenSSH\r\n\r\n")
    assert isinstance(foreign, StreamError) and "not an HTTP/1.1 answer" in str(foreign)
    bad_size, _ = run_against(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n")
    assert isinstance(bad_size, StreamError)


def test_unreachable_and_bad_urls():
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StreamError, match="cannot connect"):
        asyncio.run(post_stream(f"http://127.0.0.1:{port}", "/pd/decode", b"{}", {}, 2.0))
    with pytest.raises(ValueError, match="not an http"):
        asyncio.run(post_stream("ftp://x", "/pd/decode", b"{}", {}, 2.0))


def test_a_server_that_takes_the_request_and_never_answers():
    """A frozen server (its socket accepts; nothing answers): with answer_timeout_s the wait for the status line
    ends in a StreamError naming the wait (the router's and the proxy's lease), where it had waited as long as the
    freeze lasted; without one it waits."""
    import time

    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)     # takes the bytes, says nothing
        port = server.sockets[0].getsockname()[1]
        try:
            t0 = time.monotonic()
            with pytest.raises(StreamError, match="no answer .* within 0.5 s"):
                await post_stream(f"http://127.0.0.1:{port}", "/pd/decode", b"{}", {}, 2.0, answer_timeout_s=0.5)
            assert time.monotonic() - t0 < 2.0
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(post_stream(f"http://127.0.0.1:{port}", "/pd/decode", b"{}", {}, 2.0), 1.0)
        finally:
            server.close()
    asyncio.run(main())


def test_uvicorn_streaming_response_and_closing_early():
    """A FastAPI StreamingResponse (what the /pd routes answer): every line arrives as sent, and closing the
    response mid-stream is seen by the server as its client leaving."""
    import threading
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app, left = FastAPI(), threading.Event()

    @app.post("/pd/lines")
    async def lines(raw: Request):
        n = (await raw.json())["n"]

        async def gen():
            try:
                for i in range(n):
                    yield json.dumps({"i": i, "pad": "x" * (i % 7)}) + "\n"
                    await asyncio.sleep(0.001 if n < 1000 else 0.05)
            finally:
                left.set()
        return StreamingResponse(gen(), media_type="application/x-ndjson")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        async def main():
            for _ in range(100):
                try:
                    (await asyncio.open_connection("127.0.0.1", port))[1].close()
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            resp = await post_stream(f"http://127.0.0.1:{port}", "/pd/lines", b'{"n": 50}',
                                     {"content-type": "application/json"})
            got = [json.loads(line) async for line in resp.aiter_lines()]
            await resp.aclose()
            assert got == [{"i": i, "pad": "x" * (i % 7)} for i in range(50)]
            left.clear()
            resp = await post_stream(f"http://127.0.0.1:{port}", "/pd/lines", b'{"n": 100000}',
                                     {"content-type": "application/json"})
            async for _ in resp.aiter_lines():
                break
            await resp.aclose()                     # the server's generator ends: its client is gone
            for _ in range(100):
                if left.is_set():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("the server did not see its client leave")
        asyncio.run(main())
    finally:
        server.should_exit = True
        thread.join(10)
