"""One suite for every KV-transfer backend: the same scenarios run against each.

The two sides run as two threads (CPU) or two spawned processes (GPU: CUDA IPC cannot map a
process's own memory), speak the real handshake (PeerLink.open) and the protocol messages, and
D checks every block against P's cache, which it rebuilds from the same seed.

    torch_dist/cpu      gloo
    cuda_ipc/cpu        the pull path over shared memory (what cuda_ipc does with IPC handles)
    torch_dist/cuda     gloo between two processes on one GPU, staged through the CPU   (gpu)
    cuda_ipc/cuda       CUDA IPC between two processes on one GPU                       (gpu)
    */cuda2             P on cuda:0, D on cuda:1 (torch_dist picks NCCL)                (gpu2)
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import random
import threading
import time

import pytest
import torch

from picovllm.disagg.channel import Channel, Listener
from picovllm.disagg.link import PeerLink
from picovllm.disagg.messages import Accept, Ack, Bye, KVLayout
from picovllm.disagg.transfer import TransferConfig, TransferSpec

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
gpu2 = [pytest.mark.gpu2, pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")]

CASES = [
    pytest.param("torch_dist", "cpu", id="torch_dist-cpu"),
    pytest.param("cuda_ipc", "cpu", id="cuda_ipc-cpu(shm)"),
    pytest.param("torch_dist", "cuda", id="torch_dist-gloo-1gpu", marks=gpu),
    pytest.param("cuda_ipc", "cuda", id="cuda_ipc-1gpu", marks=gpu),
    pytest.param("torch_dist", "cuda2", id="torch_dist-nccl-2gpu", marks=gpu2),
    pytest.param("cuda_ipc", "cuda2", id="cuda_ipc-2gpu", marks=gpu2),
]
NUM_BLOCKS = {"p": 24, "d": 16}


def device_of(role: str, where: str) -> str:
    return {"cpu": "cpu", "cuda": "cuda:0", "cuda2": "cuda:0" if role == "p" else "cuda:1"}[where]


def make_cache(role: str, where: str, head_dim: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1 if role == "p" else 2)
    dtype = torch.float32 if where == "cpu" else torch.bfloat16
    return torch.randn(2, 2, NUM_BLOCKS[role], 4, 2, head_dim, generator=g).to(dtype).to(device_of(role, where))


def layout_of(cache: torch.Tensor) -> KVLayout:
    return KVLayout(cache.shape[0], cache.shape[4], cache.shape[5], cache.shape[3], cache.shape[2],
                    str(cache.dtype).removeprefix("torch."), cache.shape[4])


def make_plan(seed: int = 0) -> list[TransferSpec]:
    """Transfers of 1-5 blocks, from random P blocks into distinct random D blocks."""
    rng = random.Random(seed)
    d_free = list(range(NUM_BLOCKS["d"]))
    rng.shuffle(d_free)
    plan = []
    for i in range(5):
        n = rng.randint(1, 3)
        plan.append(TransferSpec(f"r{i}", 100 + i, rng.sample(range(NUM_BLOCKS["p"]), n), [d_free.pop() for _ in range(n)]))
    return plan


def open_link(role, where, backend, async_transfer, rendezvous, timeout_s=20.0, head_dim=8):
    cache = make_cache(role, where, head_dim)
    cfg = TransferConfig(backend=backend, async_transfer=async_transfer, timeout_s=timeout_s, lease_s=30.0,
                         connect_timeout_s=30.0)
    if role == "p":
        listener = Listener()
        rendezvous.put(listener.address)
        ch = listener.accept(30.0)
        listener.close()
    else:
        ch = Channel.connect(rendezvous.get(timeout=30.0))
    return PeerLink.open(role, ch, cache, layout_of(cache), cfg, session=0), cache


# -- scenarios: each is run by both sides ---------------------------------------------------------
def scenario_moves_blocks(role, where, backend, async_transfer, rendezvous):
    link, cache = open_link(role, where, backend, async_transfer, rendezvous)
    plan = {s.request_id: s for s in make_plan()}
    if role == "p":
        acks = set()
        deadline = time.monotonic() + 30
        while len(acks) < len(plan) and time.monotonic() < deadline:
            for msg in link.receive():
                if isinstance(msg, Accept):
                    link.transfer.start_send(plan[msg.request_id])
                    if not async_transfer:
                        link.transfer.poll(wait_for=msg.request_id)
                elif isinstance(msg, Ack):
                    acks.add(msg.request_id)
            link.transfer.poll()
            time.sleep(0.001)
        while link.alive and time.monotonic() < deadline and not any(isinstance(m, Bye) for m in link.receive()):
            time.sleep(0.001)
        link.close()
        return {"acks": sorted(acks)}
    before = cache.cpu().clone()
    reports: dict[str, list] = {}
    for spec in plan.values():
        link.transfer.start_recv(spec)
        link.send(Accept(spec.request_id, spec.tag, spec.dst_block_ids))
        for done in link.transfer.poll(wait_for=None if async_transfer else spec.request_id):
            reports.setdefault(done.request_id, []).append(done.error)
    deadline = time.monotonic() + 30
    while sum(map(len, reports.values())) < len(plan) and time.monotonic() < deadline:
        for done in link.transfer.poll():
            reports.setdefault(done.request_id, []).append(done.error)
        time.sleep(0.001)
    p_cache = make_cache("p", where).cpu()
    want = before.clone()
    for spec in plan.values():
        want[:, :, spec.dst_block_ids] = p_cache[:, :, spec.src_block_ids]
    exact = torch.equal(cache.cpu(), want)
    for rid in plan:
        link.send(Ack(rid))
    link.send(Bye())
    link.close()
    return {"reports": reports, "exact": exact}


def scenario_layout_mismatch(role, where, backend, async_transfer, rendezvous):
    try:
        open_link(role, where, backend, async_transfer, rendezvous, head_dim=16 if role == "d" else 8)
    except ConnectionError as e:
        return {"error": str(e)}
    return {"error": None}


def scenario_timeout_then_recover(role, where, backend, async_transfer, rendezvous):
    """P ignores the first Accept: D's transfer must time out, close must be prompt, the link still work."""
    link, cache = open_link(role, where, backend, async_transfer, rendezvous, timeout_s=1.0)
    first, second = make_plan()[:2]
    if role == "p":
        deadline = time.monotonic() + 30
        done = False
        while not done and link.alive and time.monotonic() < deadline:
            for msg in link.receive():
                if isinstance(msg, Accept) and msg.request_id == second.request_id:
                    link.transfer.start_send(second)
                done |= isinstance(msg, Bye)
            link.transfer.poll()
            time.sleep(0.001)
        link.close()
        return {}
    reports = []
    t0 = time.monotonic()
    link.transfer.start_recv(first)
    link.send(Accept(first.request_id, first.tag, first.dst_block_ids))
    while not reports and time.monotonic() - t0 < 20:
        reports += link.transfer.poll(wait_for=None if async_transfer else first.request_id)
        time.sleep(0.005)
    waited = time.monotonic() - t0
    link.transfer.start_recv(second)
    link.send(Accept(second.request_id, second.tag, second.dst_block_ids))
    later = []
    while not later and time.monotonic() - t0 < 20:
        later += link.transfer.poll(wait_for=None if async_transfer else second.request_id)
        time.sleep(0.005)
    p_cache = make_cache("p", where).cpu()
    ok = torch.equal(cache.cpu()[:, :, second.dst_block_ids], p_cache[:, :, second.src_block_ids])
    link.send(Bye())
    t1 = time.monotonic()
    link.close()
    return {"first": [(d.request_id, d.error) for d in reports], "waited": waited,
            "second": [(d.request_id, d.error) for d in later], "second_exact": ok, "close_s": time.monotonic() - t1}


