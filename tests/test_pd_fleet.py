"""A fleet in one process: several P and D engines with the fleet connectors and the tcp PullTransfer over
real sockets, no pairwise link; this test plays the router (any P's handle goes to any D).

Oracle: the colocated engine (LLM) on the same weights, token for token. Faults: a D that dies (its
sockets drop) mid-run, a D added while running, leases, a peer without the fleet's secret. conftest
checks every engine ends every test with every block free.
"""
from __future__ import annotations

import itertools
import socket
import threading
import time
import uuid

import pytest
import torch

from picovllm import LLM, EngineConfig, SamplingParams
from picovllm.disagg.auth import FleetSecret
from picovllm.disagg.fleet_decode import FleetDecodeConnector
from picovllm.disagg.fleet_prefill import FleetPrefillConnector
from picovllm.disagg.messages import KVAuthChallenge, KVAuthResult, PublishedKV, from_wire
from picovllm.disagg.transfer import PullConfig
from picovllm.disagg.transfer.host_tcp import HostTcpTransfer
from picovllm.disagg.transfer.kv_socket import recv_frame, send_frame
from picovllm.disagg.transfer.nixl import import_nixl
from picovllm.engine.llm_engine import Engine
from test_disagg_engines import assert_same, mixed_params, prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SECRET = FleetSecret(b"fleet-test-secret-0123456789")
KW = dict(block_size=4, num_kv_blocks=256)


def pull_config(secret=SECRET, **kw) -> PullConfig:
    return PullConfig(secret, instance_id=uuid.uuid4().hex[:12], **kw)


def nixl_or_skip() -> None:
    try:
        import_nixl()
    except ImportError as e:
        pytest.skip(str(e))


def fleet_engine(path: str, role: str, config: PullConfig | None = None, **kw) -> Engine:
    conn = (FleetPrefillConnector if role == "p" else FleetDecodeConnector)(config or pull_config())
    eng = Engine(EngineConfig(path, role=role, **{**KW, **kw}), connector=conn)
    conn.open(eng.executor)
    return eng


class Fleet:
    """P and D engines stepped in turn; each published request goes to the next D (round-robin)."""

    def __init__(self, ps: list[Engine], ds: list[Engine]) -> None:
        self.ps, self.ds = ps, ds
        self.finals: dict[str, object] = {}
        self.routed: dict[str, Engine] = {}
        self._next_p, self._next_d = itertools.count(), itertools.count()

    def submit(self, prompt, params) -> str:
        n = next(self._next_p)          # ids unique across the fleet, as the router makes them
        return self.ps[n % len(self.ps)].submit(prompt, params, request_id=f"req-{n}")

    def step(self) -> None:
        for eng in self.ps + self.ds:
            for out in eng.step():
                if out.kv_handover is not None:
                    d = self.ds[next(self._next_d) % len(self.ds)]
                    offer = from_wire(out.kv_handover, PublishedKV)
                    d.connector.check(offer)
                    d.connector.offer(offer)
                    self.routed[out.request_id] = d
                elif out.finished:
                    assert out.request_id not in self.finals, "two final outputs for one request"
                    self.finals[out.request_id] = out

    def run(self, ids, timeout_s: float = 60.0, each_step=None) -> None:
        t0 = time.monotonic()
        while not (all(i in self.finals for i in ids) and self.idle()):
            self.step()
            if each_step is not None:
                each_step()
            assert time.monotonic() - t0 < timeout_s, f"the fleet did not finish: {set(ids) - set(self.finals)}"

    def idle(self) -> bool:
        return not any(e.has_unfinished_requests() for e in self.ps + self.ds)

    def close(self) -> None:
        for eng in self.ps + self.ds:
            eng.connector.shutdown()


