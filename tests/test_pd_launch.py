"""PD across hosts: host options, a role whose worker connects from elsewhere, and the torchrun launch.

The launch runs as on two nodes, but on this one: `torchrun --standalone --nproc-per-node 2`, rank 0
= driver + P engine, rank 1 = D engine, with the host options given explicitly. The oracle is the
colocated LLM.generate on the same checkpoint.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import build_tiny_checkpoint
from picovllm import LLM, SamplingParams
from picovllm.disagg import DisaggLLM, TransferConfig
from picovllm.disagg.auth import FleetSecret
from picovllm.disagg.channel import Listener
from picovllm.disagg.hosts import HostOptions
from picovllm.disagg.worker import worker_main
from test_disagg_processes import assert_clean, random_prompts, same_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "launch-test-secret-0123456789"
GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_thread_in_children):
    """One intra-op thread here and in the spawned engines and ranks."""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("launch") / "qwen2"), "qwen2")


def other_address() -> str | None:
    """An address of this machine that is not loopback (None if it has none)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))           # TEST-NET-1: picks the outgoing interface, sends nothing
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def launch(tmp_path, model: str, lines: list[dict], *extra: str, timeout: float = 120, secret: str | None = SECRET) \
        -> tuple:
    """Run the launch under torchrun on 2 local ranks; (process, output records, s from output to exit)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("PICOVLLM_PD_SECRET", None)
    if secret is not None:
        env["PICOVLLM_PD_SECRET"] = secret
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "picovllm.disagg.launch", "--model", model, "-i", str(inp), "-o", str(out),
           "--block-size", "4", "--num-kv-blocks", "64", "--decode-num-kv-blocks", "12", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    done = time.time()
    if not out.exists():
        return proc, [], None
    return proc, [json.loads(x) for x in out.read_text().splitlines()], done - out.stat().st_mtime


def parity_lines(n: int = 6) -> tuple[list[dict], list[list[int]], list[SamplingParams]]:
    prompts = random_prompts(n, seed=11, max_len=40)
    kinds = [GREEDY, GREEDY, SEEDED]
    lines = [{"id": f"r{i}", "prompt_token_ids": p, **kinds[i % 3]} for i, p in enumerate(prompts)]
    return lines, prompts, [SamplingParams(**kinds[i % 3]) for i in range(n)]


@pytest.mark.parametrize("host,extra", [("127.0.0.1", []), ("other", []), ("127.0.0.1", ["--decode-tp", "2"])],
                         ids=["loopback", "other-address", "decode-tp2"])
def test_torchrun_launch_equals_colocated(tmp_path, model, host, extra):
    """Rank 0 (driver + P) and rank 1 (D) bound to one given interface; a D cache of 12 blocks forces flow control.
    decode-tp2: rank 1's engine spawns its own TP rank rather than joining torchrun's world."""
    if host == "other":
        host = other_address()
        if host is None:
            pytest.skip("this machine has no address besides loopback")
    lines, prompts, params = parity_lines()
    ref = LLM(model, block_size=4, num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    proc, recs, exit_after = launch(tmp_path, model, lines, "--host", host, *extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["id"] for r in recs] == [line["id"] for line in lines]
    assert [r["token_ids"] for r in recs] == [r.outputs[0].token_ids for r in ref]
    assert all(r["finish_reason"] == "length" and r["ttft_s"] > 0 and len(r["itl_s"]) == 7 for r in recs)
    assert exit_after < 5, f"torchrun exited {exit_after:.1f} s after rank 0 wrote the outputs"


def test_launch_refuses_a_bad_host_at_once(tmp_path, model):
    t0 = time.monotonic()
    proc, recs, _ = launch(tmp_path, model, parity_lines(1)[0], "--host", "no such host!", timeout=60)
    assert proc.returncode != 0 and not recs
    assert "ValueError: host must be an IP address or a host name" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 30


def test_launch_without_the_secret_stops_at_once(tmp_path, model):
    """Neither rank starts (no socket opened, no engine loaded) without the P/D secret, and says which flag."""
    t0 = time.monotonic()
    proc, recs, _ = launch(tmp_path, model, parity_lines(1)[0], timeout=60, secret=None)
    assert proc.returncode != 0 and not recs
    assert "--pd-secret-file" in proc.stderr and "PICOVLLM_PD_SECRET" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 30


def test_bad_host_options_are_value_errors_naming_the_field(model):
    # all refused before any process or socket is made
    with pytest.raises(ValueError, match="^host must be an IP address"):
        DisaggLLM(model, host="no such host!")
    with pytest.raises(ValueError, match="^advertise_host must be an address peers can connect to"):
        DisaggLLM(model, advertise_host="0.0.0.0")
    with pytest.raises(ValueError, match="^advertise_host is required with host '0.0.0.0'"):
        DisaggLLM(model, host="0.0.0.0")
    with pytest.raises(ValueError, match="^remote_roles must be"):
        DisaggLLM(model, remote_roles=("x",))
    with pytest.raises(ValueError, match="^listener: with remote_roles"):
        DisaggLLM(model, remote_roles=("d",))
    lst = Listener("127.0.0.1")
    try:
        with pytest.raises(ValueError, match="^secret: with remote_roles"):
            DisaggLLM(model, remote_roles=("d",), listener=lst)
    finally:
        lst.close()
    with pytest.raises(ValueError, match="^TransferConfig.host must be"):
        TransferConfig(host="999.1.1.1")
    with pytest.raises(ValueError, match="^TransferConfig.advertise_host must be"):
        TransferConfig(advertise_host="")
    assert HostOptions("0.0.0.0", "node-1.cluster").reach == "node-1.cluster"


def test_sockets_bind_only_the_given_interface():
    """The driver's and P's listeners, and P's torch_dist rendezvous, listen where they are told, and say so."""
    addr = other_address()
    if addr is None:
        pytest.skip("this machine has no address besides loopback")
    from picovllm.disagg.messages import KVLayout
    from picovllm.disagg.transfer import make_transfer
    import torch

    layout = KVLayout(1, 1, 2, 4, 2, "float32", 1)
    cache = torch.zeros(layout.block_shape(2))
    p = make_transfer("p", cache, layout, TransferConfig(host="127.0.0.1", advertise_host="localhost"))
    store_host, store_port = p.local_info()["store"]
    lst = Listener("127.0.0.1", advertise_host="localhost")
    try:
        assert store_host == "localhost" and lst.address[0] == "localhost"
        for port in (store_port, lst.address[1]):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((addr, port), timeout=5)
    finally:
        lst.close()
        p.close()