SCENARIOS = {f.__name__: f for f in (scenario_moves_blocks, scenario_layout_mismatch, scenario_timeout_then_recover)}


def _side(role, scenario, backend, where, async_transfer, rendezvous, results):
    try:
        results.put((role, SCENARIOS[scenario](role, where, backend, async_transfer, rendezvous)))
    except BaseException as e:  # noqa: BLE001
        results.put((role, f"{type(e).__name__}: {e}"))


def run_pair(scenario, backend, where, async_transfer=True) -> dict:
    """Both sides of a scenario: threads on CPU, spawned processes on GPU. Returns {role: result}."""
    if where == "cpu":
        rendezvous, results = queue.Queue(), queue.Queue()
        workers = [threading.Thread(target=_side, args=(r, scenario, backend, where, async_transfer, rendezvous,
                                                        results), daemon=True) for r in ("p", "d")]
    else:
        ctx = mp.get_context("spawn")
        rendezvous, results = ctx.Queue(), ctx.Queue()
        workers = [ctx.Process(target=_side, args=(r, scenario, backend, where, async_transfer, rendezvous, results),
                               daemon=True) for r in ("p", "d")]
    for w in workers:
        w.start()
    out = {}
    try:
        for _ in workers:
            role, res = results.get(timeout=120)
            out[role] = res
    finally:
        for w in workers:
            w.join(10)
            if isinstance(w, mp.process.BaseProcess) and w.is_alive():
                w.kill()
    assert not any(w.is_alive() for w in workers), "a side did not finish"
    return out


