"""Tensor parallelism on CPU (gloo, 2 ranks): TP=2 must generate exactly what TP=1 and HF do.

Each TP engine costs a process spawn and a model build, so one engine per checkpoint runs several
checks: plain batches, chunked prefill, preemption, fewer KV heads than ranks, an odd vocabulary.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch

from conftest import build_tiny_checkpoint
from picovllm import LLM, SamplingParams
from picovllm.engine.model_runner import SamplingRow, StepInput
from test_parity_hf import hf_greedy, make_prompts

# arch -> checkpoint overrides: KV heads that 2 ranks split unevenly (like SmolLM2's 9 heads, 3 KV heads),
# fewer KV heads than ranks, and a vocabulary that 2 does not divide
CHECKPOINTS = {
    "llama": dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3),
    "qwen2": dict(num_key_value_heads=1),
    "qwen3": dict(vocab_size=383, tie_word_embeddings=True),
}
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    return {arch: build_tiny_checkpoint(str(root / arch), arch, **kw) for arch, kw in CHECKPOINTS.items()}


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # spawned workers inherit it: 2 ranks on 2 shared cores


def spawned_children() -> list[int]:
    """Pids of this process's children that run multiprocessing-spawned code (our workers)."""
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and b"spawn_main" in cmd and stat.rsplit(")", 1)[1].split()[0] != "Z":
            out.append(int(d))
    return out


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_plain_batch_matches_tp1_and_hf_then_shuts_down(tp_models):
    path, prompts = tp_models["llama"], make_prompts()
    sp = SamplingParams(max_tokens=12, logprobs=0, **GREEDY)
    ref, _ = hf_greedy(path, prompts, 12)
    tp1 = LLM(path, num_kv_blocks=64).generate(prompts, sp, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, num_kv_blocks=64) as llm:
        attn = llm.engine.runner.model.attention_layers()[0]
        assert (attn.num_heads, attn.num_kv_heads) == (6, 2)   # rank 0's uneven share of 9 heads, 3 KV heads
        pids = llm.engine.executor.worker_pids
        assert len(pids) == 1 and pids[0] in spawned_children()
        tp2 = llm.generate(prompts, sp, use_tqdm=False)
        assert tokens(tp2) == tokens(tp1) == ref
        for a, b in zip(tp1, tp2):   # the all-reduce sums in another order: logprobs agree to fp32 noise
            la = [d[t].logprob for d, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
            lb = [d[t].logprob for d, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
            assert lb == pytest.approx(la, abs=1e-4)
        # a second engine that would spawn workers while this one runs: refused by name, not hung in new_group
        with pytest.raises(ValueError, match="tensor_parallel_size 2: another tensor-parallel engine"):
            LLM(path, tensor_parallel_size=2, num_kv_blocks=64)
        again = llm.generate(prompts[:3], sp, use_tqdm=False)   # the engine is reusable
        assert tokens(again) == ref[:3]
    assert spawned_children() == []
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompts[:1], sp, use_tqdm=False)


def test_fewer_kv_heads_than_ranks_with_chunked_prefill(tp_models):
    path, prompts = tp_models["qwen2"], make_prompts()
    ref, _ = hf_greedy(path, prompts, 10)
    sp = SamplingParams(max_tokens=10, **GREEDY)
    tp1 = tokens(LLM(path, block_size=4, max_num_batched_tokens=7, num_kv_blocks=256).generate(prompts, sp, use_tqdm=False))
    with LLM(path, tensor_parallel_size=2, block_size=4, max_num_batched_tokens=7, num_kv_blocks=256,
             async_scheduling=True) as llm:   # overlapped: rank 0 broadcasts each step's tokens
        attn = llm.engine.runner.model.attention_layers()[0]
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)   # 4 query heads split, the 1 KV head replicated
        steps, real = [], llm.engine.scheduler.schedule

        def schedule():
            out = real()
            steps.append((out.num_decodes, len(out.chunks), out.num_tokens))
            return out

        llm.engine.scheduler.schedule = schedule
        tp2 = tokens(llm.generate(prompts, sp, use_tqdm=False))
    assert any(0 < decodes < chunks for decodes, chunks, _ in steps), "decodes were meant to mix with prefill chunks"
    assert max(n for _, _, n in steps) <= 7
    assert tp2 == tp1 == ref


