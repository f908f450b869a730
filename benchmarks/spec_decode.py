"""Speculative decoding by n-gram lookup (speculative_config method "ngram", engine/spec_decode.py): output tok/s and
per-token latency with and without it, on workloads where prompt lookup pays and where it does not, against HF
transformers' own prompt-lookup decoding (generate(prompt_lookup_num_tokens=k)) on the same weights.

    python benchmarks/spec_decode.py [--batch 1|8] [--num-speculative-tokens 4] [--prompt-lookup-max 4]
                                     [--prompt-lookup-min 1] [--max-tokens 128] [--num-prompts 8] [--repeat 2]
                                     [--workloads copy,edit,free] [--device cpu|cuda] [--model PATH |
                                     --random-model PRESET] [--peer hf|none] [--peer-prompts N] [--peer-repeat 1]
                                     [--max-num-seqs N] [--disable-by-batch-size N] [--quantization Q]
                                     [--enforce-eager] [--no-overlap]

Workloads (8 chat prompts each, through the model's chat template, greedy, max_tokens fixed, EOS honoured: a request
may end early, and the generated tokens are what is counted):
  copy  "copy this paragraph word for word" (prompts of 127-159 tokens on the default model): the output is in the
        prompt
  edit  "rewrite this code with one small change" (84-142 tokens): the output mostly repeats the prompt
  free  open-ended questions (39-47 tokens): little to look up, so mostly drafts that are rejected (or none): the
        cost (a small model repeats itself within 128 tokens, though, and then drafts from its own output pay)

At --batch B the prompts go to LLM.generate B at a time (batch 1: one request at a time). Each workload runs once
untimed (warm-up) per engine, then --repeat timed runs, plain and speculative interleaved batch by batch (the host's
load drifts; on a shared CPU, a burst of other work then falls on both alike).
tok/s = generated tokens / wall time of LLM.generate (prefill included; prefix caching off so every run prefills);
ms/token = the mean over requests of (last token's time - first token's time) / (tokens - 1): decode only.
acceptance = accepted_tokens / draft_tokens; tokens/step = (accepted_tokens + drafts) / drafts: tokens a request
gets from a step that speculated (llm.engine.stats, the timed runs' differences). Greedy, so the speculative
outputs must equal the plain ones token for token: any difference prints a MISMATCH line.

The peer (--peer hf, batch 1 only: HF's prompt lookup takes one sequence): AutoModelForCausalLM from the same GGUF
(dequantized to float32), generate() greedy on the very token ids, the same max_new_tokens and EOS ids, plain and
with prompt_lookup_num_tokens=k, max_matching_ngram_size=--prompt-lookup-max. HF's lookup differs from vLLM's: it
tries n-grams from max_matching_ngram_size down to 1 (no minimum) and takes the earliest match in the sequence,
not the latest. Its acceptance counts come from PromptLookupCandidateGenerator.update_candidate_strategy.
The peer's first prompt runs once untimed first; then --peer-repeat runs of the first --peer-prompts prompts
(interleaved prompt by prompt), after all of ours (its load and memory kept out of our timings). On the CPU our
engine runs the GGUF's own quantized form (quantization "auto") while HF runs the dequantized float32 weights, so
the two engines' texts may differ ("picovllm = HF": prompts whose plain outputs agree, for information), and with
them what there is to look up.

Also checked (the speculative engine not overlapped: its default): the engine's counters equal the lookup rule
replayed on the plain outputs (expected_stats); a STATS MISMATCH line if not. --overlap: the speculative engine with
overlapped scheduling (drafts from a guess of the token in flight, a step sat out after each speculative one).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # as the picovllm command sets it (benchmarks/README.md)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PARAGRAPHS = [
    "The lighthouse on the northern cape was built in 1874 from granite quarried a few miles inland. For more than "
    "a century its keepers lived in the small stone cottage at its foot, trimming the wick every evening, winding "
    "the clockwork that turned the lens, and writing the weather into a leather logbook three times a day. When the "
    "light was automated in 1981, the last keeper, a quiet man named Elias Brandt, left the logbooks to the village "
    "library, where they can still be read on request.",
    "Photosynthesis takes place mostly in the leaves of green plants. Inside each leaf cell, small bodies called "
    "chloroplasts capture light with the pigment chlorophyll and use its energy to split water molecules. The oxygen "
    "from the water is released into the air, while the hydrogen is combined with carbon dioxide to build sugars. "
    "These sugars feed the plant, and through the plant they feed almost every other living thing on land.",
    "To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt and seven grams of dried "
    "yeast. Add three hundred and fifty millilitres of warm water and stir until a rough dough forms. Knead it on a "
    "floured table for ten minutes, until it is smooth and springs back when pressed. Leave it covered in a warm "
    "place for an hour, shape it into a loaf, let it rise again for forty minutes, and bake it at two hundred and "
    "twenty degrees for about thirty minutes.",
    "The committee met on Tuesday to review the proposal for the new cycle path along the river. Members agreed that "
    "the path should be at least three metres wide, that it should be lit between the old bridge and the railway "
    "station, and that the work should not begin before the end of the nesting season. The treasurer reported that "
    "the grant from the regional council covers about two thirds of the expected cost, and the committee asked the "
    "secretary to write to local businesses about the rest.",
    "Rivers shape the land they cross. In the mountains, fast water carries stones that grind the riverbed deeper "
    "and cut narrow valleys with steep sides. Lower down, where the slope is gentle, the river slows, drops the sand "
    "and mud it was carrying, and begins to wander across a wide plain in loops called meanders. Near the sea it may "
    "split into many channels, building a delta of fertile silt that farmers have valued for thousands of years.",
    "Dear Ms. Alvarez, thank you for your letter of the twelfth of March. I am glad to confirm that your order of "
    "forty chairs and ten tables has been shipped today and should arrive at your school within five working days. "
    "The driver will call you one hour before delivery. If any piece is damaged in transport, please keep the "
    "packaging and send us a photograph, and we will replace it at no cost. With kind regards, Thomas Weller, "
    "Customer Service.",
    "A good password is long, unpredictable and used for one account only. Short passwords can be guessed by a "
    "computer in minutes, and a password used on several websites is only as safe as the weakest of them. Many "
    "people now use a password manager, a program that creates a different random password for every site and "
    "remembers them all behind a single master password. Turning on two-step verification adds a second lock that a "
    "stolen password alone cannot open.",
    "The orchestra tuned for several minutes before the conductor walked on stage. When the hall was completely "
    "silent, she raised her baton, and the violins began the slow opening theme, so softly that the audience leaned "
    "forward to hear it. Gradually the cellos and then the horns joined in, the music grew louder and faster, and by "
    "the end of the first movement many listeners were sitting perfectly still, afraid that any sound would break "
    "the spell.",
]

CODE = [
    ("def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
     "Rename the function `average` to `mean`. Change nothing else."),
    ("def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
     "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
     "Rename the variable `counts` to `frequencies`. Change nothing else."),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
     "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
     "    def is_empty(self):\n        return len(self.items) == 0\n",
     "Add a method `peek` that returns the last item without removing it. Keep the rest as it is."),
    ("def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
     "        elif i % 3 == 0:\n            print('Fizz')\n        elif i % 5 == 0:\n            print('Buzz')\n"
     "        else:\n            print(i)\n",
     "Change the function so that it prints 'Bang' instead of 'Buzz'. Change nothing else."),
    ("function greet(name) {\n  const message = 'Hello, ' + name + '!';\n  console.log(message);\n"
     "  return message;\n}\n",
     "Rewrite this function using a template literal for the message. Keep the rest as it is."),
    ("def read_config(path):\n    with open(path) as f:\n        lines = f.readlines()\n    config = {}\n"
     "    for line in lines:\n        key, value = line.strip().split('=')\n        config[key] = value\n"
     "    return config\n",
     "Make it skip empty lines. Keep the rest of the code the same."),
    ("int max_of(int *a, int n) {\n    int best = a[0];\n    for (int i = 1; i < n; i++) {\n"
     "        if (a[i] > best) {\n            best = a[i];\n        }\n    }\n    return best;\n}\n",
     "Rename the function to `largest`. Change nothing else."),
    ("def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, n):\n        if n % d == 0:\n"
     "            return False\n    return True\n",
     "Change the loop to stop at the square root of n, using `int(n ** 0.5) + 1`. Keep the rest the same."),
]

QUESTIONS = [
    "Why do people enjoy travelling to places they have never seen? Give a few reasons.",
    "Write a short story about a robot who learns to paint.",
    "What are some good habits for staying healthy while working from home?",
    "Explain to a ten-year-old how the moon causes tides.",
    "Describe your ideal weekend in a few sentences.",
    "What should someone consider before adopting a dog?",
    "Give me three ideas for a birthday party for a friend who likes science.",
    "Why is the sky blue? Answer in a short paragraph.",
]


def conversations(workload: str) -> list[list[dict]]:
    if workload == "copy":
        return [[{"role": "user", "content": "Copy the following paragraph exactly, word for word, and write nothing "
                                              "else:\n\n" + p}] for p in PARAGRAPHS]
    if workload == "edit":
        return [[{"role": "user", "content": f"{task} Output the whole code.\n\n```\n{code}```"}]
                for code, task in CODE]
    if workload == "free":
        return [[{"role": "user", "content": q}] for q in QUESTIONS]
    raise ValueError(workload)


def stats_delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in ("drafts", "draft_tokens", "accepted_tokens")}


class Totals:
    """One (engine, mode, workload)'s timed runs added up."""

    def __init__(self) -> None:
        self.tokens = 0
        self.seconds = 0.0
        self.runs: list[float] = []
        self.itl: list[float] = []          # per request, ms a token after the first
        self.spec = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self.outputs: list[list[int]] | None = None
        self.mismatches = 0                 # prompt-runs whose output differs from the plain run's (speculative)

    def add(self, outs: list[list[int]], seconds: float, itl: list[float], spec: dict) -> None:
        n = sum(map(len, outs))
        self.tokens += n
        self.seconds += seconds
        self.runs.append(n / seconds)
        self.itl += itl
        for k in self.spec:
            self.spec[k] += spec[k]
        self.outputs = outs

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def ms_per_token(self) -> float:
        return sum(self.itl) / len(self.itl) if self.itl else float("nan")

    @property
    def acceptance(self) -> float | None:
        return self.spec["accepted_tokens"] / self.spec["draft_tokens"] if self.spec["draft_tokens"] else None

    @property
    def tokens_per_step(self) -> float | None:
        s = self.spec
        return (s["accepted_tokens"] + s["drafts"]) / s["drafts"] if s["drafts"] else None


