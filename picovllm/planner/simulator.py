"""A discrete-event simulation of a colocated or an xPyD deployment, step by step as the engine runs.

Each instance runs engine steps back to back while it has work. A step is planned as the
Scheduler plans one (decodes first, one token each, then running prefill chunks, then waiting
requests FCFS, under the chunk budget `chunk` = max_num_batched_tokens and max_num_seqs) and lasts
StepProfile.step_time(prefill tokens, decode batch, decode context); the first step after an idle spell
lasts StepProfile.wake_time(the spell's length) more (an engine that waited for work starts slow). At its
end, a request whose prompt completed has its first token; a decode has its next one. Roles:

    colocated ("pd")  arrivals go to the instance with the fewest prompt tokens left to compute (of those, the one
                      with the fewest requests: a colocated instance decodes its requests too)
    P ("p")           the same; a request leaves P at its first token, its KV moves to a D in
                      kv_bytes / transfer_bw + transfer_latency seconds (the pull)
    D ("d")           takes it on arrival (the instance with the fewest requests), decodes it to the end

A step's time is the profile's, plus the serving loop's cost of each sequence's output (profile.serve_per_seq,
measured with the profile) and of each request the step admits (profile.serve_per_admission). What the client sees is the steps' times plus what the steps do not hold, taken from a
measured run (plan.calibrate): constant overheads (step_overhead on every step: a served step is the engine's step
plus the rest of the server's loop and the hand-off of its outputs to the HTTP side, which compete for the same cores;
request_overhead on the first token, and idle_overhead on a request that finds its instance idle: the
serving side's own wake-up, beyond the engine's; handover_overhead on an xPyD request's hop from P to D,
inside the simulation since it delays D's admission) and, for the tails, HostNoise: the spread a real
server adds (HTTP and tokenization per request; per gap, the delivery of tokens to the client, which on
a busy host coalesces several tokens into one chunk and stalls others). Noise is drawn from the
calibration run's residuals, independently per request and gap (seeded), and touches only the client's
view, not the engine's schedule. The gap residuals are measured per chunk (as `bench serve` counts ITL: a
chunk may carry several tokens) and drawn per token gap here: ITL percentiles and the worst gap come out
as measured, a request's end-to-end time would not (it is not predicted).

Not modelled: the KV cache's size (no preemption; D admits up to max_num_seqs) and prefix caching (a
measured run's prompts must be new to the server: BENCHMARKS.md, eighteenth session), the HTTP front-end's own
CPU (one Python process a server, ~2 ms a request and ~0.07 ms a streamed token on the H200's host: near 160
requests/s of 64 tokens it is nearly full and bursts queue there, BENCHMARKS.md, nineteenth session), overlap of transfers
with a D that is itself busy with that pull (a pull costs D no step time), instances that share a host's
cores (on one CPU, P's prefill slows while D decodes), and why the client's chunk gaps split as they do
(on a 2-core CPU they are bimodal, and their median moves between runs of one setting: BENCHMARKS.md, the
planner).
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from picovllm.planner.profile import StepProfile, check_number


@dataclass(frozen=True)
class Lengths:
    """A length distribution: "256" (fixed) or "128-512" (uniform, both ends included)."""
    lo: int
    hi: int

    @classmethod
    def parse(cls, name: str, text: str) -> "Lengths":
        parts = str(text).split("-")
        try:
            lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
        except ValueError:
            lo, hi = 0, -1
        if lo < 1 or hi < lo:
            raise ValueError(f"{name}: a length N or a range LO-HI of positive integers, got {text!r}")
        return cls(lo, hi)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True)
class Traffic:
    rate: float                   # requests per second, Poisson arrivals
    prompt_len: Lengths
    output_len: Lengths
    num_requests: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        check_number(self.rate, "rate", above=True)     # NaN or inf: arrivals at NaN, or all at once
        check_number(self.num_requests, "num_requests", low=1, integer=True)


@dataclass(frozen=True)
class HostNoise:
    """Residuals measured against the simulation (seconds), replayed at random on the client's view.

    ttft: added to each request's first token (around zero: the median is request_overhead).
    gap: added to each later token gap, which stays >= 0 (a measured gap minus the simulated step).
    handover: added to an xPyD request's first gap (around zero: the median is handover_overhead)."""
    ttft: tuple[float, ...] = ()
    gap: tuple[float, ...] = ()
    handover: tuple[float, ...] = ()
    seed: int = 0

    def apply(self, requests: list["SimRequest"], xpyd: bool) -> None:
        rng = random.Random(self.seed)
        ttft, gap, handover = (_Shuffled(pool, rng) for pool in (self.ttft, self.gap, self.handover))
        for r in requests:
            times, out = r.token_times, []
            for k, t in enumerate(times):
                if k == 0:
                    out.append(t + ttft.next())
                else:
                    extra = handover.next() if k == 1 and xpyd else gap.next()
                    out.append(out[-1] + max(0.0, t - times[k - 1] + extra))
            r.token_times = out


