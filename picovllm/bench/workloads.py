"""The benchmark workloads, drawn exactly as issue 2 specifies so every engine sees the same requests.

Prompts are random token ids (no tokenizer needed); all prompts are drawn first, then every
request's max_tokens, from one `random.Random(0)` stream. EOS is ignored, so the output length is
exactly max_tokens.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    num_requests: int
    prompt_len: tuple[int, int]        # inclusive range of prompt lengths
    output_len: tuple[int, int]        # inclusive range of max_tokens
    max_token_id: int                  # prompt ids are drawn from [0, max_token_id]
    # Totals of the full workload (num_requests), the check that we drew what the peers drew.
    total_prompt_tokens: int | None
    total_output_tokens: int
    model: str | None = None           # None: the default model
    dtype: str = "auto"


@dataclass
class Workload:
    spec: WorkloadSpec
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


WORKLOADS: dict[str, WorkloadSpec] = {
    # nano-vllm's bench.py, meant for Qwen3-0.6B on a GPU.
    "nano": WorkloadSpec("nano", 256, (100, 1024), (100, 1024), 10000, 142_827, 133_966, dtype="auto"),
    # Its CPU variant, on the default model (SmolLM2-135M-Instruct) in fp32.
    "cpu-small": WorkloadSpec("cpu-small", 32, (32, 256), (32, 128), 10000, 4_813, 2_489, dtype="float32"),
}


def make_workload(name: str, num_requests: int | None = None, seed: int = 0) -> Workload:
    """Draw workload `name`; with num_requests, its first num_requests requests (more than the spec's: drawn on)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r} is unknown; choose from {', '.join(WORKLOADS)}")
    spec = WORKLOADS[name]
    n = spec.num_requests if num_requests is None else num_requests
    if n < 1:
        raise ValueError(f"num_prompts must be >= 1, got {n}")
    total = max(n, spec.num_requests)      # draw the whole workload, so a prefix of it is its first n requests
    rng = random.Random(seed)
    prompts = [[rng.randint(0, spec.max_token_id) for _ in range(rng.randint(*spec.prompt_len))] for _ in range(total)]
    max_tokens = [rng.randint(*spec.output_len) for _ in range(total)]
    return Workload(spec, prompts[:n], max_tokens[:n])


def check_totals(w: Workload) -> None:
    """Assert the full, seed-0 draw matches the published totals (a different draw is not the benchmark)."""
    spec = w.spec
    if len(w.prompts) != spec.num_requests:
        return
    if w.num_output_tokens != spec.total_output_tokens:
        raise AssertionError(f"workload {spec.name}: {w.num_output_tokens} output tokens, expected "
                             f"{spec.total_output_tokens}")
    if spec.total_prompt_tokens is not None and w.num_prompt_tokens != spec.total_prompt_tokens:
        raise AssertionError(f"workload {spec.name}: {w.num_prompt_tokens} prompt tokens, expected "
                             f"{spec.total_prompt_tokens}")
