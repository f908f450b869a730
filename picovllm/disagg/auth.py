"""The P/D shared secret: every control message and every KV byte between P and D processes is authenticated.

One scheme, one secret (`--pd-secret-file FILE`, else $PICOVLLM_PD_SECRET) for every process that
listens: a fleet's instances and its router, a linked pair's P and D servers and `picovllm proxy`,
the driver and engine workers of `picovllm.disagg.launch` (DisaggLLM on one host makes a fresh
secret per run and hands it to the workers it spawns). Two uses:

- A socket (a fleet's KV socket, a linked pair's P<->D link, a worker's channel to its driver)
  starts with a mutual HMAC challenge-response (challenge_peer / answer_challenge): each side
  proves it knows the secret without sending it, over the other's fresh nonce. A peer that fails
  is refused before any other message or any KV is read or written.
- An HTTP control call (/pd/* on a P or D server, /admin/* on the router) carries a signature
  header: HMAC over a timestamp, the method, the path and the body's digest (sign_request). The
  server (SignedRoutes, an ASGI middleware) refuses a missing, wrong or stale one with 401.

Authentication, not encryption; and the data planes other libraries run (UCX for nixl, the
TCPStore and process group of torch_dist) are not authenticated, only their addresses travel in
authenticated messages: keep the ports on a private network.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from picovllm.disagg.messages import KVAuthChallenge, KVAuthProof, KVAuthResult

SIGNATURE_HEADER = "x-picovllm-signature"
MAX_CLOCK_SKEW_S = 60.0
SECRET_ENV = "PICOVLLM_PD_SECRET"


class AuthError(ConnectionError):
    """A peer did not prove it knows the fleet's secret (or we could not prove it to the peer)."""


@dataclass(frozen=True)
class FleetSecret:
    """The shared secret; its repr never shows it."""
    key: bytes

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise ValueError(f"the fleet secret must be at least 16 bytes, got {len(self.key)}")

    def __repr__(self) -> str:
        return "FleetSecret(<hidden>)"

    @classmethod
    def load(cls, path: str | None = None) -> "FleetSecret":
        """From a file (its first line, stripped), else from $PICOVLLM_PD_SECRET. ValueError if neither."""
        if path:
            with open(path, "rb") as f:
                key = f.read().strip()
            if not key:
                raise ValueError(f"--pd-secret-file: {path} is empty")
            return cls(key)
        key = os.environ.get(SECRET_ENV, "").strip().encode()
        if not key:
            raise ValueError(f"--pd-secret-file: prefill/decode processes need the shared secret (a file, "
                             f"or ${SECRET_ENV})")
        return cls(key)

    @classmethod
    def generate(cls) -> "FleetSecret":
        """A fresh random secret (a run whose processes are all spawned by one parent)."""
        return cls(secrets.token_hex(32).encode())

    def mac(self, *parts: bytes) -> str:
        return hmac.new(self.key, b"\0".join(parts), hashlib.sha256).hexdigest()


# -- the KV-transfer socket: mutual challenge-response ------------------------------------------
def new_nonce() -> str:
    return secrets.token_hex(32)


def client_proof(secret: FleetSecret, server_nonce: str, client_nonce: str) -> str:
    return secret.mac(b"picovllm-kv-client", server_nonce.encode(), client_nonce.encode())


def server_proof(secret: FleetSecret, server_nonce: str, client_nonce: str) -> str:
    return secret.mac(b"picovllm-kv-server", server_nonce.encode(), client_nonce.encode())


def proofs_match(expected: str, got: object) -> bool:
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode())