def run_ours(llm, prompts: list[list[int]], sp) -> tuple[list[list[int]], float, list[float], dict]:
    """One LLM.generate of prompts: (token ids per prompt, seconds, ms/token per request, the speculative counters'
    change)."""
    before = llm.engine.stats.as_dict()
    t = time.perf_counter()
    res = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t
    outs, itl = [], []
    for o in res:
        outs.append(list(o.outputs[0].token_ids))
        tt = o.metrics.token_times
        if len(tt) > 1:
            itl.append((tt[-1] - tt[0]) / (len(tt) - 1) * 1e3)
    return outs, seconds, itl, stats_delta(llm.engine.stats.as_dict(), before)


def timed_runs(label: str, modes: dict, groups: list[list[list[int]]], repeat: int, tok) -> dict[str, "Totals"]:
    """repeat runs of every group (a batch of prompts) through every mode (name -> fn(group) -> run_ours' tuple),
    the modes interleaved group by group, so that a change in the host's load falls on all of them alike. The
    first mode is the plain one: the others' outputs are checked against it, run by run."""
    totals = {name: Totals() for name in modes}
    base = next(iter(modes))
    for r in range(repeat):
        acc = {name: ([], 0.0, [], {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}) for name in modes}
        for group in groups:
            for name, fn in modes.items():
                outs, seconds, itl, spec = fn(group)
                o, s, i, c = acc[name]
                acc[name] = (o + outs, s + seconds, i + itl, {k: c[k] + spec[k] for k in c})
        for name, res in acc.items():
            totals[name].add(*res)
            n = sum(map(len, res[0]))
            print(f"   {label} run {r} {name:6s}: {n} tokens in {res[1]:.2f} s = {n / res[1]:.1f} tok/s; {res[3]}",
                  flush=True)
            if name != base:
                totals[name].mismatches += check_same(f"{label} {name} run {r}", acc[base][0], res[0], tok)
    return totals


