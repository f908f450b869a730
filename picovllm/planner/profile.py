"""What one engine step costs on this machine: measured, then fitted, for the planner's simulation.

measure_profile() runs an Engine on prefill-only steps of several token counts, decode-only steps at
several batch sizes and contexts, and mixed steps (a prompt's chunk beside decodes), and fits

    step_time(prefill_tokens, decode_batch, decode_context) =
        (c0 if no prefill, c1 if no decodes, else c6) + c2 * prefill_tokens + c3 * prefill_tokens**2
        + (c7 if a mixed step, else c4) * decode_batch + c5 * decode_context

(decode_context: the tokens the batch's decodes attend over, summed) by least squares, with every coefficient >= 0.
A decode beside a chunk may cost otherwise than in a decode-only step (there it is one more row of GEMMs the chunk
runs anyway), so mixed steps have a slope of their own, c7, where the mixed samples hold two batch sizes or more to
fit it from (else c4 serves, and in a profile of seven coefficients, saved before c7, too). The samples reach the
batches a busy server runs (mixed steps of 32 and 64 decodes beside a chunk, decode-only at 64): fitted from
batches of 4-16 beside a chunk, such steps came out 21-31% dearer than measured on this project's 2-core CPU
(`benchmarks/profile_check.py`, BENCHMARKS.md, twenty-second session).
The three kinds of step have fixed costs of their own, as they take different paths through the model: on a GPU,
each replays its own kind of CUDA graph (engine/cuda_graph.py, prefill_graph.py, mixed_graph.py; on an H200 a mixed
step's is 1.8 ms against 1.4 for a lone chunk, and was 4.5 in pieces around eager attention, 15.4 eager;
BENCHMARKS.md). A profile of six coefficients (measured before mixed steps were) takes c1 for c6 (and c4 for c7).
Each sample is the median of several timed steps (a shared machine is noisy); the samples are kept with the fit, so a
profile can be checked and re-fitted. A decode sample records the batch and context it timed (its requests last long
enough that the first is still decoding when the last prompt is in).

An engine that overlaps (async_scheduling, the GPU's default: it plans and launches step k + 1 while step k runs) is
profiled as it serves: a decode or mixed sample is the time between two steps of a stream of such steps (its host
work hides under the device's, so it is less than the step's host plus device time: on an H200 a batch-16 decode
step took 2.0 ms alone and the served engine's token gap was 1.3-1.5 ms, BENCHMARKS.md), and a prefill-only sample
is a lone prompt's time from its arrival to its first token. Without overlap each sample is one step's time.

An engine that has waited for work steps slower at first: on this project's 2-core CPU a lone 128-token prompt of
the planner benchmark's tiny model took 6.4 ms after 0.1 s of quiet against 4.4 back to back (its threads asleep,
its caches cold; BENCHMARKS.md, eighteenth session). `wake` holds that extra against the time the engine
idled before the step: measured on lone prompts of WAKE_PROMPT tokens after each of WAKE_IDLES seconds of sleep,
less the same prompts back to back; the simulation adds it to the first step after an idle spell.

A served step costs more than the engine's own: the server's engine loop encodes each sequence's output and pipes
the step's outputs to the HTTP side (entrypoints/openai/engine_process.py). On an H100 at 160 requests/s the served
engine was host-bound from ~17 sequences a step, and its host parts grew by 0.031 ms a sequence (BENCHMARKS.md,
twenty-third session), a slope the calibration at a low rate cannot see. `serve_per_seq` is that loop's cost a
sequence, measured on the real encoding and a real pipe (measure_serving); the simulation adds it per sequence to
every step. `serve_per_admission` is its cost a new request (measure_admission: ~0.25 ms on an H100's host), added
to the step that admits it: a burst of arrivals slows the steps of every request running beside them.
"""
from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

WAKE_IDLES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)   # seconds of quiet before a timed lone prompt
WAKE_PROMPT = 64
SAMPLE_KEYS = ("prefill", "batch", "context", "seconds")   # a sample's, each a number >= 0


