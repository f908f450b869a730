"""Host cost of an engine step: a tiny random Qwen3 (default hidden 64, 2 layers), so the model's arithmetic is
negligible and what is measured is the per-step Python work (scheduling, input building, metadata, per-layer
dispatch, sampling set-up, postprocessing), which a GPU step pays whatever the model's size.

    python benchmarks/step_host_cost.py [--layers 2] [--prompt-len 512] [--iters 50] [--device cpu]
    python benchmarks/step_host_cost.py --batches 32 128 256 [--steps 200] [--context 64] [--repetition-penalty 1.05]
    python -m cProfile -s cumtime benchmarks/step_host_cost.py --iters 200 | head -60   # where it goes

Reports the median µs per step: a fresh prefill of --prompt-len tokens (one request, its first token), a
cached prefix plus a 2-token suffix, and a batch-1 decode step; with --phases, the prefill step's phases
(schedule, prepare, forward, sample, postprocess), the forward's input upload (inputs) and add_request.
On the CPU a 512-token prefill's forward is mostly attention arithmetic (and noisy on a shared machine); the
other phases are the host work a GPU step pays as they are.

With --batches, instead: for each batch size B, B requests of --context-token prompts all decoding (prefix caching
on, as by default), the median µs of a step and of its phases over --steps steps, with outputs off (LLM.generate's
steps: only finished requests get one) and on (a served engine's: an output per request per step). The per-request work
(scheduling, block allocation, the step's input and sampling rows, applying tokens, stop checks, outputs) grows
with B; "forward" (the step's tensors and the model) and "sample" (the argmax, on the CPU) are mostly arithmetic.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from random_qwen3 import build  # noqa: E402


class PhaseClock:
    """Wraps the runner's jobs of one step to time them (host time: on CUDA, without a sync per phase)."""

    def __init__(self, engine) -> None:
        self.t: dict[str, list[float]] = {}
        runner = engine.runner
        for obj, name, label in [(engine, "_schedule", "schedule"), (engine.executor, "prepare", "prepare"),
                                 (runner, "compute_logits", "forward"), (runner, "launch_sampling", "sample"),
                                 (engine, "advance", "advance"), (engine, "apply_results", "postprocess")]:
            setattr(obj, name, self._timed(getattr(obj, name), label))

    def _timed(self, fn, label):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t.setdefault(label, []).append(time.perf_counter() - t0)
        return run

    def reset(self) -> None:
        self.t.clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", default="torch", help="torch: SDPA, whose prefill costs least here")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--phases", action="store_true", help="time the phases of the prefill step")
    p.add_argument("--batches", type=int, nargs="+", help="time decode steps at these batch sizes instead")
    p.add_argument("--steps", type=int, default=200, help="decode steps timed per batch size (--batches)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="--batches: every request's (a model's generation_config may set one for all: Qwen2.5's 1.05)")
    p.add_argument("--context", type=int, default=64,
                   help="--batches: each request's prompt length (its block table's length is what the graph "
                        "runners upload a step)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from picovllm.engine.llm_engine import Engine
    from picovllm.config import EngineConfig
    from picovllm.sampling_params import SamplingParams

    h = args.hidden
    path = os.path.join(tempfile.gettempdir(), f"picovllm-host-cost-qwen3-{h}x{args.layers}")
    build(path, vocab_size=1024, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=args.layers,
          num_attention_heads=4, num_key_value_heads=2, head_dim=max(16, h // 4), max_position_embeddings=8192)
    if args.batches:
        return decode_batches(path, args)
    eng = Engine(EngineConfig(model=path, device=args.device, attention_backend=args.attention_backend,
                              max_model_len=4096, num_kv_blocks=2048, max_num_batched_tokens=4096,
                              skip_tokenizer_init=True))
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(1024) for _ in range(n)]   # noqa: E731
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)   # noqa: E731
    clock = PhaseClock(eng) if args.phases else None

    def timed_steps(rid: str) -> list[float]:
        times = []
        while rid in eng.requests:
            t0 = time.perf_counter()
            eng.step(unfinished_outputs=False)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times

    def prefill() -> float:
        return sum(timed_steps(eng.add_request(prompt(args.prompt_len), greedy(1))))

    def cached() -> float:
        prefix = prompt(args.prefix_len)
        timed_steps(eng.add_request(prefix, greedy(1)))
        return sum(timed_steps(eng.add_request(prefix + prompt(2), greedy(1))))

    def decode() -> float:
        times = timed_steps(eng.add_request(prompt(16), greedy(8)))
        return statistics.median(times[1:])

    rows = {}
    for name, fn in (("prefill", prefill), ("cached prefix + 2", cached), ("decode batch 1", decode)):
        for _ in range(3):
            fn()
        if clock and name == "prefill":
            clock.reset()
        rows[name] = statistics.median(fn() for _ in range(args.iters))
        if clock and name == "prefill":
            phases = {k: statistics.median(v) * 1e6 for k, v in clock.t.items()}
    backend = type(eng.runner.attn_backend).__name__
    print(f"tiny Qwen3 hidden {h}, {args.layers} layers, {args.device}, attention {backend}, "
          f"{torch.get_num_threads()} thread(s)")
    for name, s in rows.items():
        label = f"{name} ({args.prompt_len} tokens)" if name == "prefill" else name
        print(f"  {label:32s} {s * 1e6:9.0f} us/step")
    if clock:
        phases["inputs"] = input_upload_us(eng, prompt(args.prompt_len), args.iters)
        phases["add_request"] = add_request_us(eng, prompt(args.prompt_len), args.iters)
        print("  prefill phases (median us): " + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))
        print("  (forward includes inputs: the step's tensors built and uploaded)")


def decode_batches(path: str, args) -> None:
    """--batches: a step of B decoding requests, with outputs off and on, and its phases (median µs)."""
    from picovllm.config import EngineConfig
    from picovllm.engine.llm_engine import Engine
    from picovllm.sampling_params import SamplingParams

    max_len, rng = args.context + 2 * args.steps + 64, random.Random(0)
    print(f"tiny Qwen3 hidden {args.hidden}, {args.layers} layers, {args.device}, {torch.get_num_threads()} thread(s); "
          f"decode steps, {args.context}-token prompts, repetition penalty {args.repetition_penalty}, median us")
    for batch in args.batches:
        # the engine's own attention backend: on the CPU, the decode steps' one-call stack
        eng = Engine(EngineConfig(model=path, device=args.device, max_model_len=max_len, max_num_seqs=batch,
                                  num_kv_blocks=batch * -(-max_len // 16), max_num_batched_tokens=max(4096, 64 * batch),
                                  skip_tokenizer_init=True))
        for _ in range(batch):
            eng.add_request([rng.randrange(1024) for _ in range(args.context)],
                            SamplingParams(temperature=0, max_tokens=max_len, ignore_eos=True,
                                           repetition_penalty=args.repetition_penalty))
        while not all(r.output_token_ids for r in eng.requests.values()):
            eng.step(unfinished_outputs=False)
        clock = PhaseClock(eng)
        for outputs in (False, True):
            for _ in range(5):
                eng.step(unfinished_outputs=outputs)
            clock.reset()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                eng.step(unfinished_outputs=outputs)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            phases = ", ".join(f"{k} {statistics.median(v) * 1e6:.0f}" for k, v in clock.t.items())
            print(f"  batch {batch:4d}, outputs {'on ' if outputs else 'off'} {statistics.median(times) * 1e6:8.0f} "
                  f"us/step ({phases})")
        eng.shutdown()


def add_request_us(eng, prompt: list[int], iters: int) -> float:
    """Median µs to validate and queue a request (part of its time to first token)."""
    from picovllm.sampling_params import SamplingParams
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), request_id=f"a{i}")
        times.append(time.perf_counter() - t0)
        eng.abort(f"a{i}")
    return statistics.median(times) * 1e6


def input_upload_us(eng, prompt: list[int], iters: int) -> float:
    """Median µs to turn a prefill's StepInput into its device tensors (ids, positions, metadata, logit rows)."""
    from picovllm.engine import model_runner as mr
    from picovllm.sampling_params import SamplingParams
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), request_id="probe")
    step = eng.executor.prepare(eng.scheduler.schedule(), eng.eos_token_ids)
    dev, times = eng.runner.device, []
    for _ in range(iters):
        t0 = time.perf_counter()
        if hasattr(mr, "step_tensors"):
            mr.step_tensors(step, dev)
        else:   # before one packed upload: a tensor per field
            mr.step_metadata(step, dev), mr.token_tensors(step, dev)
            mr.to_device(step.sample_indices + step.prompt_indices, torch.long, dev)
        times.append(time.perf_counter() - t0)
    eng.abort("probe")
    return statistics.median(times) * 1e6


if __name__ == "__main__":
    main()
