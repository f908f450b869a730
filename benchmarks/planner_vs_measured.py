"""The planner's predictions against measured runs on this machine (CPU, a tiny random model by default).

    python benchmarks/planner_vs_measured.py OUT_DIR [--rates 2 5 10] [--preset tiny-qwen3] [--fleet]
    python benchmarks/planner_vs_measured.py OUT_DIR --preset qwen3-0.6b --dtype bfloat16 --num-kv-blocks 16384 \
        --rates 10 40 80 --input-len 512 --output-len 64 --num-prompts 400        # one GPU, colocated

Builds a random checkpoint with a word tokenizer, measures its step profile (`picovllm plan
--measure-profile`), serves it colocated (and, with --fleet, as 1P1D behind `picovllm router`, tcp),
runs `picovllm bench serve` at each rate, then `picovllm plan --calibrate ... --measured ... --plot`
compares the predictions with the measurements (the lowest rate's runs calibrate the overheads the
step profile does not hold: HTTP, tokenization, the router's hops, the served step's host cost). It also checks,
per rate, that the deployment the planner ranks first by goodput (TTFT and every gap within the SLOs) is the one
that measured the best goodput. Everything lands in OUT_DIR (profile.json, bench_*.json, plan.json,
predicted_vs_measured.png, the servers' logs).

On a 2-core CPU run it as `OMP_NUM_THREADS=1 python benchmarks/planner_vs_measured.py ...`: the tiny model's step
is a fraction of a millisecond, and an engine's second OpenMP thread, sharing the cores with the HTTP side, the
client and (--fleet) the other instances, waits at every barrier: a lone decode served in 1.4 ms where the same
engine alone steps in 0.44-0.64 (one thread: 0.65 served), so the calibration run's step overhead no longer held
at other rates (BENCHMARKS.md, twenty-fourth session).
"""
import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from picovllm.bench.random_checkpoint import make_random_checkpoint, resolve_config, write_word_tokenizer