class HFPeer:
    """HF transformers generate() at batch 1 on the same GGUF, plain or with prompt lookup."""

    def __init__(self, model_path: str | None, device: str, eos_ids: list[int], args) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
        from transformers.generation import candidate_generator as cg
        if model_path is None:
            from picovllm.loader.default_model import default_model_path
            model_path = default_model_path()
        if not str(model_path).endswith(".gguf"):
            raise SystemExit("--peer hf: loads a GGUF file (the default model or --model X.gguf); use --peer none")
        folder, name = os.path.split(str(model_path))
        t = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).to(device).eval()
        print(f"HF transformers {transformers.__version__}: loaded {name} (float32, {device}) in "
              f"{time.perf_counter() - t:.1f} s; torch threads {torch.get_num_threads()}", flush=True)
        self.torch, self.device, self.args = torch, device, args
        self.eos = list(eos_ids)
        self.counts = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        real = cg.PromptLookupCandidateGenerator.update_candidate_strategy
        counts = self.counts

        def update(gen, input_ids, scores, num_matches):      # scores: (1, candidates + 1, vocab)
            drafted = scores.shape[1] - 1
            if drafted > 0:
                counts["drafts"] += 1
                counts["draft_tokens"] += drafted
                counts["accepted_tokens"] += int(num_matches)
            return real(gen, input_ids, scores, num_matches)
        cg.PromptLookupCandidateGenerator.update_candidate_strategy = update

    def generate(self, prompts: list[list[int]], lookup: bool) -> tuple[list[list[int]], float, list[float], dict]:
        from transformers import GenerationConfig
        from transformers.generation.streamers import BaseStreamer
        torch, a = self.torch, self.args
        gc = GenerationConfig(max_new_tokens=a.max_tokens, do_sample=False, eos_token_id=self.eos,
                              pad_token_id=self.eos[0], temperature=None, top_p=None, top_k=None)
        if lookup:
            gc.prompt_lookup_num_tokens = a.num_speculative_tokens
            gc.max_matching_ngram_size = a.prompt_lookup_max

        class Clock(BaseStreamer):          # the time of each put after the prompt's (as many tokens as it holds)
            def __init__(self) -> None:
                self.times: list[tuple[float, int]] = []
                self.prompt_seen = False

            def put(self, value) -> None:
                if not self.prompt_seen:
                    self.prompt_seen = True
                    return
                self.times.append((time.perf_counter(), value.numel()))

            def end(self) -> None:
                pass

        before = dict(self.counts)
        outs, itl, seconds = [], [], 0.0
        for p in prompts:
            ids = torch.tensor([p], device=self.device)
            clock = Clock()
            t = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc,
                                          streamer=clock)
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds += time.perf_counter() - t
            outs.append(out[0, len(p):].tolist())    # an EOS that ended it included, as in ours
            n = sum(k for _, k in clock.times)
            if n > 1:
                first_t, first_n = clock.times[0]
                itl.append((clock.times[-1][0] - first_t) / (n - first_n) * 1e3 if n > first_n else float("nan"))
        return outs, seconds, itl, stats_delta(self.counts, before)


