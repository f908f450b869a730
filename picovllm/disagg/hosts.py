"""Where the processes of a disaggregated run listen, and the address their peers use to reach them.

Three sockets are bound in a run: the driver's listener (engine workers connect to it), the P
worker's link listener (the D engine connects to it) and, with the torch_dist backend, P's
rendezvous store for the KV process group. Each binds `host` (default 127.0.0.1: one host only)
and is announced to peers as `advertise_host` (default `host`), which must be a concrete address:
binding every interface ("0.0.0.0", "::") needs one. No name is resolved here.
"""
from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

WILDCARDS = ("0.0.0.0", "::")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_host(field: str, value: object) -> str:
    """value if it is an IP address or a well-formed host name; else a ValueError naming `field`."""
    if isinstance(value, str) and _is_ip(value):
        return value
    labels = value.split(".") if isinstance(value, str) and len(value) <= 253 else []
    if labels and all(_LABEL.fullmatch(label) for label in labels) and not labels[-1].isdigit():
        return value
    raise ValueError(f"{field} must be an IP address or a host name (e.g. '127.0.0.1', '0.0.0.0', 'node0'), "
                     f"got {value!r}")


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def is_loopback(host: str) -> bool:
    return host == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback)


def route_address(peer_host: str) -> str:
    """This machine's address on the route to peer_host (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET6 if ":" in peer_host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))
        return s.getsockname()[0]


def local_host(host: str) -> str:
    """An address this process can connect to for a socket bound on `host`."""
    return ("::1" if ":" in host else "127.0.0.1") if is_wildcard(host) else host


@dataclass(frozen=True)
class HostOptions:
    """One process's bind address and the address its peers connect to."""
    host: str = "127.0.0.1"
    advertise_host: str | None = None

    def __post_init__(self) -> None:
        check_host("host", self.host)
        if self.advertise_host is not None:
            check_host("advertise_host", self.advertise_host)
        if self.advertise_host is not None and is_wildcard(self.advertise_host):
            raise ValueError(f"advertise_host must be an address peers can connect to, got {self.advertise_host!r} "
                             f"(a wildcard)")
        if self.advertise_host is None and is_wildcard(self.host):
            raise ValueError(f"advertise_host is required with host {self.host!r} (every interface): this "
                             f"machine's address as its peers reach it")

    @property
    def reach(self) -> str:
        """What peers connect to."""
        return self.advertise_host or self.host


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return False