ENGINE = ["--block-size", "16", "--max-num-batched-tokens", "512", "--max-model-len", "1024"]
CLI = [sys.executable, "-m", "picovllm.entrypoints.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(out: str, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(os.path.join(out, f"{name}.log"), "w")
    proc = subprocess.Popen([*CLI, *args, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{name} did not start: see {log.name}")
        time.sleep(0.3)


def warm(url: str) -> None:
    """One short streamed completion before any measured run: a server's first request pays for lazy set-up (on the
    2-core CPU the first stream took 27 ms against 9.5 after it: anyio's stream modules load at the first streamed
    response), which the first run's TTFT tail (the calibration run's) would otherwise hold."""
    body = {"model": httpx.get(url + "/v1/models").json()["data"][0]["id"], "prompt": [1, 2, 3, 4],
            "max_tokens": 2, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        resp.raise_for_status()
        for _ in resp.iter_lines():
            pass


def bench(url: str, rate: float, path: str, args, seed: int) -> None:
    """One `bench serve` run. Each run of a server gets prompts of its own (seed): with bench serve's one default
    seed, every run after the first sent the first run's prompts again, which the server's prefix cache then held,
    so those runs skipped most of their prefill and were compared with a simulation that computes it (until the
    eighteenth session: BENCHMARKS.md)."""
    # a client process per --rate-per-client requests/s: one Python client streaming thousands of chunks a
    # second delays its own reads, which the server would be blamed for (BENCHMARKS.md, thirteenth session)
    # at least --min-seconds of arrivals: a p99 over 400 requests at 160/s (2.5 s) is the 4th-slowest request, and
    # moved -53% to +67% against the prediction between four runs of one tree (BENCHMARKS.md, twenty-third session)
    num_prompts = max(args.num_prompts, math.ceil(rate * args.min_seconds))
    workers = min(num_prompts, max(1, math.ceil(rate / args.rate_per_client)))
    subprocess.run([*CLI, "bench", "serve", "--base-url", url, "--dataset", "random", "--num-prompts",
                    str(num_prompts), "--request-rate", str(rate), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--num-workers", str(workers), "--seed", str(seed),
                    "--result-json", path],
                   check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 5.0, 10.0])
    p.add_argument("--preset", default="tiny-qwen3")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="each run sends at least rate x this many requests (a high rate's tail over more of them)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--fleet", action="store_true", help="also 1P1D behind the router (tcp)")
    p.add_argument("--ttft-slo-ms", default="10", help="the goodput's SLOs (as bench serve's: every gap meets ITL)")
    p.add_argument("--itl-slo-ms", default="20")
    p.add_argument("--dtype", default="float32", help="the checkpoint's and the engines' dtype")
    p.add_argument("--num-kv-blocks", default="2048")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="the servers' engine loops in processes of their own (serve's default; before the fourteenth "
                        "session's runs, the thread was: --no-engine-process)")
    p.add_argument("--api-server-count", default="1", help="the colocated server's HTTP processes (serve's flag)")
    p.add_argument("--reuse", metavar="DIR", help="take the checkpoint and profile.json of an earlier run's OUT_DIR "
                   "(an A/B of serve options over one profile)")
    p.add_argument("--rate-per-client", type=float, default=20.0,
                   help="bench serve gets a client process per this many requests/s (--num-workers)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    engine = [*ENGINE, "--dtype", args.dtype, "--num-kv-blocks", args.num_kv_blocks]
    if args.reuse:
        model, profile = os.path.join(args.reuse, "model"), os.path.join(args.reuse, "profile.json")
    else:
        model = make_random_checkpoint(os.path.join(args.out, "model"), args.preset, args.dtype, 0)
        write_word_tokenizer(model, resolve_config(args.preset)["vocab_size"])
        profile = os.path.join(args.out, "profile.json")
        subprocess.run([*CLI, "plan", "--measure-profile", "--profile", profile, "--model", model, *engine],
                       check=True)
    measured = []
    proc, url = start(args.out, "colocated", "serve", "--model", model, *engine,
                      *([] if args.engine_process else ["--no-engine-process"]),
                      "--api-server-count", args.api_server_count)
    try:
        warm(url)
        for seed, rate in enumerate(args.rates):
            path = os.path.join(args.out, f"bench_colocated_{rate:g}.json")
            bench(url, rate, path, args, seed)
            measured.append(f"colocated-1:512:{path}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    if args.fleet:
        secret = os.path.join(args.out, "secret")
        with open(secret, "w") as f:
            f.write("planner-benchmark-secret-0123456789\n")
        fleet = ["--kv-transfer", "tcp", "--pd-secret-file", secret, "--model", model, *engine,
                 *([] if args.engine_process else ["--no-engine-process"])]
        procs = []
        try:
            pp, purl = start(args.out, "p", "serve", "--role", "p", *fleet)
            procs.append(pp)
            dp, durl = start(args.out, "d", "serve", "--role", "d", *fleet)
            procs.append(dp)
            rp, rurl = start(args.out, "router", "router", "--prefill", purl, "--decode", durl,
                             "--pd-secret-file", secret)
            procs.append(rp)
            warm(rurl)
            for seed, rate in enumerate(args.rates):
                path = os.path.join(args.out, f"bench_1p1d_{rate:g}.json")
                bench(rurl, rate, path, args, seed)
                measured.append(f"1P1D:512:{path}")
        finally:
            for proc in reversed(procs):
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    low = [m for m in measured if f"_{args.rates[0]:g}.json" in m]     # the lowest rate calibrates the overheads
    try:
        import matplotlib  # noqa: F401 - the plot's; a GPU image may lack it (rerun the plan elsewhere)
        plot = ["--plot", os.path.join(args.out, "predicted_vs_measured.png")]
    except ImportError:
        plot = []
    subprocess.run([*CLI, "plan", "--profile", profile, "--input-len", str(args.input_len), "--output-len",
                    str(args.output_len), "--num-instances", "2", "--chunks", "512", "--calibrate", *low,
                    "--measured", *measured, "--ttft-slo-ms", args.ttft_slo_ms, "--itl-slo-ms", args.itl_slo_ms,
                    *plot, "--result-json", os.path.join(args.out, "plan.json")], check=True)


if __name__ == "__main__":
    main()