def challenge_peer(send: Callable[[Any], None], recv: Callable[[], Any], secret: FleetSecret,
                   instance_id: str = "", lease_s: float = 10.0) -> None:
    """The listening side's half of the handshake, over a connection's framed messages (recv may raise
    on a timeout). Sends a KVAuthChallenge, checks the KVAuthProof, answers with its own proof, or with
    a refusal and AuthError (the caller closes the connection)."""
    nonce = new_nonce()
    send(KVAuthChallenge(nonce, instance_id, lease_s))
    try:
        msg = recv()
    except ValueError:              # not a message at all: refused like a wrong proof
        msg = None
    if not isinstance(msg, KVAuthProof) or not isinstance(msg.nonce, str) or \
            not proofs_match(client_proof(secret, nonce, msg.nonce), msg.proof):
        send(KVAuthResult(error="authentication failed: not the shared secret (--pd-secret-file)"))
        raise AuthError("the peer did not prove the shared secret")
    send(KVAuthResult(proof=server_proof(secret, nonce, msg.nonce)))


def answer_challenge(send: Callable[[Any], None], recv: Callable[[], Any], secret: FleetSecret) -> KVAuthChallenge:
    """The connecting side's half: answer the challenge, check the server's proof. Returns the challenge
    (a fleet's KV server names its instance and lease in it); AuthError if either side fails."""
    challenge = recv()
    if not isinstance(challenge, KVAuthChallenge) or not isinstance(challenge.nonce, str):
        raise AuthError(f"expected a KVAuthChallenge, got {type(challenge).__name__}: the peer does not "
                        f"authenticate (not a picovllm P/D process of this version?)")
    nonce = new_nonce()
    send(KVAuthProof(client_proof(secret, challenge.nonce, nonce), nonce))
    result = recv()
    if not isinstance(result, KVAuthResult) or result.error is not None:
        raise AuthError(f"refused: {getattr(result, 'error', result)}")
    if not proofs_match(server_proof(secret, challenge.nonce, nonce), result.proof):
        raise AuthError("the peer did not prove the shared secret")
    return challenge


# -- HTTP control calls: a signed header -------------------------------------------------------
def _request_mac(secret: FleetSecret, ts: str, method: str, path: str, body: bytes) -> str:
    return secret.mac(b"picovllm-http", ts.encode(), method.upper().encode(), path.encode(),
                      hashlib.sha256(body).hexdigest().encode())


def sign_request(secret: FleetSecret, method: str, path: str, body: bytes = b"") -> dict[str, str]:
    """The header that authenticates one HTTP call (path without the query string)."""
    ts = f"{time.time():.3f}"
    return {SIGNATURE_HEADER: f"{ts}:{_request_mac(secret, ts, method, path, body)}"}


def check_signature(secret: FleetSecret, header: str | None, method: str, path: str, body: bytes) -> str | None:
    """None if the header signs this call; otherwise why not."""
    if not header or ":" not in header:
        return f"missing {SIGNATURE_HEADER} header: control routes need the P/D shared secret (--pd-secret-file)"
    ts, mac = header.split(":", 1)
    try:
        age = abs(time.time() - float(ts))
    except ValueError:
        return f"{SIGNATURE_HEADER}: bad timestamp"
    if age > MAX_CLOCK_SKEW_S:
        return f"{SIGNATURE_HEADER}: timestamp is {age:.0f} s off (stale or clocks apart)"
    if not proofs_match(_request_mac(secret, ts, method, path, body), mac):
        return f"{SIGNATURE_HEADER}: wrong signature (not the P/D shared secret?)"
    return None


class SignedRoutes:
    """ASGI middleware: requests under `prefixes` must carry a valid signature (401 otherwise).

    The body is read whole (control bodies are small) to check its digest, then replayed to the app."""

    def __init__(self, app, secret: FleetSecret, prefixes: tuple[str, ...]) -> None:
        self.app, self.secret, self.prefixes = app, secret, prefixes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        header = dict(scope["headers"]).get(SIGNATURE_HEADER.encode(), b"").decode(errors="replace")
        why = check_signature(self.secret, header, scope["method"], scope["path"], body)
        if why is not None:
            payload = json.dumps({"error": {"message": why, "type": "authentication_error", "param": None,
                                            "code": None}}).encode()
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
