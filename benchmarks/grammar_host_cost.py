"""The host's work a decode step spends on grammar-constrained rows (structured outputs), per step, at batch 64 on the
default model's vocabulary (49,152), with no forward: what an overlapped GPU step must hide behind its forward.

    python benchmarks/grammar_host_cost.py [--batch 64] [--steps 256] [--repeats 5] [--grammar regex|json|mixed]
                                           [--cold-mb N]
    python benchmarks/grammar_host_cost.py --engine [--batch 64] [--tokens 128] [--repeats 5]

Parts (the default): the engine's own calls for constrained rows, on real Requests and SchedulerOutputs, in the order
an overlapped step makes them: GrammarMasks.fill when the step is prepared (every row waits for its token in flight),
GrammarMasks.fill_late once that token is known (the grammars' accept, then the masks' fill), device_masks (what the
sampler asks for; on a GPU it adds one upload, not measured here) and apply_results' grammar lines. The tokens are
drawn at random from what each row's grammar allows (word tokens for the regex). "xgrammar" is the floor: xgrammar's
native batched accept and fill alone (each shown) on matchers advanced by the same tokens, before the engine's calls
in each run; the rest of "total" is picovllm's Python. The engine's masks are checked against the floor's.
--cold-mb N writes N MB between steps, as the rest of an engine's step would, so the caches are not warm.

--engine: the whole engine (LLM, default model, overlapped scheduling) without the forward: the runner's logits are
fixed random ones with word tokens ahead, and the CPU's masked apply (C, host work only on a CPU) is left out, so a
constrained step differs from a plain one by the host work a GPU step would have. Prints the step time of plain and
constrained runs (interleaved), and the constrained run's time in GrammarMasks.fill and fill_late.

Each number is the median over steps of one run; the summary line is the median of the runs' medians.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

REGEX = "[a-z ]{4000}"
# an array without end: a row can always go on (no row ends early)
SCHEMA = {"type": "array", "items": {"type": "object", "required": ["name", "items"], "properties": {
    "name": {"type": "string"}, "items": {"type": "array", "items": {"type": "integer"}}}}}


def word_tokens(tok, vocab: int) -> list[int]:
    """Token ids of 2 or more characters, each a lower-case letter or a space (the regex takes them)."""
    out = []
    for i in range(vocab):
        s = tok.decode([i])
        if len(s) >= 2 and all(c == " " or "a" <= c <= "z" for c in s):
            out.append(i)
    return out


def allowed_tokens(words, vocab: int):
    """The token ids a filled mask row (int32 words) allows, as a tensor."""
    import torch
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten()


def trajectories(compiled: list, eos: int, vocab: int, steps: int, rng: random.Random,
                 words: list[int] | None) -> list[list[int]]:
    """tokens[step][row]: row's grammar takes them in turn (drawn from `words` where given, else from its mask), none
    a stop token, none completing the grammar (a completed row would end early)."""
    import torch
    import xgrammar as xgr
    matchers = [xgr.GrammarMatcher(c) for c in compiled]
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    out = []
    for _ in range(steps):
        row = []
        for m in matchers:
            if words is not None:
                pool = words
            else:
                m.fill_next_token_bitmask(mask)
                pool = allowed_tokens(mask[0], vocab)
            for _ in range(100):
                t = int(pool[rng.randrange(len(pool))])
                if t == eos:
                    continue
                assert m.accept_token(t), t
                if not m.is_completed():
                    break
                m.rollback(1)
            else:
                raise RuntimeError("the grammar keeps ending: the benchmark needs one a row can always go on in")
            row.append(t)
        out.append(row)
    return out


def median_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def parts(batch: int, steps: int, repeats: int, grammar: str, cold_mb: int) -> None:
    import torch
    import xgrammar as xgr
    from picovllm.engine.grammar_masks import GrammarMasks
    from picovllm.engine.request import DECODING, Request
    from picovllm.engine.scheduler import ScheduledChunk, SchedulerOutput
    from picovllm.layers.structured_output import device_masks
    from picovllm.loader.source import open_model_source
    from picovllm.sampling_params import SamplingParams, StructuredOutputsParams

    src = open_model_source(None, weights_needed=False)
    tok, vocab = src.load_tokenizer(), src.config.vocab_size
    eos = tok.eos_token_id
    cpu = torch.device("cpu")
    regex, schema = StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(json=SCHEMA)
    kinds = {"regex": [regex], "json": [schema], "mixed": [regex, schema]}[grammar]
    row_params = [SamplingParams(max_tokens=steps + 1, structured_outputs=kinds[i % len(kinds)]) for i in range(batch)]
    words = word_tokens(tok, vocab) if grammar == "regex" else None
    thrash = torch.zeros(max(cold_mb, 1) << 18, dtype=torch.int32)
    print(f"vocab {vocab}, batch {batch}, {steps} steps, grammar {grammar}, cold {cold_mb} MB")
    gm = GrammarMasks(tok, vocab, None)
    compiled = [gm._compiler([eos]).compile(p.structured_outputs) for p in row_params]
    batch_fill = xgr.BatchGrammarMatcher(1)._handle.batch_fill_next_token_bitmask
    batch_accept = type(xgr.BatchGrammarMatcher(1)._handle).batch_accept_token
    summary: dict[str, list[float]] = {}
    for rep in range(repeats):
        tokens = trajectories(compiled, eos, vocab, steps, random.Random(rep), words)
        reqs = []
        for i, p in enumerate(row_params):
            req = Request(f"r{i}", [1, 2, 3], p)
            req.grammar = gm.new_state(p, req.prompt_token_ids, [eos])
            req.status, req.num_pending_tokens, req.pending_row = DECODING, 1, i   # its first token in flight
            req.num_computed_tokens = req.num_tokens - 1
            reqs.append(req)
        t = {k: [] for k in ("fill", "fill_late", "device_masks", "apply_results", "total", "xgrammar", "(its accept)",
                             "(its fill)")}
        # the floor first, on matchers of its own: xgrammar's native calls alone (its masks kept every 16th step)
        handles, rows = [xgr.GrammarMatcher(c)._handle for c in compiled], list(range(batch))
        floor_words, kept = torch.zeros(batch, (vocab + 31) // 32, dtype=torch.int32), {}
        for s in range(steps):
            if cold_mb:
                thrash.add_(1)
            t0 = time.perf_counter()
            batch_accept(handles, tokens[s], False)
            t1 = time.perf_counter()
            batch_fill(handles, floor_words, rows, False)
            t2 = time.perf_counter()
            t["xgrammar"].append(t2 - t0)
            t["(its accept)"].append(t1 - t0)
            t["(its fill)"].append(t2 - t1)
            if s % 16 == 0:
                kept[s] = floor_words.clone()
        prev = SchedulerOutput([ScheduledChunk(r, 1) for r in reqs])
        for s in range(steps):
            sched = SchedulerOutput([ScheduledChunk(r, 1) for r in reqs])
            step = SimpleNamespace(sampling=[None] * batch, token_bitmasks=None)
            done = SimpleNamespace(token_ids=tokens[s])
            if cold_mb:
                thrash.add_(1)
            t0 = time.perf_counter()
            late = gm.fill(step, sched, cpu)
            t1 = time.perf_counter()
            gm.fill_late(step, late, prev, done)
            t2 = time.perf_counter()
            device_masks(step.token_bitmasks, cpu)
            t3 = time.perf_counter()
            for req, token in zip(reqs, tokens[s]):
                req.output_token_ids.append(token)     # the engine's, constrained or not: not timed
            t4 = time.perf_counter()
            for req in reqs:       # the grammar lines of apply_results (LLMEngine.append_token)
                grammar = req.grammar
                if grammar is not None and not req.is_finished:
                    if grammar.num_accepted < len(req.output_token_ids):
                        raise AssertionError("fill_late left a token untaken")
                    elif grammar.is_terminated:
                        raise AssertionError("a row's grammar ended")
            t5 = time.perf_counter()
            for req in reqs:
                req.num_computed_tokens += 1
            assert sorted(step.token_bitmasks.filled) == rows
            if s in kept:
                assert torch.equal(kept[s], step.token_bitmasks.words), s
            for k, v in (("fill", t1 - t0), ("fill_late", t2 - t1), ("device_masks", t3 - t2),
                         ("apply_results", t5 - t4), ("total", t3 - t0 + t5 - t4)):
                t[k].append(v)
            prev = sched
        meds = {k: median_us(v) for k, v in t.items()}
        print(f"run {rep}: " + ", ".join(f"{k} {v:.1f}" for k, v in meds.items()) +
              f" us a step; picovllm's Python {meds['total'] - meds['xgrammar']:.1f} us")
        for k, v in meds.items():
            summary.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in summary.items()}
    python = med["total"] - med["xgrammar"]
    print(f"median of {repeats} runs, us a step of {batch} constrained rows: " +
          ", ".join(f"{k} {v:.1f}" for k, v in med.items()) +
          f"; picovllm's Python {python:.1f} ({python / batch:.2f} a row)")


def timed(obj, name: str, totals: dict[str, float]) -> None:
    """obj.name wrapped: its wall time added up in totals[name]."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - t
    setattr(obj, name, wrapper)


