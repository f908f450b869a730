"""How `picovllm router` picks an instance: what it knows of each (Instance) and the policies.

A policy's choose(candidates, prompt_token_ids) returns the instance and the reason, which the
router counts per decision (router_decisions_total{role, policy, reason}). Candidates are the
instances of one role that are up; never empty.

- round_robin: each in turn.
- least_loaded: the smallest Instance.load: its running and waiting requests (from its /pd/load,
  polled every lease / 4) or the router's own count of requests on it now, whichever is larger
  (the poll is stale, the count is not), plus its KV-cache usage (0 to 1) to break ties.
- prefix (P only): requests whose prompts start with the same full blocks go to the P that ran the
  longest such prefix last, since its prefix cache likely holds those blocks; unless that P is
  busier than the least-loaded one by more than max_imbalance, then to the least-loaded.
"""
from __future__ import annotations

import hashlib
import itertools
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Instance:
    url: str
    role: str                          # "p" or "d"
    instance_id: str
    block_size: int
    up: bool = True
    removed: bool = False              # taken out by the admin API: no new requests
    last_ok: float = field(default_factory=time.monotonic)
    down_reason: str | None = None
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0                 # the router's requests on it now
    layout: dict | None = None         # its KV layout (/pd/info's: messages.KVLayout's fields)
    max_model_len: int | None = None

    @property
    def load(self) -> float:
        return max(self.in_flight, self.running + self.waiting) + self.kv_usage

    def describe(self) -> dict:
        return {"url": self.url, "role": self.role, "instance_id": self.instance_id, "up": self.up,
                "down_reason": self.down_reason, "running": self.running, "waiting": self.waiting,
                "kv_usage": self.kv_usage, "in_flight": self.in_flight, "load": self.load}


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: list[Instance], prompt_token_ids: list[int]) -> tuple[Instance, str]:
        ordered = sorted(candidates, key=lambda i: i.url)
        return ordered[next(self._turn) % len(ordered)], "round_robin"


class LeastLoaded:
    name = "least_loaded"

    def choose(self, candidates: list[Instance], prompt_token_ids: list[int]) -> tuple[Instance, str]:
        return min(candidates, key=lambda i: (i.load, i.url)), "least_loaded"


class PrefixAware:
    name = "prefix"

    def __init__(self, max_imbalance: float = 4.0, max_blocks: int = 64, capacity: int = 100_000) -> None:
        self.max_imbalance, self.max_blocks, self.capacity = max_imbalance, max_blocks, capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()    # prefix hash -> url of the P that ran it

    def choose(self, candidates: list[Instance], prompt_token_ids: list[int]) -> tuple[Instance, str]:
        by_url = {i.url: i for i in candidates}
        hashes = prefix_hashes(prompt_token_ids, candidates[0].block_size, self.max_blocks)
        holder = next((by_url[u] for h in reversed(hashes) if (u := self._owner.get(h)) in by_url), None)
        least = min(candidates, key=lambda i: (i.load, i.url))
        if holder is not None and holder.load <= least.load + self.max_imbalance:
            choice, reason = holder, "prefix_hit"
        else:
            choice, reason = least, "prefix_miss" if holder is None else "prefix_overloaded"
        for h in hashes:
            self._owner[h] = choice.url
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        return choice, reason


def prefix_hashes(token_ids: list[int], block_size: int, max_blocks: int) -> list[bytes]:
    """A chained hash per full leading block (as the engine's prefix cache chains them)."""
    out, h = [], b""
    for b in range(min(len(token_ids) // block_size, max_blocks)):
        block = token_ids[b * block_size:(b + 1) * block_size]
        h = hashlib.blake2b(h + struct.pack(f"<{len(block)}q", *block), digest_size=16).digest()
        out.append(h)
    return out


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix": PrefixAware}


def make_policy(name: str, role: str):
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    if name == "prefix" and role != "p":
        raise ValueError("--decode-policy: 'prefix' routes prefills; decode instances take round_robin or least_loaded")
    return POLICIES[name]()
