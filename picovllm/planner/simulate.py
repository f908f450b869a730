"""A discrete-event simulation of a fleet serving a stream of requests: colocated engines, or x prefill and
y decode engines, stepped as picovllm's scheduler steps them, with step times from a measured Profile.

What it models (and what it leaves out):
- An engine steps back to back while it has work. A colocated step takes every decoding request (up to
  max_num_seqs) and fills the rest of the token budget (max_num_batched_tokens) with prompt chunks, first come
  first served, as engine/scheduler.py does; a P step only prompt chunks; a D step only decodes.
- A step's time is the profile's: fixed + per prompt token + per decoding request + per context token.
- A request's first token comes at the end of the step that computes its prompt's last chunk (on P, too: P
  samples it). Then, disaggregated, its KV moves to a D (Profile.transfer_s) and decodes there.
- Routing: a new request goes to the engine (P, or colocated) with the fewest prompt tokens still to compute;
  a prefilled one to the D with the fewest requests. No preemption (KV is assumed to fit), no prefix caching.
"""
from __future__ import annotations

import heapq
import random
import statistics
from dataclasses import dataclass, field

from picovllm.planner.profile import Profile


@dataclass
class Traffic:
    """Poisson arrivals at `rate` per second; prompt and output lengths uniform in [lo, hi]."""
    rate: float
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    num_requests: int = 200
    seed: int = 0

    def requests(self) -> list[tuple[float, int, int]]:
        """(arrival time, prompt tokens, output tokens) of each request, in arrival order."""
        rng, t, out = random.Random(self.seed), 0.0, []
        for _ in range(self.num_requests):
            t += rng.expovariate(self.rate)
            out.append((t, rng.randint(*self.prompt_len), rng.randint(*self.output_len)))
        return out


@dataclass
class Fleet:
    """`colocated` engines, or `prefill` P engines and `decode` D engines (then colocated is 0)."""
    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    chunk: int = 2048            # max_num_batched_tokens of every engine
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        if bool(self.colocated) == bool(self.prefill or self.decode) or (self.prefill == 0) != (self.decode == 0):
            raise ValueError(f"Fleet: either colocated engines or both prefill and decode ones, got {self}")

    @property
    def name(self) -> str:
        return f"{self.colocated}x colocated" if self.colocated else f"{self.prefill}P{self.decode}D"


@dataclass
class _Request:
    arrival: float
    prompt: int
    output: int
    computed: int = 0                 # prompt tokens computed
    tokens: list[float] = field(default_factory=list)   # when each output token came


@dataclass
class _Engine:
    role: str                         # "pd", "p" or "d"
    waiting: list[_Request] = field(default_factory=list)   # prompts to compute (pd, p)
    running: list[_Request] = field(default_factory=list)   # decoding (pd, d)
    busy: bool = False

    def backlog(self) -> int:
        return sum(r.prompt - r.computed for r in self.waiting)


@dataclass
class Result:
    fleet: str
    ttft: list[float]
    itl: list[float]
    tpot: list[float]                 # per request: mean time per output token after the first
    duration: float
    good: int                         # requests meeting both SLOs (TTFT, and their own ITL p99)

    def summary(self) -> dict:
        def pct(xs: list[float], q: float) -> float:
            return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 6) if len(xs) > 1 else \
                round(xs[0], 6) if xs else 0.0
        return {"fleet": self.fleet, "ttft_p50": pct(self.ttft, 50), "ttft_p99": pct(self.ttft, 99),
                "itl_p50": pct(self.itl, 50), "itl_p99": pct(self.itl, 99),
                "goodput_rps": round(self.good / self.duration, 4) if self.duration else 0.0}