def engine(batch: int, tokens: int, repeats: int) -> None:
    import re

    import torch
    from picovllm import LLM, SamplingParams, StructuredOutputsParams
    from picovllm.engine import sampling

    sampling.apply_token_bitmasks = lambda logits, masks: logits    # the CPU's masked apply: not a GPU host's work
    llm = LLM(async_scheduling=True)
    torch.set_num_threads(1)     # the greedy argmax: two threads beside other work took 4-5x one's time here
    eng, runner = llm.engine, llm.engine.runner
    vocab = runner.model_config.vocab_size
    words = word_tokens(llm.get_tokenizer(), vocab)
    gen = torch.Generator().manual_seed(0)
    table = []
    for _ in range(8):     # a few fixed logits, taken in turn: each row's greedy token is a word token, not always one
        logits = torch.randn(batch, vocab, generator=gen)
        logits[:, words] += 10
        table.append(logits.to(runner.device))
    calls = [0]

    def compute_logits(step, prev_tokens=None):
        calls[0] += 1
        return table[calls[0] % len(table)][:step.num_logit_rows]
    runner.compute_logits = compute_logits
    totals: dict[str, float] = {}
    timed(eng.grammar_masks, "fill", totals)
    timed(eng.grammar_masks, "fill_late", totals)
    prompts = [f"Write item {i}:" for i in range(batch)]
    so = StructuredOutputsParams(regex=REGEX)
    runs = [("warm-up", {}), ("warm-up", {"structured_outputs": so})] + \
        [("plain", {}), ("regex", {"structured_outputs": so})] * repeats
    steps: dict[str, list[float]] = {}
    for name, extra in runs:
        totals.clear()
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **extra)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = (time.perf_counter() - t) / tokens
        for o in outs:
            assert len(o.outputs[0].token_ids) == tokens, o.outputs[0].finish_reason
            assert not extra or re.fullmatch("[a-z ]*", o.outputs[0].text), o.outputs[0].text
        masks = ", ".join(f"{k} {v / tokens * 1e6:.1f} us" for k, v in totals.items())
        print(f"{name:7s}: {dt * 1e3:6.3f} ms a step" + (f" ({masks} a step)" if extra else ""))
        steps.setdefault(name, []).append(dt)
        if name == "regex":
            steps.setdefault("masks", []).append(sum(totals.values()) / tokens)
    plain, regex = statistics.median(steps["plain"]), statistics.median(steps["regex"])
    print(f"median of {repeats}: plain {plain * 1e3:.3f} ms, constrained {regex * 1e3:.3f} ms a step: "
          f"+{(regex - plain) * 1e6:.1f} us ({(regex - plain) / batch * 1e6:.2f} a row); GrammarMasks.fill + "
          f"fill_late {statistics.median(steps['masks']) * 1e6:.1f} us a step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=256, help="parts: steps a run")
    ap.add_argument("--tokens", type=int, default=128, help="--engine: tokens a request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--grammar", choices=("regex", "json", "mixed"), default="regex")
    ap.add_argument("--cold-mb", type=int, default=0, help="parts: MB written between steps (caches not warm)")
    ap.add_argument("--engine", action="store_true", help="the whole engine without a forward, plain vs constrained")
    args = ap.parse_args()
    if args.engine:
        engine(args.batch, args.tokens, args.repeats)
    else:
        parts(args.batch, args.steps, args.repeats, args.grammar, args.cold_mb)


if __name__ == "__main__":
    main()