def test_remote_decode_worker_dying_fails_its_requests(model):
    """A D worker DisaggLLM did not spawn (as under the launch) dies mid-transfer: P frees what it held, stays up."""
    secret = FleetSecret(SECRET.encode())
    listener = Listener("127.0.0.1", secret=secret)
    remote = mp.get_context("spawn").Process(target=worker_main, args=("d", listener.address, HostOptions(), secret))
    remote.start()
    llm = DisaggLLM(model, block_size=4, num_kv_blocks=64, remote_roles=("d",), listener=listener, lease_s=5.0,
                    secret=secret)
    try:
        assert set(llm.procs) == {"p"}
        sp = SamplingParams(**GREEDY)
        ok = llm.generate([[1, 2, 3], [4, 5, 6, 7]], sp)            # a whole session with the remote D first
        assert same_tokens(ok, LLM(model, block_size=4, num_kv_blocks=64).generate([[1, 2, 3], [4, 5, 6, 7]], sp,
                                                                                    use_tqdm=False))
        s = llm.session(fault={"d": "exit:Accept:2"})     # D exits right after its second Accept
        ids = [s.submit(p, sp) for p in random_prompts(5, seed=1, max_len=30)]
        s.close()
        s.wait(timeout_s=10)
        assert "d" in llm.gone and "remote" in llm.gone["d"] and "p" in s.ended
        assert_clean(s)
        errs = [s.results[r].error for r in ids if s.results[r].error]
        # a request whose KV was in flight when D died ends with the transfer's error, the others with D's loss
        assert errs and all("decode engine" in e or e.startswith("KV transfer failed") for e in errs), errs
        assert llm.procs["p"].is_alive()
    finally:
        llm.shutdown()
        remote.join(10)
        assert remote.exitcode == 3