def simulate(profile: Profile, fleet: Fleet, traffic: Traffic | list[tuple[float, int, int]], slo_ttft: float = 1.0,
             slo_itl: float = 0.05) -> Result:
    """Run the traffic (or a list of (arrival, prompt tokens, output tokens)) through the fleet; the result's
    latencies in seconds. SLOs: a request is good when its time to first token is at most slo_ttft and the
    99th percentile of its gaps between tokens at most slo_itl."""
    front = [_Engine("pd") for _ in range(fleet.colocated)] or [_Engine("p") for _ in range(fleet.prefill)]
    back = [_Engine("d") for _ in range(fleet.decode)]
    arrivals = [_Request(t, p, o) for t, p, o in (traffic.requests() if isinstance(traffic, Traffic) else traffic)]
    events: list[tuple[float, int, str, object]] = []   # (time, tie-break, kind, payload)
    seq = 0

    def push(t: float, kind: str, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    for r in arrivals:
        push(r.arrival, "arrive", r)
    done: list[_Request] = []
    now = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            min(front, key=_Engine.backlog).waiting.append(payload)
            woken = [e for e in front if not e.busy]
        elif kind == "handed":          # KV arrived at a D
            d = min(back, key=lambda e: len(e.running))
            d.running.append(payload)
            woken = [d]
        else:                           # a step ended
            engine, plan = payload
            engine.busy = False
            for r, n in plan:
                _finish_chunk(engine, r, n, now, fleet, profile, push, done)
            woken = [engine]
        for e in woken:
            if not e.busy:
                plan, duration = _plan_step(e, fleet, profile)
                if plan:
                    e.busy = True
                    push(now + duration, "step", (e, plan))
    return _result(fleet, done, slo_ttft, slo_itl)


def _plan_step(e: _Engine, fleet: Fleet, profile: Profile) -> tuple[list[tuple[_Request, int]], float]:
    """The step an engine would schedule now: [(request, tokens)] (1 for a decode) and its duration."""
    plan: list[tuple[_Request, int]] = []
    decodes = e.running[:fleet.max_num_seqs] if e.role != "p" else []
    plan += [(r, 1) for r in decodes]
    budget, prompt_tokens = fleet.chunk - len(decodes), 0
    if e.role != "d":
        for r in e.waiting:
            if budget <= 0 or len(plan) >= fleet.max_num_seqs:
                break
            n = min(r.prompt - r.computed, budget)
            plan.append((r, n))
            budget -= n
            prompt_tokens += n
    context = sum(r.prompt + len(r.tokens) for r in decodes)
    return plan, profile.step_s(prompt_tokens, len(decodes), context)


def _finish_chunk(e: _Engine, r: _Request, n: int, now: float, fleet: Fleet, profile: Profile, push,
                  done: list[_Request]) -> None:
    if r.computed < r.prompt:           # a prompt chunk
        r.computed += n
        if r.computed < r.prompt:
            return
        e.waiting.remove(r)
        r.tokens.append(now)            # the first token
        if len(r.tokens) >= r.output:
            done.append(r)
        elif e.role == "p":
            push(now + profile.transfer_s(r.prompt), "handed", r)
        else:
            e.running.append(r)
        return
    r.tokens.append(now)                # a decode
    if len(r.tokens) >= r.output:
        e.running.remove(r)
        done.append(r)


def _result(fleet: Fleet, done: list[_Request], slo_ttft: float, slo_itl: float) -> Result:
    ttft, itl, tpot, good = [], [], [], 0
    for r in done:
        first = r.tokens[0] - r.arrival
        gaps = [b - a for a, b in zip(r.tokens, r.tokens[1:])]
        ttft.append(first)
        itl += gaps
        tpot.append(sum(gaps) / len(gaps) if gaps else 0.0)
        p99 = sorted(gaps)[max(0, -(-99 * len(gaps) // 100) - 1)] if gaps else 0.0   # nearest rank
        good += first <= slo_ttft and p99 <= slo_itl
    start = min((r.arrival for r in done), default=0.0)
    end = max((r.tokens[-1] for r in done), default=0.0)
    return Result(fleet.name, ttft, itl, tpot, end - start, good)


def fleets(engines: int, chunks: list[int], max_num_seqs: int = 256) -> list[Fleet]:
    """Every way to run on `engines` devices: all colocated, or x P and engines - x D; at each chunk size."""
    out = []
    for chunk in chunks:
        out.append(Fleet(colocated=engines, chunk=chunk, max_num_seqs=max_num_seqs))
        out += [Fleet(prefill=x, decode=engines - x, chunk=chunk, max_num_seqs=max_num_seqs) for x in range(1, engines)]
    return out


def recommend(profile: Profile, traffic: Traffic, engines: int, chunks: list[int], slo_ttft: float = 1.0,
              slo_itl: float = 0.05, max_num_seqs: int = 256) -> list[dict]:
    """Each fleet's predicted latencies and goodput, best first (goodput, then p99 TTFT)."""
    rows = []
    for f in fleets(engines, chunks, max_num_seqs):
        row = simulate(profile, f, traffic, slo_ttft, slo_itl).summary()
        row["chunk"] = f.chunk
        rows.append(row)
    return sorted(rows, key=lambda r: (-r["goodput_rps"], r["ttft_p99"]))