@dataclass
class StepProfile:
    coef: list[float]                              # c0..c7 above (6, 7 or 8 of them), seconds
    kv_bytes_per_token: int                        # K and V of every layer, for the transfer's time
    samples: list[dict] = field(default_factory=list)   # {"prefill", "batch", "context", "seconds"}
    machine: str = ""
    # The engine plans each step while the one before it runs (EngineConfig.async_scheduling), so a request that
    # arrives during a step joins the step after the next. None (a profile saved before this field): on a GPU.
    overlap: bool | None = None
    # [idle seconds, extra seconds] pairs, idle ascending and extra non-decreasing: what the first step after that
    # long without a step costs beyond the fit (empty in a profile saved before this field: nothing)
    wake: list[list[float]] = field(default_factory=list)
    # seconds a served step costs per sequence in it beyond the engine's step: its output encoded and piped to the
    # HTTP side (0 in a profile saved before this field)
    serve_per_seq: float = 0.0
    # seconds the served loop spends on each request it admits: its command unpickled from the pipe, added to the
    # engine, the acceptance sent back, its first output encoded whole (0 in a profile saved before this field)
    serve_per_admission: float = 0.0

    @property
    def overlapped(self) -> bool:
        return self.machine.startswith("cuda") if self.overlap is None else self.overlap

    def step_time(self, prefill_tokens: int, decode_batch: int, decode_context: int) -> float:
        c = self.coef
        if prefill_tokens == 0 and decode_batch == 0:
            return 0.0
        mixed = prefill_tokens > 0 and decode_batch > 0
        fixed = c[0] if not prefill_tokens else c[6] if mixed and len(c) > 6 else c[1]
        per_decode = c[7] if mixed and len(c) > 7 else c[4]
        return fixed + c[2] * prefill_tokens + c[3] * prefill_tokens ** 2 + per_decode * decode_batch \
            + c[5] * decode_context

    def wake_time(self, idle: float) -> float:
        """The extra cost of a step that starts after `idle` seconds without one: the measured points joined
        linearly in log(idle), from nothing at no idle to the first point, the last point's beyond it."""
        pts = self.wake
        if not pts or idle <= 0:
            return 0.0
        if idle <= pts[0][0]:
            return pts[0][1] * idle / pts[0][0]
        for (a, ea), (b, eb) in zip(pts, pts[1:]):
            if idle <= b:
                return ea + (eb - ea) * math.log(idle / a) / math.log(b / a)
        return pts[-1][1]

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "StepProfile":
        """The profile saved at `path`, every field checked: a file edited by hand or cut short fails here, with a
        ValueError naming the file and the field, not later as a wrong type deep in a simulation."""
        with open(path) as f:
            try:
                data = json.load(f)
            except ValueError as e:
                raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a step profile (a JSON object), got {type(data).__name__}")
        try:
            prof = cls(**data)
        except TypeError as e:
            raise ValueError(f"{path}: not a step profile ({e})") from None
        prof._check(path)
        return prof

    def _check(self, path: str) -> None:
        c = self.coef
        if not isinstance(c, list) or len(c) not in (6, 7, 8) or not all(_is_number(x) and x >= 0 for x in c):
            raise ValueError(f"{path}: coef must be 6, 7 or 8 finite numbers >= 0, got {c!r}")
        # a negative size would have the KV reach D before P computed it
        check_number(self.kv_bytes_per_token, f"{path}: kv_bytes_per_token", low=1, integer=True)
        if not isinstance(self.samples, list) or not all(
                isinstance(s, dict) and all(_is_number(s.get(k)) and s[k] >= 0 for k in SAMPLE_KEYS)
                for s in self.samples):
            raise ValueError(f"{path}: samples must be objects of {', '.join(SAMPLE_KEYS)} (numbers >= 0)")
        if not isinstance(self.machine, str):
            raise ValueError(f"{path}: machine must be a string, got {self.machine!r}")
        if self.overlap is not None and not isinstance(self.overlap, bool):     # "false" would read as true
            raise ValueError(f"{path}: overlap must be true, false or null, got {self.overlap!r}")
        check_wake(self.wake, f"{path}: wake")
        check_number(self.serve_per_seq, f"{path}: serve_per_seq")
        check_number(self.serve_per_admission, f"{path}: serve_per_admission")