@pytest.mark.parametrize("async_transfer", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("backend,where", CASES)
def test_moves_blocks_exactly(backend, where, async_transfer):
    out = run_pair("scenario_moves_blocks", backend, where, async_transfer)
    assert isinstance(out["d"], dict), out
    assert isinstance(out["p"], dict), out
    assert out["d"]["exact"], "D's cache must hold P's blocks bit for bit, and nothing else changed"
    assert out["d"]["reports"] == {s.request_id: [None] for s in make_plan()}, "each transfer reported once, ok"
    assert out["p"]["acks"] == sorted(s.request_id for s in make_plan())


@pytest.mark.parametrize("backend,where", CASES)
def test_layout_mismatch_is_refused_by_both_sides(backend, where):
    out = run_pair("scenario_layout_mismatch", backend, where)
    for role in ("p", "d"):
        assert isinstance(out[role], dict) and out[role]["error"] is not None, out
        assert "KVLayout.head_dim" in out[role]["error"]


@pytest.mark.parametrize("async_transfer", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("backend,where", [c for c in CASES if c.values[0] == "torch_dist" and c.values[1] != "cuda2"])
def test_transfer_that_never_completes_times_out(backend, where, async_transfer):
    # A pulling backend (cuda_ipc) needs nothing from P per transfer, so only a pushing one can stall.
    out = run_pair("scenario_timeout_then_recover", backend, where, async_transfer)
    d = out["d"]
    assert isinstance(d, dict), out
    assert len(d["first"]) == 1 and d["first"][0][0] == "r0" and "timed out" in d["first"][0][1]
    assert 0.9 < d["waited"] < 10
    assert d["second"] == [("r1", None)] and d["second_exact"], "the link still works after a timeout"
    assert d["close_s"] < 2.0


@pytest.mark.parametrize("role", ["p", "d"])
def test_torch_dist_post_that_fails_ends_the_transfer_with_its_error(role):
    """The peer died before this side posted its send or recv (gloo raises at once): the transfer completes at
    the next poll with that error, and nothing is left behind to poll again (it once stayed, half made, and the
    next poll raised AttributeError in the engine's step)."""
    from picovllm.disagg.transfer.torch_dist import TorchDistTransfer

    class DeadPeer:
        def send(self, *a):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

        recv = send

    cache = make_cache(role, "cpu")
    cfg = TransferConfig(backend="torch_dist", async_transfer=True, timeout_s=20.0, lease_s=30.0,
                         connect_timeout_s=30.0)
    t = TorchDistTransfer(role, cache, layout_of(cache), cfg)
    t.pg = DeadPeer()
    spec = make_plan()[0]
    (t.start_send if role == "p" else t.start_recv)(spec)
    done = t.poll()
    assert [d.request_id for d in done] == [spec.request_id]
    assert "KV transfer failed: Connection closed by peer" in done[0].error
    assert t.poll() == []
