"""A streamed POST on a connection of its own: how the proxy and the router call the /pd routes.

Each request through a proxy or a router holds two long streams open (P's, then D's), so at a few hundred requests
in flight a pooled HTTP client spends most of its time in the pool: httpx's scans every open connection for each new
request (BENCHMARKS.md, fourteenth session: ~40% of a proxy's CPU at a burst of 300 requests). The /pd routes'
servers are our own (uvicorn), and what the callers need is small: send one POST, read the status and headers, then
the body line by line (chunked, or with a Content-Length). So each stream gets a connection of its own here, closed
when the stream is done, and no pool.

    resp = await post_stream("http://host:port", "/pd/prefill", body, headers, connect_timeout_s=10)
    resp.status_code; async for line in resp.aiter_lines(): ...; await resp.aread(); await resp.aclose()

Errors: StreamError (an OSError) for a connection that fails, breaks or answers what is not HTTP/1.1.
"""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

MAX_HEADER_BYTES = 64 * 1024


class StreamError(OSError):
    """The connection could not be made, broke, or did not speak HTTP/1.1."""


class StreamedResponse:
    """The response of post_stream: status_code and headers read; the body is read by aiter_lines() or aread()."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status_code: int,
                 headers: dict[str, str]) -> None:
        self._reader, self._writer = reader, writer
        self.status_code, self.headers = status_code, headers
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._left = int(length) if length is not None and not self._chunked else None   # None: to the end
        self._done = False

    async def _pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        r = self._reader
        try:
            if self._chunked:
                while True:
                    size = int((await r.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                    if size == 0:
                        while (await r.readuntil(b"\r\n")) != b"\r\n":     # trailers, then the blank line
                            pass
                        break
                    data = await r.readexactly(size + 2)
                    yield data[:-2]
            elif self._left is not None:
                while self._left > 0:
                    data = await r.read(min(self._left, 1 << 16))
                    if not data:
                        raise StreamError(f"the body ended {self._left} bytes short")
                    self._left -= len(data)
                    yield data
            else:
                while data := await r.read(1 << 16):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ConnectionError) as e:
            raise StreamError(f"the response broke: {type(e).__name__}: {e}") from None
        finally:
            self._done = True

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines (UTF-8, without their line ends), as they arrive."""
        rest = b""
        async for piece in self._pieces():
            lines = (rest + piece).split(b"\n")
            rest = lines.pop()
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if rest:
            yield rest.rstrip(b"\r").decode()

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self._pieces()])

    def fail(self, why: str) -> None:
        """End the body in StreamError(why) where it is being read, and close the connection (the server seen
        dead: a read would wait forever)."""
        if not self._done:
            self._reader.set_exception(StreamError(why))
        self._done = True
        if not self._writer.is_closing():
            self._writer.close()

    async def aclose(self) -> None:
        """Close the connection (the server sees its client leave: a /pd route aborts the request)."""
        self._done = True
        if not self._writer.is_closing():
            self._writer.close()
        try:
            await self._writer.wait_closed()
        except (OSError, asyncio.CancelledError):
            pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """A response's status code and headers (lower-case names)."""
    status_line = await reader.readuntil(b"\r\n")
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise StreamError(f"not an HTTP/1.1 answer: {status_line[:80]!r}")
    got: dict[str, str] = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        got[name.strip().lower()] = value.strip()
    return int(parts[1]), got


async def post_stream(base_url: str, path: str, body: bytes, headers: dict[str, str],
                      connect_timeout_s: float = 10.0, answer_timeout_s: float | None = None) -> StreamedResponse:
    """POST body to base_url + path on a new connection; returns once the status and headers are in.
    StreamError if the server cannot be reached in connect_timeout_s, does not answer HTTP/1.1, or sends no status
    and headers within answer_timeout_s (None: no limit)."""
    url = urlsplit(base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"{base_url!r} is not an http:// or https:// URL")
    port = url.port or (443 if url.scheme == "https" else 80)
    context = ssl.create_default_context() if url.scheme == "https" else None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(url.hostname, port, ssl=context, limit=MAX_HEADER_BYTES), connect_timeout_s)
    except (OSError, asyncio.TimeoutError) as e:
        raise StreamError(f"cannot connect to {url.hostname}:{port}: {type(e).__name__}: {e}") from None
    try:
        host = url.netloc.rsplit("@", 1)[-1]
        head = [f"POST {url.path.rstrip('/')}{path} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}",
                "connection: close", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await asyncio.wait_for(writer.drain(), connect_timeout_s)
        try:
            status, got = await asyncio.wait_for(_read_head(reader), answer_timeout_s)
        except asyncio.TimeoutError:        # a frozen server: the connection is made, no answer comes
            raise StreamError(f"no answer from {url.hostname}:{port} within {answer_timeout_s:g} s") from None
        return StreamedResponse(reader, writer, status, got)
    except BaseException as e:
        writer.close()
        if isinstance(e, (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)):
            raise StreamError(f"{url.hostname}:{port} did not answer: {type(e).__name__}: {e}") from None
        raise