def _is_number(x) -> bool:
    """A finite int or float, not a bool (which JSON spells true/false and Python counts as an int)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (isinstance(x, int) or math.isfinite(x))


def check_number(value, name: str, low: float = 0.0, above: bool = False, integer: bool = False) -> None:
    """Raise ValueError naming `name` unless value is a finite number (an int where `integer`) >= low (> low where
    `above`): NaN compares false both ways, so a plain `value <= 0` check lets it through."""
    ok = _is_number(value) and (isinstance(value, int) or not integer) and (value > low if above else value >= low)
    if not ok:
        raise ValueError(f"{name} must be {'an integer' if integer else 'a finite number'} {'>' if above else '>='} "
                         f"{low:g}, got {value!r}")


def check_wake(wake: list, name: str = "wake") -> None:
    """Raise ValueError (naming `name`) unless wake is [idle, extra] pairs, idle > 0 ascending, extra >= 0
    non-decreasing."""
    ok = isinstance(wake, list) and all(isinstance(p, (list, tuple)) and len(p) == 2 and all(map(_is_number, p))
                                        for p in wake)
    ok = ok and all(p[0] > 0 and p[1] >= 0 for p in wake)
    ok = ok and all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(wake, wake[1:]))
    if not ok:
        raise ValueError(f"{name} must be [idle seconds, extra seconds] pairs, idle > 0 and ascending, extra >= 0 "
                         f"and non-decreasing, got {wake!r}")


def fit(samples: list[dict], kv_bytes_per_token: int, machine: str = "", overlap: bool | None = None) -> StepProfile:
    """Least squares of the relative errors, with non-negative coefficients (an active-set loop: drop the most
    negative, refit). Relative, as the planner is judged (its predictions within 20% of measured): fitted in
    seconds, the few long steps had the small ones off by 14-41% (a lone decode's 0.6 ms), by 3-12% relative
    (BENCHMARKS.md, twenty-second session)."""
    mixed = [s["prefill"] > 0 and s["batch"] > 0 for s in samples]
    # no mixed step measured: six coefficients (c1 serving for c6); mixed steps of one batch size only: seven (c4
    # serving for c7, which they cannot tell from c6)
    extra = 0 if not any(mixed) else 2 if len({s["batch"] for s, m in zip(samples, mixed) if m}) > 1 else 1
    x = np.array([[float(s["prefill"] == 0), float(s["prefill"] > 0 and not m), s["prefill"], s["prefill"] ** 2,
                   s["batch"] * (not m or extra < 2), s["context"]] + [float(m), s["batch"] * m][:extra]
                  for s, m in zip(samples, mixed)])
    y = np.array([s["seconds"] for s in samples])
    w = 1.0 / np.maximum(y, 1e-9)           # relative errors: a 0.6 ms decode step counts as much as a 15 ms chunk
    x, y = x * w[:, None], y * w
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    active = list(range(x.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(sol)))
    coef = [0.0] * x.shape[1]
    for i, v in zip(active, sol):
        coef[i] = max(0.0, float(v / scale[i]))
    return StepProfile(coef, kv_bytes_per_token, samples, machine, overlap)


def measure_profile(engine, prefill_lens=(16, 64, 128, 256, 512), batches=(1, 4, 16, 32, 64),
                    contexts=(32, 128, 512), repeats: int = 7,
                    mixed=((4, 64), (16, 256), (4, 480), (32, 480), (64, 448)),
                    wake_idles=WAKE_IDLES, passes: int = 3, agree: float = 0.1) -> StepProfile:
    """Time an Engine's steps, as it runs them: overlapped or not (it must hold enough blocks for the largest
    case); then the wake-up cost after each of wake_idles seconds of quiet.

    The samples are taken again, up to `passes` times, until two passes in a row agree (the median of the samples'
    relative differences within `agree`); the last pass is kept. On a device machine just started (an H100,
    twenty-second session) a profile taken at once had every step 0.5-2.9 ms slower than the same steps timed a
    minute later in the same process (a decode of 64 requests 4.2 against 2.7 ms); one taken after other work
    matched them within 5%."""
    from picovllm.sampling_params import SamplingParams

    limit = min(engine.max_model_len - 2, engine.config.max_num_batched_tokens)
    engine.add_request([7] * 8, SamplingParams(max_tokens=4, ignore_eos=True))   # warm-up: first calls
    _drain(engine)
    before = None
    for k in range(max(1, passes)):
        if k:
            engine.block_manager.reset_prefix_cache()      # the prompts again, none a cache hit
        samples = _sample_steps(engine, limit, prefill_lens, batches, contexts, repeats, mixed)
        if before is not None and _agrees(before, samples, agree):
            break
        before = samples
    wake = _measure_wake(engine, min(WAKE_PROMPT, limit), wake_idles, repeats)
    serve = measure_serving(engine, SERVE_BATCH, repeats)
    admission = measure_admission(engine, min(ADMISSION_PROMPT, limit), repeats)
    mc = engine.model_config
    dtype_bytes = engine.runner.kv_cache.element_size()
    kv_bytes = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * dtype_bytes
    model = engine.config.model or "default (SmolLM2-135M-Instruct)"      # None: the default model
    prof = fit(samples, kv_bytes, machine=f"{engine.config.device} {model}",
               overlap=engine.config.async_scheduling)
    prof.wake, prof.serve_per_seq, prof.serve_per_admission = wake, serve, admission
    return prof


SERVE_BATCH = 32      # measure_serving's decode batch: a busy server's


def measure_serving(engine, batch: int = SERVE_BATCH, repeats: int = 7, context: int = 64) -> float:
    """Seconds a sequence's output costs a served step's loop: each output encoded as the engine process sends it
    (OutputDeltas: the new tokens and text) and the step's list sent down a pipe, which a thread drains as the HTTP
    side would. The median over `repeats` decode steps of `batch` requests (fewer where the engine holds fewer),
    per output (the first step, whose outputs go whole, left out); the requests drained after."""
    from picovllm.entrypoints.openai.output_deltas import OutputDeltas
    bm, chunk = engine.block_manager, engine.config.max_num_batched_tokens
    batch = min(batch, engine.config.max_num_seqs)
    while batch > 1:     # the blocks its requests take as _start_decoding sizes them
        fill = -(-batch * (context + 1) // chunk) + batch
        if batch * -(-(context + fill + repeats + 3) // bm.block_size) <= bm.num_free_blocks:
            break
        batch -= 1
    _start_decoding(engine, [[i + 11] * context for i in range(batch)], repeats + 1)
    deltas, times = OutputDeltas(), []
    try:
        with _drained_pipe() as writer:
            for k in range(repeats + 1):
                outputs = engine.step()
                t0 = time.perf_counter()
                writer.send(("step", [deltas.encode(o) for o in outputs], None))
                if k and outputs:
                    times.append((time.perf_counter() - t0) / len(outputs))
    finally:
        _drain(engine)
    return float(np.median(times)) if times else 0.0


@contextlib.contextmanager
def _drained_pipe():
    """The sending end of a pipe whose other end a thread reads and drops, as the HTTP side would."""
    reader, writer = multiprocessing.Pipe(duplex=False)

    def drain() -> None:
        try:
            while True:
                reader.recv_bytes()
        except (EOFError, OSError):
            pass
    thread = threading.Thread(target=drain, name="picovllm-profile-pipe", daemon=True)
    thread.start()
    try:
        yield writer
    finally:
        writer.close()
        thread.join()
        reader.close()


ADMISSION_PROMPT = 256     # measure_admission's prompt tokens (its command's size)


def measure_admission(engine, prompt_len: int = ADMISSION_PROMPT, repeats: int = 7) -> float:
    """Seconds a request's admission costs a served engine loop beyond its steps (the median of `repeats`): its
    AddRequest received from a pipe, added to the engine, the acceptance sent back, and its first output, which
    goes whole (prompt ids included), encoded and sent; the requests drained after. On an H100's host an
    admission added ~0.25 ms to the loop (twenty-third session)."""
    from picovllm.entrypoints.openai.engine_client import AddRequest
    from picovllm.entrypoints.openai.output_deltas import OutputDeltas
    from picovllm.sampling_params import SamplingParams
    commands_in, commands_out = multiprocessing.Pipe(duplex=False)
    deltas, times, vocab = OutputDeltas(), [], engine.model_config.vocab_size
    try:
        with _drained_pipe() as results_out:
            for k in range(repeats):
                rid = f"profile-admit-{k}"
                params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=2, ignore_eos=True, seed=k)
                commands_out.send(AddRequest(rid, [(k * 131 + i) % (vocab - 3) + 3 for i in range(prompt_len)],
                                             params, time.time()))
                t0 = time.perf_counter()
                cmd = commands_in.recv()
                engine.add_request(cmd.prompt_token_ids, cmd.params, cmd.request_id, cmd.arrival_time, cmd.priority)
                results_out.send(("step", [("answer", (rid, None))], None))
                spent = time.perf_counter() - t0
                first = None
                while first is None and engine.has_unfinished_requests():
                    first = next((o for o in engine.step() if o.request_id == rid), None)
                t0 = time.perf_counter()
                if first is not None:
                    results_out.send(("step", [deltas.encode(first)], None))
                times.append(spent + time.perf_counter() - t0)
                _drain(engine)
    finally:
        commands_out.close()
        commands_in.close()
        _drain(engine)
    return float(np.median(times)) if times else 0.0


def _sample_steps(engine, limit: int, prefill_lens, batches, contexts, repeats: int, mixed) -> list[dict]:
    """One pass over the samples (measure_profile's)."""
    samples, token = [], 8      # 8 on: no prompt starts as the warm-up's [7] * 8 does
    for n in [n for n in prefill_lens if n <= limit]:
        # a token of its own per prompt: [7] * 64 began with the blocks of [7] * 16, cached, so it timed 48 tokens
        times = [_timed_prompt(engine, [token + i] * n) for i in range(repeats)]
        token += repeats
        samples.append({"prefill": n, "batch": 0, "context": 0, "seconds": float(np.median(times))})
    for ctx in [c for c in contexts if c <= limit]:
        for b in [b for b in batches if b <= engine.config.max_num_seqs]:
            samples.append(decode_sample(engine, [[i + 5] * ctx for i in range(b)], repeats))
    first = max(token, 5 + max(batches, default=0))     # each mixed sample's prompts start at tokens of its own
    for b, n in mixed:
        if b + n <= limit and b < engine.config.max_num_seqs:
            samples.append(_mixed_sample(engine, b, n, repeats, first_token=first))
            first += b + repeats + 1
    return samples


def decode_sample(engine, prompts: list[list[int]], repeats: int) -> dict:
    """The median decode-only step of the prompts' requests, once every prompt is in; the batch and the context it
    timed (the requests drained after)."""
    _start_decoding(engine, prompts, repeats)
    if engine.overlap:
        engine.step()       # the call that reads the last prompt's step: not a decode step's pace
    batch, total = len(engine.requests), sum(r.num_tokens for r in engine.requests.values())
    times = [_timed_step(engine) for _ in range(repeats)]
    _drain(engine)
    return {"prefill": 0, "batch": batch, "context": total + batch * (repeats // 2), "seconds": float(np.median(times))}


def _agrees(a: list[dict], b: list[dict], tolerance: float) -> bool:
    """Two passes' samples (the same steps, in order) agree: their median relative difference within tolerance."""
    diffs = [abs(y["seconds"] / x["seconds"] - 1) for x, y in zip(a, b) if x["seconds"] > 0]
    return len(a) == len(b) and (not diffs or float(np.median(diffs)) <= tolerance)


def _measure_wake(engine, n: int, idles, repeats: int) -> list[list[float]]:
    """[idle, extra] for each idle: the median time of a lone n-token prompt after sleeping that long, less the
    median back to back (interleaved with them, so a drift of the machine touches both), made non-decreasing.
    Each prompt is new (no prefix-cache hit): the k-th counts up by one from its own first token."""
    vocab = engine.model_config.vocab_size - 5
    starts = iter(range(10 ** 9))

    def lone(idle: float) -> float:
        k = next(starts)
        time.sleep(idle)
        return _timed_prompt(engine, [5 + (k + j) % vocab for j in range(n)])

    hot, after = [], {idle: [] for idle in idles}
    for _ in range(repeats):
        for idle in idles:
            hot.append(lone(0.0))                       # right after the engine stepped
            after[idle].append(lone(idle))
    base, out, top = float(np.median(hot)), [], 0.0
    for idle in idles:
        top = max(top, float(np.median(after[idle])) - base)
        out.append([float(idle), top])
    return out


def _mixed_sample(engine, batch: int, prefill: int, repeats: int, first_token: int) -> dict:
    """The median step of `batch` requests decoding beside a new prompt of `prefill` tokens, which ends with the
    token its step samples (so each timed step is one such step). The prompts differ from every other prompt of
    the profile: no prefix-cache hit shortens them."""
    from picovllm.sampling_params import SamplingParams
    _start_decoding(engine, [[first_token + i] * 32 for i in range(batch)], repeats)
    context = sum(r.num_tokens for r in engine.requests.values()) + batch * (repeats // 2)
    times, warm = [], int(engine.overlap)     # overlapped, the first call reads a decode-only step
    for i in range(repeats + warm):
        engine.add_request([first_token + batch + i] * prefill, SamplingParams(max_tokens=1, ignore_eos=True))
        seconds = _timed_step(engine)
        if i >= warm:
            times.append(seconds)
    _drain(engine)
    return {"prefill": prefill, "batch": batch, "context": context, "seconds": float(np.median(times))}


def _start_decoding(engine, prompts: list[list[int]], repeats: int) -> None:
    """Add the prompts as requests and step until every prompt is in (and has its first token). Each request asks
    for enough tokens that the first still decodes when the last prompt is in, and through `repeats` timed steps
    after: filling n prompts of L tokens takes about n * L / chunk steps (else a timed batch is smaller than n)."""
    from picovllm.sampling_params import SamplingParams
    n, longest = len(prompts), max(map(len, prompts))
    fill_steps = -(-n * (longest + 1) // engine.config.max_num_batched_tokens) + n
    max_tokens = min(fill_steps + repeats + 2, engine.max_model_len - longest)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()


def _timed_prompt(engine, prompt: list[int]) -> float:
    """Seconds from adding a lone prompt to its first token: one step; overlapped, two calls (launch, then the
    token)."""
    from picovllm.sampling_params import SamplingParams
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    _drain(engine)
    return time.perf_counter() - t0


def _timed_step(engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
