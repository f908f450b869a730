"""What the planner knows of an engine on a machine: a step's time as a linear model, fitted to steps measured
on that machine (measure()), and the time a prompt's KV takes to move between engines.

    step seconds = fixed + per_prompt_token * prompt tokens + per_decode * decoding requests
                   + per_context_token * the decoding requests' context tokens

The four coefficients come from a least-squares fit over prompt-only steps of several sizes and decode-only
steps at several batch sizes and context lengths, run through the engine itself (Engine.step), so they include
the host's share of a step as well as the device's.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class Profile:
    fixed: float
    per_prompt_token: float
    per_decode: float
    per_context_token: float
    kv_bytes_per_token: int = 0
    transfer_gbps: float = 10.0           # GB/s between engines (measure with benchmarks/pd_transfer.py)
    transfer_latency: float = 0.002       # seconds added to every handover
    meta: dict = field(default_factory=dict)

    def step_s(self, prompt_tokens: int, decodes: int, context: int) -> float:
        return (self.fixed + self.per_prompt_token * prompt_tokens + self.per_decode * decodes
                + self.per_context_token * context)

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.transfer_latency + prompt_tokens * self.kv_bytes_per_token / (self.transfer_gbps * 1e9)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as f:
            data = json.load(f)
        try:
            return cls(**data)
        except TypeError as e:
            raise ValueError(f"{path}: not a planner profile ({e})") from None


def fit(samples: list[tuple[int, int, int, float]], **extra) -> Profile:
    """A Profile from measured steps: (prompt tokens, decoding requests, context tokens, seconds)."""
    a = np.array([[1.0, p, d, c] for p, d, c, _ in samples])
    y = np.array([s for *_, s in samples])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return Profile(*(max(0.0, float(c)) for c in coef), **extra)


def measure(engine, prompt_sizes=(32, 128, 512), batches=(1, 4, 16), contexts=(64, 256), steps: int = 8,
            repeats: int = 2) -> Profile:
    """Time steps of `engine` (an idle picovllm Engine, prefix caching off): prompt-only steps of each size and
    decode-only steps at each batch size and context length; fit them."""
    rng = random.Random(0)
    vocab = min(engine.model_config.vocab_size, 10000)
    room = engine.max_model_len - steps - 8
    prompt_sizes = [n for n in prompt_sizes if n <= room] or [room]
    contexts = [c for c in contexts if c <= room] or [room]
    samples: list[tuple[int, int, int, float]] = []
    prompt = lambda n: [rng.randrange(vocab) for _ in range(n)]   # noqa: E731
    from picovllm import SamplingParams
    for _ in range(repeats):
        for n in prompt_sizes:           # one prompt, computed in one step (its first token sampled there)
            engine.add_request(prompt(n), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            t = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            samples.append((n, 0, 0, time.perf_counter() - t))
        for b in batches:
            for ctx in contexts:
                ids = [engine.add_request(prompt(ctx), SamplingParams(temperature=0, max_tokens=steps + 4,
                                                                       ignore_eos=True)) for _ in range(b)]
                while not all(engine.requests[i].output_token_ids for i in ids if i in engine.requests):
                    engine.step()
                t = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                samples.append((0, b, b * (ctx + 2 + steps // 2), (time.perf_counter() - t) / steps))
                for i in ids:
                    engine.abort(i)
    mc = engine.model_config
    kv = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * engine.config.torch_dtype.itemsize
    return fit(samples, kv_bytes_per_token=kv, meta={"model": engine.config.model, "device": str(engine.config.device),
                                                      "samples": len(samples)})