class _Shuffled:
    """Draws from a pool without replacement, a fresh shuffle per pass: each residual is used as often as
    the others, so a tail of a few measured values is neither lost nor doubled by chance (as a p99 over a
    hundred requests would be by draws with replacement)."""

    def __init__(self, pool: tuple[float, ...], rng: random.Random) -> None:
        self.pool, self.rng, self.order = list(pool), rng, []

    def next(self) -> float:
        if not self.pool:
            return 0.0
        if not self.order:
            self.order = self.pool[:]
            self.rng.shuffle(self.order)
        return self.order.pop()


@dataclass(frozen=True)
class Deployment:
    num_prefill: int              # 0: colocated, num_decode instances of role "pd"
    num_decode: int
    chunk: int                    # max_num_batched_tokens
    max_num_seqs: int = 256
    transfer_bw: float = 10e9     # bytes per second of a pull
    transfer_latency: float = 1e-3
    # Calibrated from a measured run (plan.calibrate), else 0: what the engine steps do not hold
    step_overhead: float = 0.0      # seconds a served step costs beyond the profile's (the server's loop, hand-off)
    request_overhead: float = 0.0   # seconds from the client's send to the engine, and the first token back
    idle_overhead: float = 0.0      # more (or less) for a request that finds its instance idle (no step running)
    handover_overhead: float = 0.0  # xPyD: the router's hop from P to D (its calls, D's claim), beyond the pull
    noise: HostNoise | None = None  # calibrated too: the spread around those overheads (the tails)

    def __post_init__(self) -> None:
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ValueError(f"a deployment needs >= 1 decode (or colocated) instance and >= 0 prefill instances, "
                             f"got {self.num_prefill}P {self.num_decode}D")
        check_number(self.chunk, "chunk", low=1, integer=True)
        check_number(self.max_num_seqs, "max_num_seqs", low=1, integer=True)
        # a pull's time is bytes / transfer_bw + transfer_latency: not below zero, nor infinite
        check_number(self.transfer_bw, "transfer_bw", above=True)
        check_number(self.transfer_latency, "transfer_latency")

    @property
    def name(self) -> str:
        base = f"{self.num_decode}x colocated" if self.num_prefill == 0 else f"{self.num_prefill}P{self.num_decode}D"
        return f"{base}, chunk {self.chunk}"


@dataclass
class SimRequest:
    arrival: float
    prompt: int
    output: int
    computed: int = 0                                   # prompt tokens computed
    ready: float = 0.0                                  # when it joined its instance's queue
    found_idle: bool = False                            # it arrived at an instance with no step running
    token_times: list[float] = field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.computed == self.prompt


@dataclass
class _Instance:
    role: str
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    busy: bool = False
    started: float = 0.0                                # when the step in flight began
    ended: float = float("-inf")                        # when the last step ended (never: idle since ever)
    plan: tuple = ()                                    # the step in flight: (decodes, [(req, n)])

    def prompt_backlog(self) -> int:
        return sum(r.prompt - r.computed for r in itertools.chain(self.waiting, self.running))


@dataclass
class SimResult:
    deployment: Deployment
    requests: list[SimRequest]

    def ttfts(self) -> np.ndarray:
        return np.array([r.token_times[0] - r.arrival for r in self.requests])

    def itls(self) -> np.ndarray:
        gaps = [np.diff(r.token_times) for r in self.requests if len(r.token_times) > 1]
        return np.concatenate(gaps) if gaps else np.zeros(0)

    def summary(self, ttft_slo: float, itl_slo: float) -> dict:
        ttft, itl = self.ttfts(), self.itls()
        # as `picovllm bench serve` counts it: the ITL SLO holds for every gap of the request
        good = sum(1 for r, t in zip(self.requests, ttft)
                   if t <= ttft_slo and (len(r.token_times) < 2 or np.diff(r.token_times).max() <= itl_slo))
        span = max(r.token_times[-1] for r in self.requests) - min(r.arrival for r in self.requests)
        pct = (lambda a, q: float(np.percentile(a, q)) if len(a) else 0.0)
        return {"deployment": self.deployment.name, "num_prefill": self.deployment.num_prefill,
                "num_decode": self.deployment.num_decode, "chunk": self.deployment.chunk,
                "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50),
                "itl_p99": pct(itl, 99), "goodput": good / max(span, 1e-9), "good_fraction": good / len(self.requests),
                "throughput": len(self.requests) / max(span, 1e-9)}


def make_requests(traffic: Traffic) -> list[SimRequest]:
    rng = random.Random(traffic.seed)
    t, out = 0.0, []
    for _ in range(traffic.num_requests):
        t += rng.expovariate(traffic.rate)
        out.append(SimRequest(t, traffic.prompt_len.sample(rng), traffic.output_len.sample(rng)))
    return out