def expected_stats(prompt: list[int], out: list[int], args, eos: set[int]) -> dict:
    """The speculative counters the engine's rule gives for a request whose (greedy) output is out: from the first
    token (the prefill's), each step drafts ngram_drafts of the tokens so far (at most k, and no more than
    max_tokens - outputs - 1) and keeps the drafts while each equals the token sampled before it and none has
    finished the request. Measured counters that differ mean the engine drafted or kept something else."""
    import numpy as np
    from picovllm.engine.spec_decode import ngram_drafts
    res = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    seq = np.array(prompt + out, dtype=np.int64)
    p = 1
    while p < len(out):
        k = min(args.num_speculative_tokens, args.max_tokens - p - 1)
        drafts = ngram_drafts(seq[:len(prompt) + p], k, args.prompt_lookup_min, args.prompt_lookup_max) if k > 0 else []
        kept = 0
        if drafts:
            for j, d in enumerate(drafts):
                if out[p + j] in eos or out[p + j] != d or p + j + 1 >= len(out):
                    break
                kept += 1
            res["drafts"] += 1
            res["draft_tokens"] += len(drafts)
            res["accepted_tokens"] += kept
        p += 1 + kept
    return res


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else -1


def check_same(label: str, plain: list[list[int]], spec: list[list[int]], tok) -> int:
    """Prompts whose speculative output differs from the plain one; a MISMATCH line for each."""
    bad = 0
    for i, (a, b) in enumerate(zip(plain, spec)):
        j = first_difference(a, b)
        if j >= 0:
            bad += 1
            ctx = a[max(0, j - 8):j]
            print(f"MISMATCH {label} prompt {i}: plain {len(a)} tokens, speculative {len(b)}, first difference at "
                  f"output token {j}: plain {a[j:j + 4]} vs speculative {b[j:j + 4]} after {ctx}"
                  + (f" ({tok.decode(ctx)!r} -> {tok.decode(a[j:j + 4])!r} | {tok.decode(b[j:j + 4])!r})"
                     if tok is not None else ""), flush=True)
    return bad


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1, help="requests per LLM.generate call (1: one at a time)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per workload (at most 8)")
    ap.add_argument("--workloads", default="copy,edit,free")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per engine and workload, after a warm-up")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--random-model", metavar="PRESET", default=None,
                    help="random weights of a preset's shape (picovllm/bench/random_checkpoint.py) with the default "
                         "model's tokenizer; no HF peer")
    ap.add_argument("--quantization", default=None, help="EngineConfig.quantization (default: the engine's)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="EngineConfig.max_num_seqs (default: the engine's); it bounds decode rows, drafts included")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="speculative_config's disable_by_batch_size (default: none)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="plain runs without overlapped scheduling (the speculative engine's default)")
    ap.add_argument("--overlap", action="store_true", help="the speculative engine with overlapped scheduling")
    ap.add_argument("--peer", choices=["hf", "none"], default="hf")
    ap.add_argument("--peer-prompts", type=int, default=None, help="prompts per workload for the peer (default: all)")
    ap.add_argument("--peer-repeat", type=int, default=1)
    args = ap.parse_args()

    load0 = os.getloadavg()
    import torch
    from picovllm import LLM, SamplingParams
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model
    if args.random_model:
        from structured_output import random_model_with_tokenizer
        model = random_model_with_tokenizer(args.random_model)
    common = dict(device=device, enable_prefix_caching=False, enforce_eager=args.enforce_eager)
    if args.max_num_seqs:       # drafts are decode rows, within max_num_seqs: batch 8 with 8 leaves no room for any
        common["max_num_seqs"] = args.max_num_seqs
    if args.quantization:
        common["quantization"] = args.quantization
    if device.startswith("cuda"):
        common["num_kv_blocks"] = 4096      # two engines on one GPU (a memory fraction is of the process's total)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    if args.disable_by_batch_size:
        spec_cfg["disable_by_batch_size"] = args.disable_by_batch_size
    t = time.perf_counter()
    if args.no_overlap:
        common["async_scheduling"] = False
    plain = LLM(model, **common)
    spec = LLM(model, **{**common, "async_scheduling": True} if args.overlap else common, speculative_config=spec_cfg)
    cfg = plain.config
    print(f"picovllm: model {model or 'the default'} ({plain.engine.model_config.architecture}), device {device}, "
          f"dtype {cfg.dtype}, quantization {cfg.quantization}, max_num_seqs {cfg.max_num_seqs}, "
          f"max_num_batched_tokens {cfg.max_num_batched_tokens}, plain async_scheduling {cfg.async_scheduling}, "
          f"speculative {spec_cfg}; two engines loaded in {time.perf_counter() - t:.1f} s; torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}", flush=True)
    try:
        import subprocess
        here = os.path.dirname(os.path.abspath(__file__))
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", "../picovllm"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        print(f"commit {head}{' (picovllm/ modified)' if dirty else ''}")
    except (OSError, subprocess.SubprocessError):
        pass
    tok = plain.get_tokenizer()
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    rows, mismatches, problems = [], 0, []     # mismatches: added up as the table is printed
    workloads = args.workloads.split(",")
    prompts, ours = {}, {}
    for wl in workloads:
        prompts[wl] = [plain.apply_chat_template(c) for c in conversations(wl)[:args.num_prompts]]
        lens = sorted(map(len, prompts[wl]))
        print(f"== {wl}: {len(prompts[wl])} prompts of {lens[0]}-{lens[-1]} tokens, max_tokens {args.max_tokens}, "
              f"batch {args.batch}", flush=True)
        engines = {"plain": plain, "ngram": spec}
        groups = [prompts[wl][i:i + args.batch] for i in range(0, len(prompts[wl]), args.batch)]
        for name, llm in engines.items():       # warm-up
            t = time.perf_counter()
            for group in groups:
                run_ours(llm, group, sp)
            print(f"   warm-up {name}: {time.perf_counter() - t:.1f} s", flush=True)
        modes = {name: (lambda g, llm=llm: run_ours(llm, g, sp)) for name, llm in engines.items()}
        totals = ours[wl] = timed_runs(f"{wl} batch {args.batch}", modes, groups, args.repeat, tok)
        expected = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        for prompt, out in zip(prompts[wl], totals["plain"].outputs):
            for k, v in expected_stats(prompt, out, args, set(plain.engine.eos_token_ids)).items():
                expected[k] += v * args.repeat
        # overlapped, drafts come through guesses; disable_by_batch_size's steps are not replayed
        if expected != totals["ngram"].spec and not spec.engine.overlap and not args.disable_by_batch_size:
            print(f"STATS MISMATCH {wl}: the engine's counters {totals['ngram'].spec}, the lookup rule on the plain "
                  f"outputs gives {expected}", flush=True)
            problems.append(f"STATS MISMATCH {wl}")
        else:
            print(f"   counters = the lookup rule replayed on the plain outputs: {expected}", flush=True)
        for name, tt in totals.items():
            rows.append(dict(workload=wl, engine="picovllm", mode=name, totals=tt, base=totals["plain"]))

    peer = None         # loaded after our runs, so that its load is not in them
    if args.peer == "hf":
        if args.batch != 1:
            print(f"peer: skipped at --batch {args.batch} (HF's prompt lookup decodes one sequence)")
        elif args.random_model:
            print("peer: skipped with --random-model (no GGUF to load)")
        else:
            peer = HFPeer(model, device, sorted(plain.engine.eos_token_ids), args)
    for wl in workloads if peer is not None else []:
        pp = prompts[wl][:args.peer_prompts or len(prompts[wl])]
        print(f"== HF {wl}: {len(pp)} prompts", flush=True)
        t = time.perf_counter()
        peer.generate(pp[:1], lookup=False)
        peer.generate(pp[:1], lookup=True)
        print(f"   HF warm-up (first prompt, both modes): {time.perf_counter() - t:.1f} s", flush=True)
        modes = {name: (lambda g, lookup=name == "lookup": peer.generate(g, lookup)) for name in ("plain", "lookup")}
        hf = timed_runs(f"HF {wl}", modes, [[p] for p in pp], args.peer_repeat, tok)
        same = sum(a == b for a, b in zip(ours[wl]["plain"].outputs, hf["plain"].outputs))
        print(f"   plain outputs, picovllm = HF: {same} of {len(pp)} prompts (for information: "
              f"{cfg.quantization!r} weights against HF's float32)", flush=True)
        at = max(i for i, row in enumerate(rows) if row["workload"] == wl) + 1
        rows[at:at] = [dict(workload=wl, engine=f"HF {peer_version()}", mode=name, totals=tt, base=hf["plain"])
                       for name, tt in hf.items()]

    print(f"load average at the end: {os.getloadavg()} (at the start: {load0}; on a small CPU, other work skews "
          "the numbers)")
    print()
    print(f"### batch {args.batch}, k={args.num_speculative_tokens}, lookup n in [{args.prompt_lookup_min}, "
          f"{args.prompt_lookup_max}], max_tokens {args.max_tokens}, greedy, {device}")
    print()
    print("| workload | engine | mode | prompts | runs | gen tokens/run | tok/s (runs) | ms/token | x plain "
          "| acceptance | tokens/step | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        tt, base = row["totals"], row["base"]
        n_runs = len(tt.runs)
        spec_mode = row["mode"] != "plain"
        ident = "-"
        if spec_mode:
            mismatches += tt.mismatches
            ident = "yes" if not tt.mismatches else f"**NO** ({tt.mismatches} prompt-runs)"
        print(f"| {row['workload']} | {row['engine']} | {row['mode']} | {len(tt.outputs)} | {n_runs} "
              f"| {tt.tokens // n_runs} | {tt.tok_s:.1f} ({', '.join(f'{x:.1f}' for x in tt.runs)}) "
              f"| {tt.ms_per_token:.2f} | {tt.tok_s / base.tok_s:.2f} | {fmt(tt.acceptance, '.3f')} "
              f"| {fmt(tt.tokens_per_step, '.2f')} | {ident} |")
    print()
    print("MISMATCH: speculative outputs differ from plain ones on "
          f"{mismatches} prompt-runs" if mismatches else "speculative outputs identical to plain ones everywhere")
    for line in problems:
        print(line)


def peer_version() -> str:
    import transformers
    return transformers.__version__


if __name__ == "__main__":
    main()
