"""Issue 18 on one GPU: nano-vllm's throughput workload on random bf16 models of three families' shapes, and HF
transformers' continuous batching on the Qwen3-30B-A3B shape, on the same weights, in the same process.

    python benchmarks/families_gpu.py                        # qwen3-30b-a3b (+ HF peer), mistral-7b, gemma2-2b
    python benchmarks/families_gpu.py --only qwen3-30b-a3b   # one model (a 10-minute call each is safest)
    python benchmarks/families_gpu.py --only mistral-7b gemma2-2b --peer none
    python benchmarks/families_gpu.py --tiny                 # toy shapes, 8 short requests, CPU or GPU: it runs

The models are "random:<preset>" sources (picovllm/bench/random_checkpoint.py): each tensor is generated on the GPU
as it is loaded (Qwen3-30B-A3B is 61 GB in bf16, larger than this machine's disk allows), N(0, 0.02) from a seed per
tensor name. The peer's model is built by transformers from the same config and filled with the same tensors (its
fused expert tensors stacked from the per-expert ones), after picovllm's engine is shut down and its memory freed.

Workload (nano-vllm's bench.py, as benchmarks/nano_throughput.py): 256 requests, random.seed(0), prompts of
randint(100, 1024) token ids in [0, 10000], max_tokens randint(100, 1024), ignore_eos; picovllm samples at
temperature 0.6, the peer greedily (its own benchmark's setting; lengths are the same either way). picovllm: a
warm-up, then --repeat runs with prefix caching off (a second run would hit the first's blocks); the last is
reported. The peer streams (so a run cut by --peer-budget-s still counts every token it generated) and reports
output tokens / seconds for each attention implementation in --peer-attn.

Prints a JSON line per result and writes everything to $OUT/families_gpu.json (or --out) after each result, so a
call cut by its time limit keeps what finished.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from nano_throughput import workload  # noqa: E402
from picovllm import LLM, SamplingParams  # noqa: E402
from picovllm.bench.random_checkpoint import _tensor_shapes, random_tensor, resolve_config  # noqa: E402

MODELS = ["qwen3-30b-a3b", "mistral-7b", "gemma2-2b", "gpt-oss-20b", "deepseek-v2-lite"]
PEER = ("qwen3-30b-a3b",)       # the target: at least 20x HF's continuous batching on this one


def requests(args) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's workload; --tiny: its first prompts, cut to 32 tokens, 16 outputs each."""
    prompts, params = workload(args.num_seqs)
    if args.tiny:
        prompts = [p[:32] for p in prompts]
        params = [SamplingParams(temperature=p.temperature, ignore_eos=True, max_tokens=16) for p in params]
    return prompts, params


def run_picovllm(preset: str, args) -> dict:
    prompts, params = requests(args)
    t = time.perf_counter()
    kw = dict(device="cpu") if args.device == "cpu" else dict(gpu_memory_utilization=args.gpu_memory_utilization)
    llm = LLM(f"random:{preset}", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384,
              enable_prefix_caching=False, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, **kw)
    res = {"model": preset, "engine": "picovllm", "quantization": args.quantization,
           "kv_cache_dtype": args.kv_cache_dtype,
           "load_s": round(time.perf_counter() - t, 1),
           "kv_blocks": llm.engine.block_manager.num_blocks}
    try:
        llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=16), use_tqdm=False)     # warm-up
        runs = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            assert n_out == sum(p.max_tokens for p in params), (n_out, sum(p.max_tokens for p in params))
            runs.append(round(n_out / dt, 1))
        res.update(output_tokens=n_out, input_tokens=sum(map(len, prompts)), seconds=round(dt, 2),
                   output_tok_per_s=runs[-1], runs_tok_per_s=runs)
        if args.tiny:
            res["same_weights_as_peer"] = same_weights_check(llm, preset, args)
    finally:
        llm.shutdown()
        del llm
        res["gpu_gb_left_after_shutdown"] = free_memory()
    return res


def free_memory() -> float | None:
    """Collect and give cached blocks back; the GB still allocated (None without a GPU): the next engine needs
    the previous one's memory gone."""
    gc.collect()
    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    return round(torch.cuda.memory_allocated() / 2**30, 2)


# -- the peer: HF transformers' continuous batching on the same weights ---------------------------------------------
def hf_model(preset: str, device: str, dtype: torch.dtype):
    """transformers' model of the preset's config, its parameters filled with the tensors picovllm loaded."""
    import transformers

    cfg = resolve_config(preset)
    hf_cfg = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                                       if k not in ("model_type", "architectures")})
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    shapes, gemma = _tensor_shapes(cfg), cfg["architectures"][0].startswith("Gemma")

    def ours(name: str) -> torch.Tensor:
        return random_tensor(name, shapes[name], 0, torch.bfloat16, device, gemma).to(dtype)

    with torch.no_grad():
        for name, p in model.named_parameters():
            m = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)    # HF's experts, stacked
            if m is not None:
                parts = ("gate_proj", "up_proj") if m[2] == "gate_up_proj" else ("down_proj",)
                for e in range(p.shape[0]):
                    p[e].copy_(torch.cat([ours(f"{m[1]}.{e}.{part}.weight") for part in parts]))
            elif name in shapes:
                p.copy_(ours(name))
            else:
                raise KeyError(f"the peer's parameter {name!r} has no tensor in the random checkpoint")
    return model