def simulate(profile: StepProfile, deployment: Deployment, requests: list[SimRequest]) -> SimResult:
    """Run the requests (fresh copies) through the deployment; every one finishes."""
    reqs = [SimRequest(r.arrival, r.prompt, r.output) for r in requests]
    colocated = deployment.num_prefill == 0
    front = [_Instance("pd" if colocated else "p") for _ in range(deployment.num_prefill or deployment.num_decode)]
    back = [] if colocated else [_Instance("d") for _ in range(deployment.num_decode)]
    events: list = []
    seq = itertools.count()
    for r in reqs:
        heapq.heappush(events, (r.arrival, next(seq), "arrive", r))

    def start(inst: _Instance, now: float, cutoff: float) -> None:
        """Plan the instance's next step, of the requests queued by `cutoff`: when it was planned (under
        overlap, as the step that just ended began; then, if that gives nothing, as the engine idles, now)."""
        if inst.busy:
            return
        dt = _plan_step(inst, profile, deployment, cutoff)
        if dt is None and cutoff < now:
            dt = _plan_step(inst, profile, deployment, now)
        if dt is not None:
            dt += profile.wake_time(now - inst.ended)   # 0 straight after a step
            inst.busy, inst.started = True, now
            heapq.heappush(events, (now + dt + deployment.step_overhead, next(seq), "step", inst))

    while events:
        now, _, kind, obj = heapq.heappop(events)
        if kind in ("arrive", "kv"):
            if kind == "arrive":
                # most arrivals find no prompt left anywhere: by that alone, the first instance took them all
                inst = min(front, key=lambda i: (i.prompt_backlog(), len(i.running) + len(i.waiting)))
                obj.found_idle = not inst.busy
            else:
                inst = min(back, key=lambda i: len(i.running) + len(i.waiting))
            obj.ready = now
            inst.waiting.append(obj)
            start(inst, now, now)
        else:
            obj.busy, obj.ended = False, now
            for r in _finish_step(obj, now):            # requests leaving a P at their first token
                pull = r.prompt * profile.kv_bytes_per_token / deployment.transfer_bw + deployment.transfer_latency
                heapq.heappush(events, (now + pull + deployment.handover_overhead, next(seq), "kv", r))
            start(obj, now, obj.started if profile.overlapped else now)
    for r in reqs:                                      # as the client sees them
        extra = deployment.request_overhead + (deployment.idle_overhead if r.found_idle else 0.0)
        r.token_times = [t + extra for t in r.token_times]
    if deployment.noise is not None:
        deployment.noise.apply(reqs, not colocated)
    return SimResult(deployment, reqs)


def _plan_step(inst: _Instance, profile: StepProfile, dep: Deployment, cutoff: float) -> float | None:
    budget, admitted = dep.chunk, 0
    if inst.role == "d":                                # D: admit arrivals, decode everyone
        while inst.waiting and inst.waiting[0].ready <= cutoff and len(inst.running) < dep.max_num_seqs:
            inst.running.append(inst.waiting.popleft())
            admitted += 1
    decodes = [r for r in inst.running if r.decoding][:budget]
    budget -= len(decodes)
    chunks = []
    for r in inst.running:
        if not r.decoding and budget > 0:
            n = min(r.prompt - r.computed, budget)
            chunks.append((r, n))
            budget -= n
    while (inst.role != "d" and inst.waiting and inst.waiting[0].ready <= cutoff and budget > 0
           and len(inst.running) < dep.max_num_seqs):
        r = inst.waiting.popleft()
        inst.running.append(r)
        admitted += 1
        n = min(r.prompt, budget)
        chunks.append((r, n))
        budget -= n
    if not decodes and not chunks:
        return None
    inst.plan = (decodes, chunks)
    context = sum(r.prompt + len(r.token_times) for r in decodes)
    # and the serving loop's cost of each sequence's output and of each request it takes in (profile.serve_per_*)
    return profile.step_time(sum(n for _, n in chunks), len(decodes), context) \
        + profile.serve_per_seq * (len(decodes) + len(chunks)) + profile.serve_per_admission * admitted


def _finish_step(inst: _Instance, now: float) -> list[SimRequest]:
    decodes, chunks = inst.plan
    handed, done = [], []
    for r in decodes:
        r.token_times.append(now)
        if len(r.token_times) >= r.output:
            done.append(r)
    for r, n in chunks:
        r.computed += n
        if r.decoding:                                  # its first token
            r.token_times.append(now)
            if len(r.token_times) >= r.output:
                done.append(r)
            elif inst.role == "p":
                handed.append(r)
    for r in done + handed:
        inst.running.remove(r)
    return handed
