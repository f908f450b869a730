"""Disaggregation between engines of different TP sizes (CPU, gloo): KV heads are re-split on the way.

P TP=2 -> D TP=1 and P TP=1 -> D TP=2 must generate exactly what the colocated TP=1 engine does. The
checkpoint has 3 KV heads (9 query heads), which 2 ranks split unevenly (2 + 1), as SmolLM2's do;
a second one has 1 KV head, which 2 ranks both hold (replication). The full-head gather and scatter
are also checked directly against the TP=1 engine's cache.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from conftest import build_tiny_checkpoint
from picovllm import LLM, SamplingParams
from picovllm.disagg import DisaggLLM
from picovllm.engine.tp_kv import FullHeadKV, local_kv_heads

GREEDY = dict(temperature=0, ignore_eos=True)
ENGINE = dict(block_size=4, num_kv_blocks=128, prefill={"max_num_batched_tokens": 16})


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_thread_in_children):
    """One intra-op thread here and in the spawned engines and ranks."""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hetero")
    return {"uneven": build_tiny_checkpoint(str(root / "uneven"), "llama", hidden_size=72, num_attention_heads=9,
                                            num_key_value_heads=3),
            "replicated": build_tiny_checkpoint(str(root / "replicated"), "qwen2", num_key_value_heads=1)}


def prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 384, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def children_of(pids) -> list[int]:
    """Live (not zombie) processes whose parent is one of pids: the engines' TP worker ranks."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) in pids and fields[0] != "Z":
            out.append(int(d))
    return out


def run_pd(path: str, p_tp: int, d_tp: int, ps, sp, async_transfer: bool = True, refused=(), **engine):
    llm = DisaggLLM(path, prefill={**ENGINE["prefill"], "tensor_parallel_size": p_tp},
                    decode={"tensor_parallel_size": d_tp}, block_size=4, num_kv_blocks=128, **engine)
    try:
        ranks = children_of(set(llm.pids.values()))
        assert len(ranks) == (p_tp - 1) + (d_tp - 1), ranks
        for backend in refused:     # the handshake fails with a reason; the engines stay up for the next
            s = llm.session(backend=backend)
            s.close()
            s.wait(timeout_s=30)
            errors = [end.error or "" for end in s.ended.values()]
            assert any("KVLayout.tp_size" in e and backend in e for e in errors), errors
        outs = llm.generate(ps, sp, async_transfer=async_transfer, timeout_s=60)
        for role, end in llm._active.ended.items():   # rank 0 owns the block table every rank shares
            assert end.free_blocks == end.num_blocks, f"{role}: {end.num_blocks - end.free_blocks} blocks leaked"
            assert end.unfinished == 0 and end.error is None, (role, end)
    finally:
        t0 = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - t0 < 15
    assert all(p.exitcode == 0 for p in llm.procs.values()), {r: p.exitcode for r, p in llm.procs.items()}
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if _alive(pid)], "a TP worker rank outlived its engine"
    return outs


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("model,p_tp,d_tp", [("uneven", 2, 1), ("uneven", 1, 2), ("replicated", 1, 2),
                                             ("replicated", 2, 2)],
                         ids=["uneven-P2-D1", "uneven-P1-D2", "replicated-P1-D2", "replicated-P2-D2"])
def test_hetero_tp_matches_colocated(models, model, p_tp, d_tp):
    ps, sp = prompts(), SamplingParams(max_tokens=8, **GREEDY)
    ref = LLM(models[model], block_size=4, num_kv_blocks=128).generate(ps, sp, use_tqdm=False)
    refused = [] if p_tp == d_tp == 1 else ["cuda_ipc"]   # it maps one peer cache: TP engines are refused
    outs = run_pd(models[model], p_tp, d_tp, ps, sp, async_transfer=p_tp == 2, refused=refused)
    assert tokens(outs) == tokens(ref)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
def test_hetero_tp_fp8_kv_matches_colocated_fp8(models, p_tp, d_tp):
    """fp8 KV across TP sizes: each rank calibrates its own KV heads; the full-head scales (a max over ranks)
    must match the other side's at the handshake, and the fp8 blocks re-split on the way give colocated
    TP=1 fp8's tokens."""
    ps, sp = prompts(), SamplingParams(max_tokens=8, **GREEDY)
    ref = LLM(models["uneven"], block_size=4, num_kv_blocks=128, kv_cache_dtype="fp8").generate(ps, sp,
                                                                                              use_tqdm=False)
    outs = run_pd(models["uneven"], p_tp, d_tp, ps, sp, kv_cache_dtype="fp8")
    assert tokens(outs) == tokens(ref)


@pytest.mark.parametrize("model", ["uneven", "replicated"])
def test_full_head_gather_and_scatter_against_tp1_cache(models, model):
    """FullHeadKV.read of a TP=2 engine's blocks equals the TP=1 engine's cache; write then read round-trips."""
    path, ps = models[model], prompts(3)
    sp = SamplingParams(max_tokens=4, **GREEDY)
    tp1 = LLM(path, block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    tp1.generate(ps, sp, use_tqdm=False)        # both engines allocate the same blocks in the same order
    used = sorted({i for i in range(64) if tp1.engine.runner.kv_cache[:, :, i].abs().sum() > 0})
    assert len(used) >= 6
    with LLM(path, tensor_parallel_size=2, block_size=4, num_kv_blocks=64, enable_prefix_caching=False) as llm:
        llm.generate(ps, sp, use_tqdm=False)
        runner = llm.engine.runner
        io = FullHeadKV(llm.engine.executor)
        full = io.read(used[::-1])
        want = tp1.engine.runner.kv_cache[:, :, used[::-1]]
        assert full.shape == want.shape
        torch.testing.assert_close(full, want, atol=1e-4, rtol=1e-4)    # TP=2's all-reduce order: fp32 noise

        noise = torch.randn(full.shape, generator=torch.Generator().manual_seed(3))
        dst = [60, 2, 41]
        io.write(dst, noise[:, :, :3])
        torch.testing.assert_close(io.read(dst), noise[:, :, :3], atol=0, rtol=0)   # the worker's heads too
        start, count = local_kv_heads(runner)
        assert count < full.shape[4] or model == "replicated"
        torch.testing.assert_close(runner.kv_cache[:, :, dst], noise[:, :, :3, :, start:start + count],
                                   atol=0, rtol=0)


def test_gather_and_scatter_messages_round_trip():
    from picovllm.engine.messages import PROTOCOL_VERSION, GatherKV, ScatterKV, decode, encode
    for msg in (GatherKV([3, 0, 7]), ScatterKV([1])):
        assert decode(encode(msg)) == msg
    with pytest.raises(ValueError, match="GatherKV.block_ids: missing"):
        decode(b'{"version":%d,"type":"gather_kv","body":{}}' % PROTOCOL_VERSION)


def test_cli_passes_each_side_its_tp_size(monkeypatch):
    import picovllm.disagg.driver as driver
    from picovllm.disagg.cli import main
    seen = {}
    monkeypatch.setattr(driver, "generate_disaggregated", lambda *a, **kw: seen.update(kw) or [])
    assert main(["hi", "--prefill-tp", "2", "--decode-tp", "1", "--decode-num-kv-blocks", "9"]) == 0
    assert seen["prefill"] == {"tensor_parallel_size": 2}
    assert seen["decode"] == {"num_kv_blocks": 9, "tensor_parallel_size": 1}
    assert main(["hi", "--decode-tp", "2"]) == 0
    assert seen["prefill"] == {} and seen["decode"] == {"tensor_parallel_size": 2}