def test_fp8_kv_each_rank_holds_its_heads_scales(tp_models):
    """kv_cache_dtype fp8 under TP=2 (3 KV heads split 2 + 1): rank 0's layers hold the scales of its 2 heads,
    the engine's full-head scales equal TP=1's calibration, and the tokens equal TP=1 fp8's."""
    path, prompts = tp_models["llama"], make_prompts()
    sp = SamplingParams(max_tokens=8, **GREEDY)
    tp1 = LLM(path, num_kv_blocks=64, kv_cache_dtype="fp8")
    k1, v1 = tp1.engine.executor.kv_scales
    ref = tokens(tp1.generate(prompts, sp, use_tqdm=False))
    with LLM(path, tensor_parallel_size=2, num_kv_blocks=64, kv_cache_dtype="fp8") as llm:
        runner = llm.engine.runner
        assert runner.kv_cache.dtype == torch.float8_e4m3fn
        k2, v2 = llm.engine.executor.kv_scales
        assert torch.equal(k2, k1) and torch.equal(v2, v1)
        for i, attn in enumerate(runner.model.attention_layers()):
            assert torch.equal(attn.kv_scales[0], k1[i, :2]) and torch.equal(attn.kv_scales[1], v1[i, :2])
        assert tokens(llm.generate(prompts, sp, use_tqdm=False)) == ref


def test_odd_vocab_tied_head_with_preemption(tp_models):
    path, prompts = tp_models["qwen3"], make_prompts(vocab=383)
    ref, _ = hf_greedy(path, prompts, 8)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    kw = dict(block_size=4, num_kv_blocks=30, enable_prefix_caching=False)
    tp1 = tokens(LLM(path, **kw).generate(prompts, sp, use_tqdm=False))
    with LLM(path, tensor_parallel_size=2, async_scheduling=True, **kw) as llm:
        preempted = []
        real = llm.engine.scheduler.preempt
        llm.engine.scheduler.preempt = lambda r: (preempted.append(r.request_id), real(r))
        tp2 = tokens(llm.generate(prompts, sp, use_tqdm=False))
    assert preempted, "the cache was meant to be too small to hold every request"
    assert tp2 == tp1 == ref


def test_penalties_and_logit_bias_match_tp1(tp_models):
    """Only rank 0 samples: the workers get steps without sampling rows, rank 0 applies the penalties."""
    path, prompts = tp_models["qwen2"], make_prompts()[:4]
    sps = [SamplingParams(max_tokens=10, repetition_penalty=1.5, **GREEDY),
           SamplingParams(max_tokens=10, frequency_penalty=1.0, presence_penalty=0.5, **GREEDY),
           SamplingParams(max_tokens=10, logit_bias={7: 5.0}, **GREEDY), SamplingParams(max_tokens=10, **GREEDY)]
    tp1 = tokens(LLM(path, num_kv_blocks=64).generate(prompts, sps, use_tqdm=False))
    with LLM(path, tensor_parallel_size=2, num_kv_blocks=64, async_scheduling=True) as llm:   # pending tokens
        tp2 = tokens(llm.generate(prompts, sps, use_tqdm=False))
    assert tp2 == tp1 and len(set(map(tuple, tp1))) == 4


def test_killed_worker_raises_within_seconds_and_leaves_no_process(tp_models):
    llm = LLM(tp_models["llama"], tensor_parallel_size=2, num_kv_blocks=256, async_scheduling=True)
    pid = llm.engine.executor.worker_pids[0]
    killed_at = []

    def kill_once_decoding():
        while llm.engine.stats.decode_tokens == 0:
            time.sleep(0.001)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_decoding, daemon=True)
    killer.start()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate(make_prompts(), SamplingParams(max_tokens=400, **GREEDY), use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < 10
    killer.join()
    assert spawned_children() == []
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="SIGKILL"):   # later calls say why the engine is gone
        llm.generate(make_prompts()[:1], SamplingParams(max_tokens=2), use_tqdm=False)


