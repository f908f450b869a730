"""Prefill/decode disaggregation on one GPU: KV transfer throughput and the latency a handover adds.

    python benchmarks/pd_transfer.py                                   # H200: both backends, 1k/4k/16k
    python benchmarks/pd_transfer.py --decode-device cuda:1            # two GPUs (torch_dist uses NCCL)
    python benchmarks/pd_transfer.py --device cpu --lengths 64,256 --model tiny   # smoke run on a CPU

Part 1, transfer layer only (two processes, P and D, each with a KV cache of the model's layout):
for each backend and prompt length, D times Accept -> blocks written (the handover's data path),
median of --repeats. In the same D process, two device-copy references: copy_blocks between two
local caches (the ceiling for cuda_ipc) and a plain contiguous copy of the same bytes.
Part 2, engines: one prompt of each length through the colocated engine and through P+D (each
backend); TTFT, and the first inter-token gap, which on P+D holds the handover. The handover
cost is that gap minus the colocated engine's first gap.

The model defaults to a random-weight checkpoint of Qwen3-0.6B's shape (28 layers, 8 KV heads of
128, bf16: 112 KiB of KV per token), written to a temporary folder. GB/s counts bytes moved once.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time

import torch

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)
TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)


def random_checkpoint(shape: dict, folder: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def model_shape(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    return dict(layers=cfg["num_hidden_layers"], kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


# -- part 1: the transfer layer ----------------------------------------------------------------------
def _transfer_side(role, device, shape, dtype_name, num_blocks, block_size, backend, lengths, repeats, rendezvous,
                   results, async_transfer=True):
    try:
        results.put((role, _transfer_bench(role, device, shape, dtype_name, num_blocks, block_size, backend,
                                           async_transfer, lengths, repeats, rendezvous)))
    except BaseException as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        results.put((role, f"{type(e).__name__}: {e}"))


def _src_ids(tag: int, n: int, num_blocks: int) -> list[int]:
    return random.Random(tag).sample(range(num_blocks), n)


def _transfer_bench(role, device, shape, dtype_name, num_blocks, block_size, backend, async_transfer, lengths, repeats,
                    rendezvous):
    from picovllm.disagg.channel import Channel, Listener
    from picovllm.disagg.link import PeerLink
    from picovllm.disagg.messages import Accept, Bye, KVLayout
    from picovllm.disagg.transfer import TransferConfig, TransferSpec
    from picovllm.disagg.transfer.block_copy import copy_blocks

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dtype = getattr(torch, dtype_name)
    cache = torch.randn(shape["layers"], 2, num_blocks, block_size, shape["kv_heads"], shape["head_dim"],
                        device=device).to(dtype)
    layout = KVLayout(cache.shape[0], cache.shape[4], cache.shape[5], block_size, num_blocks, dtype_name,
                      cache.shape[4])
    cfg = TransferConfig(backend=backend, async_transfer=async_transfer, timeout_s=120, lease_s=120, connect_timeout_s=120)
    if role == "p":
        listener = Listener()
        rendezvous.put(listener.address)
        ch = listener.accept(120)
    else:
        ch = Channel.connect(rendezvous.get(timeout=120))
    link = PeerLink.open(role, ch, cache, layout, cfg, session=0)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    if role == "p":                                   # serve Accepts until Bye
        while link.alive:
            for msg in link.receive():
                if isinstance(msg, Accept):
                    src = _src_ids(msg.tag, len(msg.dst_block_ids), link.peer.layout.num_blocks)
                    link.transfer.start_send(TransferSpec(msg.request_id, msg.tag, src, msg.dst_block_ids))
                elif isinstance(msg, Bye):
                    link.close()
            if link.alive:
                link.transfer.poll()
                time.sleep(0)                         # let gloo's waiter threads have the GIL
        return {}
    bytes_per_block = cache[:, :, 0].numel() * cache.element_size()
    p_blocks = link.peer.layout.num_blocks
    out, tag = [], 0
    local = torch.empty_like(cache)                   # a second cache in this process, for the reference copy
    for length in lengths:
        n = -(-length // block_size)
        times, local_times = [], []
        for r in range(repeats + 1):                  # the first is a warm-up
            tag += 1
            dst = random.Random(-tag).sample(range(num_blocks), n)
            spec = TransferSpec(f"t{tag}", tag, _src_ids(tag, n, p_blocks), dst)
            sync()
            t0 = time.perf_counter()
            link.transfer.start_recv(spec)
            link.send(Accept(spec.request_id, tag, dst))
            done = []
            while not done:
                done = link.transfer.poll()
                time.sleep(0)
            t1 = time.perf_counter()
            assert done[0].error is None, done[0].error
            sync()
            t2 = time.perf_counter()
            copy_blocks(local, cache, random.Random(tag).sample(range(num_blocks), n), dst)
            sync()
            t3 = time.perf_counter()
            if r:
                times.append(t1 - t0)
                local_times.append(t3 - t2)
        nbytes = n * bytes_per_block
        flat_src = torch.empty(nbytes // cache.element_size(), dtype=dtype, device=device)
        flat_dst = torch.empty_like(flat_src)
        flat = []
        for r in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            flat_dst.copy_(flat_src)
            sync()
            if r:
                flat.append(time.perf_counter() - t0)
        del flat_src, flat_dst
        med, loc, fl = statistics.median(times), statistics.median(local_times), statistics.median(flat)
        out.append(dict(backend=backend, tokens=length, blocks=n, mib=nbytes / 2**20, transfer_ms=med * 1e3,
                        transfer_gbs=nbytes / med / 1e9, local_block_copy_gbs=nbytes / loc / 1e9,
                        contiguous_copy_gbs=nbytes / fl / 1e9))
    link.send(Bye())
    link.close()
    return out


def transfer_part(args, shape) -> list[dict]:
    rows = []
    max_blocks = -(-max(args.lengths) // args.block_size)
    ctx = mp.get_context("spawn")
    for backend in args.backends:
        rendezvous, results = ctx.Queue(), ctx.Queue()
        procs = []
        for role, device in (("p", args.prefill_device), ("d", args.decode_device)):
            num_blocks = max_blocks + 64 if role == "d" else max_blocks + 128
            procs.append(ctx.Process(target=_transfer_side, args=(role, device, shape, args.dtype, num_blocks,
                                                                  args.block_size, backend, args.lengths,
                                                                  args.repeats, rendezvous, results,
                                                                  not args.sync_transfer), daemon=True))
            procs[-1].start()
        got = dict(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join(30)
        if not isinstance(got.get("d"), list):
            raise RuntimeError(f"{backend}: {got}")
        rows += got["d"]
    return rows


# -- part 2: engines ----------------------------------------------------------------------------------
def engine_part(args, model: str) -> list[dict]:
    from picovllm import LLM, SamplingParams
    from picovllm.disagg import DisaggLLM

    rng = random.Random(0)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    prompts = {L: [rng.randrange(vocab) for _ in range(L)] for L in args.lengths}
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kw = dict(block_size=args.block_size, max_model_len=max(args.lengths) + 64, dtype=args.dtype,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    rows = []

    def record(kind, backend, L, out):
        m = out.metrics
        rows.append(dict(kind=kind, backend=backend, tokens=L, ttft_ms=m.ttft * 1e3, first_gap_ms=m.itls[0] * 1e3,
                         later_gap_ms=statistics.median(m.itls[1:]) * 1e3))

    llm = LLM(model, device=args.prefill_device, gpu_memory_utilization=args.colocated_memory, **kw)
    llm.generate([prompts[min(args.lengths)]], sp, use_tqdm=False)                  # warm-up
    for L in args.lengths:
        record("colocated", "-", L, llm.generate([prompts[L]], sp, use_tqdm=False)[0])
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with DisaggLLM(model, prefill_device=args.prefill_device, decode_device=args.decode_device,
                   lease_s=120, transfer_timeout_s=120, **kw) as pd:
        for backend in args.backends:
            s = pd.session(backend=backend, async_transfer=not args.sync_transfer)   # one session per backend: the link is up before timing

            def one(prompt):
                rid = s.submit(prompt, sp)
                while rid not in s.results:
                    s.poll(0.001)
                if s.results[rid].error:
                    raise RuntimeError(s.results[rid].error)
                return s.results[rid]
            one(prompts[min(args.lengths)])                                               # warm-up
            for L in args.lengths:
                record("disagg", backend, L, one(prompts[L]))
            s.close()
            s.wait(timeout_s=120)
    base = {r["tokens"]: r["first_gap_ms"] for r in rows if r["kind"] == "colocated"}
    for r in rows:
        r["handover_added_ms"] = r["first_gap_ms"] - base[r["tokens"]] if r["kind"] == "disagg" else 0.0
    return rows


def table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder; 'tiny' for a toy; default: random Qwen3-0.6B shape")
    ap.add_argument("--device", default=None, help="both sides' device (default cuda:0)")
    ap.add_argument("--prefill-device", default=None)
    ap.add_argument("--decode-device", default=None)
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--backends", default="cuda_ipc,torch_dist")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--colocated-memory", type=float, default=0.4, help="gpu_memory_utilization of the colocated run")
    ap.add_argument("--skip-engines", action="store_true", help="part 1 only")
    ap.add_argument("--sync-transfer", action="store_true", help="torch_dist's synchronous mode (default: async)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    args.prefill_device = args.prefill_device or device
    args.decode_device = args.decode_device or device
    args.dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.backends = args.backends.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model in (None, "tiny"):
            model = random_checkpoint(TINY if model == "tiny" else QWEN3_06B, tmp)
        shape = model_shape(model)
        info = dict(device=f"{args.prefill_device} -> {args.decode_device}",
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", torch=torch.__version__,
                    model=args.model or "random Qwen3-0.6B shape", kv_bytes_per_token=2 * shape["layers"] *
                    shape["kv_heads"] * shape["head_dim"] * torch.empty((), dtype=getattr(torch, args.dtype)).element_size())
        print(json.dumps(info))
        transfer = transfer_part(args, shape)
        print("\nKV transfer (D: Accept -> blocks written), median of", args.repeats)
        print(table(transfer, ["backend", "tokens", "mib", "transfer_ms", "transfer_gbs", "local_block_copy_gbs",
                               "contiguous_copy_gbs"]))
        engines = [] if args.skip_engines else engine_part(args, model)
        if engines:
            print("\nOne prompt through the engines (4 output tokens)")
            print(table(engines, ["kind", "backend", "tokens", "ttft_ms", "first_gap_ms", "later_gap_ms",
                                  "handover_added_ms"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, transfer=transfer, engines=engines), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