def same_weights_check(llm: LLM, preset: str, args) -> bool:
    """--tiny: the peer's model computes what picovllm's does (greedy tokens, float32), so the two engines ran the
    same weights."""
    prompt = [5, 17, 300, 2, 99, 1000]
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    model = hf_model(preset, args.device, torch.float32)
    ids = torch.tensor([prompt], device=args.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    del model
    return out[0, len(prompt):].tolist() == ours


def run_peer(preset: str, args) -> list[dict]:
    from transformers import GenerationConfig

    prompts, params = requests(args)
    t = time.perf_counter()
    model = hf_model(preset, args.device, torch.bfloat16)
    load_s = round(time.perf_counter() - t, 1)
    results = []
    for attn in args.peer_attn:
        res = {"model": preset, "engine": f"hf_cb[{attn}]", "load_s": load_s}
        try:
            res.update(_peer_run(model, attn, prompts, [p.max_tokens for p in params], args.peer_budget_s,
                                 GenerationConfig, small_cache=args.tiny))
        except Exception as e:        # the peer's failure is a result, not the end of the run
            res["error"] = repr(e)[:400]
        results.append(res)
        report(res, args)
        free_memory()
    del model
    print(json.dumps({"gpu_gb_left_after_peer": free_memory()}), flush=True)
    return results


def _peer_run(model, attn: str, prompts, max_toks, budget_s: float, GenerationConfig,
              small_cache: bool = False) -> dict:
    model.set_attn_implementation(attn)
    gc_ = GenerationConfig(max_new_tokens=max(max_toks), do_sample=False, eos_token_id=-1, pad_token_id=0)
    kw = {}
    if small_cache:     # --tiny: a cache for 8 short requests (sized from memory, the peer fills ~25 s of it on a CPU)
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        kw["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=512)
    mgr = model.init_continuous_batching(generation_config=gc_, **kw)
    try:
        mgr.warmup()
    except Exception as e:            # as the peer benchmark: a failed warm-up only costs its first steps
        print("peer warm-up failed:", repr(e)[:200], flush=True)
    mgr.start()
    t = time.perf_counter()
    progress, finished = {}, 0
    try:
        for i, (p, m) in enumerate(zip(prompts, max_toks)):
            mgr.add_request(input_ids=p, max_new_tokens=m, request_id=f"r{i}", streaming=True)
        while finished < len(prompts) and time.perf_counter() - t < budget_s:
            r = mgr.get_result(timeout=1)
            if r is None:
                continue
            progress[r.request_id] = max(progress.get(r.request_id, 0), len(r.generated_tokens))
            finished += r.is_finished()
        dt = time.perf_counter() - t
    finally:
        mgr.stop(block=True, timeout=30)
        try:
            model.destroy_cached_continuous_batching_manager()
        except Exception:
            pass
    toks = sum(progress.values())
    return {"finished": finished, "of": len(prompts), "output_tokens": toks, "seconds": round(dt, 2),
            "output_tok_per_s": round(toks / dt, 1)}


def report(res: dict, args) -> None:
    args.results.append(res)
    print(json.dumps(res), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": args.device_name, "results": args.results}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=MODELS, default=MODELS)
    ap.add_argument("--peer", choices=["moe", "none", "all"], default="moe",
                    help="which models also run the HF continuous-batching peer (moe: Qwen3-30B-A3B's shape)")
    ap.add_argument("--peer-attn", nargs="+", default=["paged|sdpa"], help="the peer's attention implementations")
    ap.add_argument("--peer-budget-s", type=float, default=240.0, help="the peer's run is cut after this long")
    ap.add_argument("--peer-first", action="store_true", help="run the peer before picovllm (each frees its memory)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--quantization", default="auto", choices=["auto", "fp8"],
                    help="fp8: picovllm's linear and expert weights in float8 (the peer stays bfloat16)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="fp8: picovllm's KV cache in float8 e4m3 (the peer's stays bfloat16)")
    ap.add_argument("--tiny", action="store_true", help="toy shapes and 8 short requests (CPU without a GPU)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "families_gpu.json"))
    args = ap.parse_args()
    args.results = []
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    presets = args.only
    if args.tiny:
        presets = [{"qwen3-30b-a3b": "tiny-qwen3-moe", "mistral-7b": "tiny-mistral",
                    "gemma2-2b": "tiny-gemma2", "gpt-oss-20b": "tiny-gpt-oss",
                    "deepseek-v2-lite": "tiny-deepseek-v2-lite"}[m] for m in args.only]
        args.num_seqs, args.repeat = min(args.num_seqs, 8), 1
        args.peer_budget_s = min(args.peer_budget_s, 120.0)
    elif args.device == "cpu":
        sys.exit("no GPU: the full shapes need one (--tiny runs toy shapes on the CPU)")
    for model, preset in zip(args.only, presets):
        peer = args.peer == "all" or (args.peer == "moe" and model in PEER)
        if peer and args.peer_first:
            run_peer(preset, args)
        report(run_picovllm(preset, args), args)
        if peer and not args.peer_first:
            run_peer(preset, args)
    ours = {r["model"]: r["output_tok_per_s"] for r in args.results if r["engine"] == "picovllm"}
    ratios = {f"{r['model']} / {r['engine']}": round(ours[r["model"]] / r["output_tok_per_s"], 2)
              for r in args.results if r["engine"] != "picovllm" and r.get("output_tok_per_s")}
    if ratios:
        report({"ratios": ratios}, args)


if __name__ == "__main__":
    main()