def test_torchrun_launch_matches_tp1(tp_models):
    path, prompts = tp_models["qwen2"], make_prompts()[:4]
    ref = tokens(LLM(path, num_kv_blocks=64).generate(prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "picovllm.entrypoints.tp_launch", "--model", path, "--max-tokens", "8", "--ignore-eos",
           "--num-kv-blocks", "64", "--json"] + [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [d["token_ids"] for d in sorted(lines, key=lambda d: d["index"])] == ref


@pytest.mark.parametrize("heads,kv_heads,ranks", [(4, 2, 2), (9, 3, 2), (12, 6, 4), (8, 2, 4), (4, 1, 2)])
def test_head_shards_reassemble_the_full_attention_projections(heads, kv_heads, ranks):
    """Per rank: its q/k/v outputs are the full projection's heads it owns; o_proj partial sums add up."""
    from picovllm.distributed import TPGroup
    from picovllm.layers.linear import QKVParallelLinear, RowParallelLinear

    d, hidden = 4, 16
    torch.manual_seed(0)
    wq, wk, wv = (torch.randn(n * d, hidden) for n in (heads, kv_heads, kv_heads))
    wo, x = torch.randn(hidden, heads * d), torch.randn(3, hidden)
    q_full, k_full, v_full = (x @ w.T for w in (wq, wk, wv))
    o_in = torch.randn(3, heads * d)
    o_sum, q_heads_seen = torch.zeros(3, hidden), []
    for r in range(ranks):
        tp = TPGroup(rank=r, size=ranks)
        qkv = QKVParallelLinear(hidden, d, heads, kv_heads, tp=tp)
        for shard, w in zip("qkv", (wq, wk, wv)):
            qkv.load(qkv.weight, w, shard)
        q, k, v = (qkv(x)).split([qkv.num_heads * d, qkv.num_kv_heads * d, qkv.num_kv_heads * d], dim=-1)
        qs, ks = qkv.q_head_start, qkv.kv_head_start
        torch.testing.assert_close(q, q_full[:, qs * d:(qs + qkv.num_heads) * d])
        torch.testing.assert_close(k, k_full[:, ks * d:(ks + qkv.num_kv_heads) * d])
        torch.testing.assert_close(v, v_full[:, ks * d:(ks + qkv.num_kv_heads) * d])
        group = heads // kv_heads   # each local query head must see the KV head HF pairs it with
        assert all((qs + i) // group == ks + i * qkv.num_kv_heads // qkv.num_heads for i in range(qkv.num_heads))
        q_heads_seen += range(qs, qs + qkv.num_heads)
        o = RowParallelLinear(heads * d, hidden, tp=tp, in_shard=qkv.q_shard)
        o.load(o.weight, wo)
        start, n = qkv.q_shard
        o_sum += o_in[:, start:start + n] @ o.weight.T
    assert sorted(q_heads_seen) == list(range(heads))
    torch.testing.assert_close(o_sum, o_in @ wo.T)


def test_kv_heads_that_cannot_be_shared_out_name_the_fields():
    from picovllm.distributed import TPGroup
    from picovllm.layers.linear import QKVParallelLinear

    with pytest.raises(ValueError, match="tensor_parallel_size 4 .* num_key_value_heads 3"):
        QKVParallelLinear(16, 4, 6, 3, tp=TPGroup(rank=0, size=4))


def test_an_mlp_width_the_ranks_cannot_share_names_the_field():
    """A dense MLP (or a shared expert) whose intermediate size tp does not divide: a ValueError naming the field, as
    for KV heads and MoE experts, not a bare AssertionError about a linear layer's out_features."""
    from types import SimpleNamespace

    from picovllm.distributed import TPGroup
    from picovllm.layers.moe import SharedExpertMoE
    from picovllm.models.llama import LlamaMLP

    cfg = SimpleNamespace(hidden_size=72, intermediate_size=128, mlp_bias=False, hidden_act="silu")
    with pytest.raises(ValueError, match="intermediate_size 128 is not divisible by tensor_parallel_size 3"):
        LlamaMLP(cfg, TPGroup(rank=0, size=3))
    LlamaMLP(cfg, TPGroup(rank=0, size=2))
    with pytest.raises(ValueError, match="shared expert's intermediate size 50 .* tensor_parallel_size 4"):
        SharedExpertMoE(4, 2, 16, 8, False, 50, tp=TPGroup(rank=0, size=4))


def test_step_message_round_trips_without_pickle():
    from picovllm.config import EngineConfig
    from picovllm.engine.messages import RunStep, Setup, decode, encode

    step = StepInput([5, 6], [0, 7], [16, 23], [0, 1, 2], [1, 8], [[1], [1, 3]], 1, [0, 1],
                     [SamplingRow(0.7, 5, 0.9, 0.0, 2**62 + 1, [2, 3], 4),
                      SamplingRow(0.0, 0, 1.0, 0.1, None, [], None, 0.5, -1.0, 1.2, [3], [-2.5], [4, 4], [5], 1)])
    assert decode(encode(RunStep(step))) == RunStep(step)
    cfg = EngineConfig(model="/m", dtype="bf16", device="cpu", tensor_parallel_size=2, num_kv_blocks=9)
    assert decode(encode(Setup(cfg))).config == cfg
    frame = json.loads(encode(Setup(cfg)))
    with pytest.raises(ValueError, match="version"):
        decode(json.dumps(dict(frame, version=99)).encode())
    del frame["body"]["config"]["block_size"]
    with pytest.raises(ValueError, match=r"Setup\.config\.block_size"):
        decode(json.dumps(frame).encode())
    cut = encode(RunStep(replace(step, sampling=[], prev_dst=[1], prev_src=[0])))[:-1]   # binary: no rows,
    with pytest.raises(ValueError, match=r"RunStep\.step\.prev_src"):              # prev_src comes last
        decode(cut)


@pytest.mark.gpu2
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_on_two_gpus_matches_tp1(tp_models):
    path, prompts = tp_models["qwen2"], make_prompts()
    sp = SamplingParams(max_tokens=12, **GREEDY)
    # the Triton attention backend when this tree has the kernels, else the torch one
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=256,
              attention_backend="auto" if importlib.util.find_spec("picovllm.kernels") else "torch")
    tp1 = tokens(LLM(path, **kw).generate(prompts, sp, use_tqdm=False))
    with LLM(path, tensor_parallel_size=2, **kw) as llm:
        assert str(llm.engine.runner.device) == "cuda:0"
        tp2 = tokens(llm.generate(prompts, sp, use_tqdm=False))
    assert tp2 == tp1


def _one_shot_rank(rank: int, port: int, out) -> None:
    from picovllm.distributed import make_one_shot, make_small_all_reduce
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    torch.distributed.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    group = torch.distributed.group.WORLD
    paths = {"one_shot": make_one_shot(group, dev, 1 << 20), "small": make_small_all_reduce(group, dev)}
    errors = []
    cases = [(8, torch.bfloat16), (1024 * 3, torch.bfloat16), (4096 * 64, torch.float32), (5000, torch.float16)]
    for name, path in paths.items():
        for n, dtype in cases:
            if name == "one_shot" and dtype == torch.float16:
                continue       # torch's one-shot has no float16 (its fits() sends those to NCCL)
            parts = [torch.randn(n, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
                     for r in range(2)]
            x = parts[rank].to(dtype).to(dev)
            want = sum(p.to(dtype).double() for p in parts)        # float64 sum of what each rank holds
            got = path(x).double().cpu()
            errors.append((name, float((got - want).abs().max() / want.abs().max())))
    # the small path replayed in a CUDA graph: the epochs on the device count on across replays
    small = paths["small"]
    x = torch.empty(4096, dtype=torch.bfloat16, device=dev)
    y = torch.empty(1000, dtype=torch.float32, device=dev)
    graph = torch.cuda.CUDAGraph()
    small(x), small(y)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        sx, sy = small(x), small(y)
    for step in range(50):
        g = torch.Generator().manual_seed(1000 * step)
        parts = [torch.randn(4096 + 1000, generator=g, dtype=torch.float64) for _ in range(2)]
        x.copy_(parts[rank][:4096]), y.copy_(parts[rank][4096:])
        graph.replay()
        want = sum(p[:4096].to(torch.bfloat16).double() for p in parts)
        errors.append(("graph", float((sx.double().cpu() - want).abs().max() / want.abs().max())))
        want = sum(p[4096:].float().double() for p in parts)
        errors.append(("graph", float((sy.double().cpu() - want).abs().max() / want.abs().max())))
    out.put((rank, all(p is not None for p in paths.values()), errors))
    torch.distributed.destroy_process_group()


@pytest.mark.gpu2
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_one_shot_all_reduce_sums_like_float64():
    """Both peer-memory paths (torch's one-shot, our one-flag kernel) against a float64 sum, eager and
    replayed in a CUDA graph."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_one_shot_rank, args=(r, 29517, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, made, errors in results:
        assert made, "the peer-memory paths should exist between two H200s"
        errors = [e for _, e in errors]
        assert max(errors) < 1e-2, errors     # bf16 rounding of the sum at most


def test_structured_outputs_under_tp_overlap_match_tp1():
    """Overlapped TP=2 fills a constrained request's mask late on rank 0 (between the ranks' forward and its
    sampling): the regex-constrained text and an unconstrained batch-mate's equal TP=1's, on the default model."""
    from picovllm.sampling_params import StructuredOutputsParams
    sp = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                         structured_outputs=StructuredOutputsParams(regex=r"[a-z]{5} (yes|no)")),
          SamplingParams(temperature=0, max_tokens=12)]
    prompts = ["Answer:", "Hello"]
    kw = dict(num_kv_blocks=64, quantization="none")
    ref = [o.outputs[0].text for o in LLM(**kw).generate(prompts, sp, use_tqdm=False)]
    with LLM(tensor_parallel_size=2, async_scheduling=True, **kw) as llm:
        got = [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref
    assert re.fullmatch(r"[a-z]{5} (yes|no)", got[0])