@pytest.fixture(scope="module")
def path(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def reference(path):
    ps = prompts() * 2
    params = [mixed_params()[i % 4] for i in range(len(ps))]
    return ps, params, LLM(path, **KW).generate(ps, params, use_tqdm=False)


@pytest.mark.parametrize("backend", ["tcp", "nixl", "cuda_ipc"])   # cuda_ipc on CPU: shared memory
@pytest.mark.parametrize("num_p,num_d", [(2, 1), (1, 2)])
def test_many_to_many_equals_colocated(path, reference, num_p, num_d, backend):
    if backend == "nixl":
        nixl_or_skip()
    ps, params, ref = reference
    # D's cache is small (30 blocks of 4) so offers wait for room: P's cache holds their KV meanwhile.
    fleet = Fleet([fleet_engine(path, "p", pull_config(backend=backend), max_num_batched_tokens=8)
                   for _ in range(num_p)],
                  [fleet_engine(path, "d", pull_config(backend=backend), num_kv_blocks=30 if num_d == 1 else 256)
                   for _ in range(num_d)])
    try:
        ids = [fleet.submit(p, sp) for p, sp in zip(ps, params)]
        waited = 0

        def count_waiting():
            nonlocal waited
            waited += sum(bool(d.connector.offers) for d in fleet.ds)

        fleet.run(ids, each_step=count_waiting)
        assert_same([fleet.finals[i] for i in ids], ref)
        assert all(p.connector.stats["published"] > 0 for p in fleet.ps)
        assert all(d.connector.stats["pulled"] > 0 for d in fleet.ds)
        assert sum(p.connector.stats["released"] for p in fleet.ps) == sum(d.connector.stats["pulled"]
                                                                           for d in fleet.ds)
        if num_d == 1:
            assert waited, "the decode cache was meant to be too small to take every request at once"
    finally:
        fleet.close()


def test_decode_dies_mid_run_and_one_joins(path, reference):
    """1P2D: D0 dies with requests claimed and decoding (its sockets drop): P frees what D0 held at once,
    D0's requests end with an error there and nothing else is lost; D2 joins mid-run and takes work."""
    ps, params, ref = reference
    lease = 3.0                                   # what d0 had not claimed yet is freed by this
    p = fleet_engine(path, "p", pull_config(lease_s=lease))
    d0, d1 = fleet_engine(path, "d", max_num_seqs=1), fleet_engine(path, "d")   # d0: offers queue up
    fleet = Fleet([p], [d0, d1])
    d2 = None
    try:
        ids = [fleet.submit(x, sp) for x, sp in zip(ps[:8], params[:8])]
        claimed = set()
        while not (claimed and (d0.connector.pulling or d0.scheduler.running)):
            fleet.step()       # until P has seen d0 claim a request it has not pulled yet
            claimed = set(d0.connector.offers) & p.connector.transfer.claimed()
        d0.connector.shutdown()                   # "killed": its KV connections drop
        t0 = time.monotonic()
        while claimed & set(p.connector.published):
            p.step()                              # P frees what d0 claimed at once, not after the lease
            assert time.monotonic() - t0 < lease / 2
        fleet.ds = [d1]                           # the router drops the dead D; a new one joins
        d0.abort_all()                            # the dead engine's leftovers, so that it ends clean
        while d0.has_unfinished_requests():
            d0.step()
        d2 = fleet_engine(path, "d")
        fleet.ds.append(d2)
        more = [fleet.submit(x, sp) for x, sp in zip(ps[8:], params[8:])]
        survivors = [i for i in ids if fleet.routed.get(i) is not d0] + more
        fleet.run(survivors)
        want = dict(zip(ids + more, ref))
        assert_same([fleet.finals[i] for i in survivors], [want[i] for i in survivors])
        assert d2.connector.stats["pulled"] > 0, "the decode instance that joined took no work"
        assert not p.connector.published and not p.scheduler.held
    finally:
        fleet.close()
        if d2 is None:
            d0.connector.shutdown()


def test_leases(path):
    """An unclaimed handle is freed after the lease; a claimed one lives past it while its claimant is
    alive (heartbeats) and is freed at once when the claimant's connection drops."""
    p = fleet_engine(path, "p", pull_config(lease_s=0.8))
    d = HostTcpTransfer("d", p.runner.kv_cache.clone(), p.connector.transfer.layout, pull_config(lease_s=0.8))
    try:
        a = p.submit([5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
        b = p.submit([9, 8, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        handles = {}
        while len(handles) < 2:
            handles.update({o.request_id: from_wire(o.kv_handover, PublishedKV).handle for o in p.step()
                            if o.kv_handover})
        d.claim(handles[b])
        time.sleep(1.8)
        p.step()
        assert list(p.connector.published) == [b] and p.connector.stats["expired"] == 1, "a expired, b claimed"
        assert d.poll() == []
        d.close()                                 # the claimant's connection drops
        t0 = time.monotonic()
        while p.has_unfinished_requests():
            p.step()
            assert time.monotonic() - t0 < 2
        assert p.connector.stats["expired"] == 2 and a != b
    finally:
        d.close()
        p.connector.shutdown()


def test_peer_without_the_secret_is_refused(path):
    p = fleet_engine(path, "p")
    good = HostTcpTransfer("d", p.runner.kv_cache.clone(), p.connector.transfer.layout, pull_config())
    bad = HostTcpTransfer("d", p.runner.kv_cache.clone(), p.connector.transfer.layout,
                          pull_config(FleetSecret(b"not-the-fleet-secret-at-all")))
    try:
        p.submit([5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
        handle = None
        while handle is None:
            handle = next((from_wire(o.kv_handover, PublishedKV).handle for o in p.step() if o.kv_handover), None)
        bad.claim(handle)
        bad.start_pull(handle, list(range(len(handle.block_ids))))
        done = []
        t0 = time.monotonic()
        while len(done) < 1:
            done += bad.poll()
            assert time.monotonic() - t0 < 5
        assert done[0].error and "shared secret" in done[0].error, done
        assert bad.cache.abs().sum() == 0, "no KV may reach a peer without the secret"
        # A raw socket that answers the challenge with garbage gets refused, and nothing else
        with socket.create_connection(tuple(handle.address), timeout=5) as s:
            assert isinstance(recv_frame(s), KVAuthChallenge)
            send_frame(s, KVAuthResult(proof="x"))
            assert "authentication failed" in recv_frame(s).error
            assert s.recv(1) == b""
        # A server that cannot prove the secret is refused by D, which sends it nothing but its proof
        fake = socket.create_server(("127.0.0.1", 0))
        seen = []

        def impostor():
            conn, _ = fake.accept()
            send_frame(conn, KVAuthChallenge("00" * 32, handle.instance_id))
            seen.append(recv_frame(conn))
            send_frame(conn, KVAuthResult(proof="0" * 64))
            conn.settimeout(2)
            seen.append(conn.recv(1 << 16))
            conn.close()

        t = threading.Thread(target=impostor)
        t.start()
        forged = from_wire({"type": "KVHandle", "body": {**handle.__dict__, "layout": handle.layout.__dict__,
                                                         "address": ["127.0.0.1", fake.getsockname()[1]]}})
        good.claim(forged)
        done = []
        while not done:
            done += good.poll()
        t.join(5)
        fake.close()
        assert "did not prove" in done[0].error and seen[1] == b"", (done, seen)
        # with the secret, the same handle is claimed, pulled and released: P frees it
        good.claim(handle)
        good.start_pull(handle, list(range(len(handle.block_ids))))
        done = []
        while not done:
            done += good.poll()
        assert done[0].error is None
        good.release(handle)
        while p.has_unfinished_requests():
            p.step()
        assert p.connector.stats["released"] == 1
    finally:
        good.close()
        bad.close()
        p.connector.shutdown()


def test_prefill_gone_before_the_pull(path):
    """P dies after publishing: the D the request was routed to ends it with an error naming P, frees its
    blocks, and keeps serving."""
    p, d = fleet_engine(path, "p"), fleet_engine(path, "d")
    try:
        p.submit([5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=6, ignore_eos=True), request_id="r")
        handover = None
        while handover is None:
            handover = next((o.kv_handover for o in p.step() if o.kv_handover is not None), None)
        p.connector.shutdown()                    # "killed": its KV server is gone
        p.abort("r")                              # (the dead engine's leftovers, so that it ends clean)
        offer = from_wire(handover, PublishedKV)
        d.connector.check(offer)
        d.connector.offer(offer)
        final = None
        t0 = time.monotonic()
        while final is None or d.has_unfinished_requests():
            final = next((o for o in d.step() if o.finished), final)
            assert time.monotonic() - t0 < 10
        assert final.outputs[0].finish_reason == "error" and "prefill instance" in final.error, final.error
        assert d.connector.stats["failed"] == 1
    finally:
        p.connector.shutdown()
        d.connector.shutdown()


def test_a_decode_with_a_shorter_max_model_len_refuses_by_name(path):
    """A D whose max_model_len is below prompt + max_tokens (P resolved max_tokens against its own, longer one)
    refuses the request naming max_tokens; it had cut the output short at its own limit, finished "length". Both
    engines end with every block free."""
    p, d = fleet_engine(path, "p", max_model_len=512), fleet_engine(path, "d", max_model_len=64)
    fleet = Fleet([p], [d])
    try:
        ok = fleet.submit(list(range(5, 25)), SamplingParams(max_tokens=40, ignore_eos=True))
        long = fleet.submit(list(range(5, 45)), SamplingParams(max_tokens=60, ignore_eos=True))
        fleet.run([ok, long])
        assert len(fleet.finals[ok].outputs[0].token_ids) == 40
        out = fleet.finals[long]
        assert out.outputs[0].finish_reason == "error" and "max_tokens" in out.error and "64" in out.error, out.error
        for eng in (p, d):
            assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        fleet.close()


def test_nixl_reads_runs_of_blocks():
    """One descriptor a run of blocks consecutive on both sides (hand-worked): src 4 5 6 | 9 10 | 2 against dst
    7 8 9 10 11 12 breaks where src jumps; dst 1 2 | 5 6 against src 3 4 5 6 where dst jumps."""
    from picovllm.disagg.transfer.base import block_runs
    starts, runs = block_runs([4, 5, 6, 9, 10, 2], [7, 8, 9, 10, 11, 12])
    assert starts.tolist() == [0, 3, 5] and runs.tolist() == [3, 2, 1]
    starts, runs = block_runs([3, 4, 5, 6], [1, 2, 5, 6])
    assert starts.tolist() == [0, 2] and runs.tolist() == [2, 2]
    assert [a.tolist() for a in block_runs([], [])] == [[], []]


def test_claims_and_releases_go_before_queued_pulls():
    """D's connection to a P runs one message at a time; a claim (which P's lease waits for) or a release sent
    while pulls are queued runs before them, each kind in the order sent (hand-worked order)."""
    import queue
    from picovllm.disagg.messages import ClaimKV, PullKV, ReleaseKV
    from picovllm.disagg.transfer.kv_socket import PeerConnection
    order, running, gate = [], threading.Event(), threading.Event()
    peer = PeerConnection(("127.0.0.1", 9), pull_config(), queue.SimpleQueue(), threading.Event())

    def do(msg, handle, nbytes):             # stands in for the socket's round trip
        order.append(f"{type(msg).__name__}:{msg.request_id}")
        running.set()
        gate.wait(10)
    peer._do = do
    peer.submit(PullKV("a"), None)
    assert running.wait(10)                  # "a" is in flight; the rest queue behind it
    for msg in (PullKV("b"), ClaimKV("c"), PullKV("d"), ReleaseKV("e"), ClaimKV("f")):
        peer.submit(msg, None)
    peer.close()                             # after what was submitted
    gate.set()
    peer._thread.join(10)
    assert order == ["PullKV:a", "ClaimKV:c", "ReleaseKV:e", "ClaimKV:f", "PullKV:b", "PullKV:d"]
    assert not peer.alive


def _transfer_pair(device: str = "cpu", **d_kw):
    """A tcp P over a random bf16 cache and a D over a zeroed one (layout: 2 layers, 16 blocks of 4 x 2 x 8)."""
    from picovllm.disagg.messages import KVLayout
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(2, 2, 16, 4, 2, 8, generator=gen).to(torch.bfloat16).to(device)
    layout = KVLayout(2, 2, 8, 4, 16, "bfloat16", 2)
    p = HostTcpTransfer("p", src, layout, pull_config())
    d = HostTcpTransfer("d", torch.zeros_like(src), layout, pull_config(**d_kw))
    return p, d


def _settle(t, want: int, timeout_s: float = 10.0) -> list:
    done, t0 = [], time.monotonic()
    while len(done) < want:
        done += t.poll()
        time.sleep(0.001)
        assert time.monotonic() - t0 < timeout_s, done
    return done


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def test_tcp_pull_moves_scattered_blocks_exactly(device):
    """Blocks out of order and in runs on both sides land byte for byte where D asked (oracle: indexing the two
    caches), twice (the second pull reuses the first's host buffer: pinned, after its copy ended, on a GPU);
    P frees each on release. CPU caches are sent from the cache itself; a GPU's through pinned memory."""
    p, d = _transfer_pair(device)
    try:
        for n, (src_ids, dst_ids) in enumerate([([7, 3, 4, 5, 12, 0], [1, 2, 9, 10, 11, 5]),
                                                ([15, 14, 1, 2], [3, 4, 5, 0])]):
            handle = p.publish(f"r{n}", src_ids, 4 * len(src_ids))
            d.claim(handle)
            d.start_pull(handle, dst_ids)
            assert [x.error for x in _settle(d, 1)] == [None]
            assert torch.equal(d.cache[:, :, dst_ids], p.cache[:, :, src_ids])
            d.release(handle)
            assert [x.request_id for x in _settle(p, 1)] == [f"r{n}"]
        untouched = sorted(set(range(16)) - {1, 2, 9, 10, 11, 5, 3, 4, 0})
        assert d.cache[:, :, untouched].abs().sum() == 0
    finally:
        d.close()
        p.close()


def test_tcp_pull_time_limit_runs_from_the_wire():
    """D's pulls from one P run one at a time; those queued behind slow ones do not time out (each one's limit
    starts when it is sent: 4 x 0.4 s of reads under a 0.7 s limit all arrive), and one slower than the limit
    fails with an error."""
    p, d = _transfer_pair(timeout_s=0.7)
    read, delay = p._read_blocks, [0.4]

    def slow_read(block_ids):
        time.sleep(delay[0])
        return read(block_ids)
    p._read_blocks = slow_read
    try:
        handles = [p.publish(f"r{i}", [i], 4) for i in range(4)]
        for h in handles:
            d.claim(h)
        for i, h in enumerate(handles):
            d.start_pull(h, [8 + i])
        t0 = time.monotonic()
        done = _settle(d, 4)
        assert time.monotonic() - t0 > 1.2 and [x.error for x in done] == [None] * 4, (time.monotonic() - t0, done)
        assert torch.equal(d.cache[:, :, 8:12], p.cache[:, :, 0:4])
        delay[0] = 1.5
        d.start_pull(handles[0], [12])
        late = _settle(d, 1)            # (the connection's claims are reported lost with it)
        assert late[0].request_id == "r0" and "pull" in late[0].error, late
    finally:
        d.close()
        p.close()
