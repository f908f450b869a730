"""Prefill/decode disaggregation across hosts, under torchrun: rank 0 = driver + P engine, rank 1 = D engine.

    # node 0 (10.0.0.1): the driver and the prefill engine; reads the prompts, writes the outputs
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr 10.0.0.1 --master-port 29500 \\
        -m picovllm.disagg.launch --model /models/M --host 10.0.0.1 -i prompts.jsonl -o outputs.jsonl
    # node 1 (10.0.0.2): the decode engine
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 10.0.0.1 --master-port 29500 \\
        -m picovllm.disagg.launch --host 10.0.0.2

(or both ranks on one host: torchrun --standalone --nproc-per-node 2 -m picovllm.disagg.launch ...).

torchrun's world is only where the two ranks meet. Rank 0 opens the driver's listener on --host and
puts its address, as JSON, in torchrun's rendezvous store (MASTER_ADDR:MASTER_PORT); rank 1 reads it
and runs the decode worker (picovllm.disagg.worker.worker_main), which connects to the driver. From
then on it is the one-host protocol with the decode role remote: the driver sends rank 1 its engine
config (so node 1 needs the same model path, and only its own --host / --advertise-host flags),
the P worker's link address and the torch_dist rendezvous travel in the usual messages, and the
close call drains both engines; at Shutdown rank 1 exits 0, then rank 0 writes the outputs and exits
(0, or 1 if a request failed). The store, not a gloo broadcast, carries the address: a gloo group
would bind the interface the hostname resolves to, which on many machines is loopback.
Both ranks need the P/D secret (--pd-secret-file FILE or $PICOVLLM_PD_SECRET, the same on both
hosts): the driver's listener and P's link listener refuse a peer that cannot prove it
(picovllm.disagg.auth). torchrun's store and torch_dist's process group are not authenticated:
keep the network private.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch.distributed as dist

from picovllm.disagg.auth import FleetSecret
from picovllm.disagg.channel import Listener
from picovllm.disagg.cli import add_disagg_arguments, disagg_options
from picovllm.disagg.hosts import HostOptions, check_host, is_wildcard, route_address
from picovllm.entrypoints.batch_io import BatchItem, read_batch, result_record
from picovllm.entrypoints.commands.args import add_model_and_engine_args, add_sampling_args, sampling_kwargs

DRIVER_KEY = "picovllm/disagg-launch/driver"
MEET_TIMEOUT_S = 300.0
# torchrun's description of its world; an engine that saw it would take it for a tensor-parallel world
TORCHRUN_WORLD = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m picovllm.disagg.launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Rank 1 uses only --host and --advertise-host: rank 0 configures both engines.")
    p.add_argument("--input", "-i", default=None, help="prompts, one JSON object a line (the format of "
                   "`picovllm batch`: prompt or prompt_token_ids, optional id and SamplingParams fields)")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable; after --input's)")
    p.add_argument("--output", "-o", default="-", help="output JSONL file (default: stdout)")
    add_sampling_args(p)
    add_model_and_engine_args(p)
    add_disagg_arguments(p, switch=False)
    p.add_argument("--pd-secret-file", default=None, help="the P/D shared secret, the same on both ranks (first "
                   "line of the file; default $PICOVLLM_PD_SECRET)")
    return p


def rank_hosts(args: argparse.Namespace, rank: int, master_addr: str) -> HostOptions:
    """This rank's HostOptions. With --host 0.0.0.0 and no --advertise-host, rank 0 is reached at
    MASTER_ADDR (node 0) and rank 1 at its own address on the route to it."""
    check_host("host", args.host)
    if args.advertise_host is None and is_wildcard(args.host):
        return HostOptions(args.host, master_addr if rank == 0 else route_address(master_addr))
    return HostOptions(args.host, args.advertise_host)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank, world = int(os.environ.get("RANK", "-1")), int(os.environ.get("WORLD_SIZE", "0"))
    if rank not in (0, 1) or world != 2:
        raise SystemExit("picovllm.disagg.launch runs under torchrun with 2 processes in all (WORLD_SIZE=2): "
                         f"rank 0 = driver + prefill, rank 1 = decode; got RANK={rank}, WORLD_SIZE={world}")
    hosts = rank_hosts(args, rank, os.environ["MASTER_ADDR"])
    try:
        secret = FleetSecret.load(args.pd_secret_file)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=MEET_TIMEOUT_S)))
    if rank == 1:
        address = _driver_address(store.get(DRIVER_KEY))
        _leave_world()
        from picovllm.disagg.worker import worker_main
        worker_main("d", address, hosts, secret)   # serves until the driver's Shutdown; never returns
    listener = Listener(hosts.host, advertise_host=hosts.advertise_host, secret=secret)
    store.set(DRIVER_KEY, json.dumps({"driver": listener.address}))
    _leave_world()
    return run_driver(args, hosts, listener)


def run_driver(args: argparse.Namespace, hosts: HostOptions, listener: Listener) -> int:
    """Rank 0: the P engine in a process of its own, the D engine remote; one session, then the outputs."""
    from picovllm.disagg.driver import DisaggLLM

    items = read_batch(args.input, sampling_kwargs(args), _NoChatTemplate()) if args.input else []
    items += [_text_item(len(items) + i, text, args) for i, text in enumerate(args.prompt)]
    if not items:
        raise SystemExit("give --input FILE or at least one --prompt")
    options = {**disagg_options(args), "host": hosts.host, "advertise_host": hosts.advertise_host}
    with DisaggLLM(args.model, remote_roles=("d",), listener=listener, secret=listener.secret, **options) as llm:
        session = llm.session()
        ids: dict[int, str] = {}
        for item in items:
            if item.error is None:
                try:
                    ids[item.index] = session.submit(item.prompt, item.params)
                except ValueError as e:
                    item.error = f"line {item.index + 1}: {e}"
        session.close()                            # no more requests: P drains, hands over, D drains, Bye
        session.wait_submitted()
        session.wait()
    return _write_outputs(args.output, items, ids, session)


def _write_outputs(path: str, items: list[BatchItem], ids: dict[int, str], session) -> int:
    failed = 0
    out_file = sys.stdout if path == "-" else open(path, "w")
    try:
        for item in items:
            rid = ids.get(item.index)
            if rid in session.rejected:
                item.error = f"line {item.index + 1}: {session.rejected[rid]}"
            out = None if item.error is not None else session.results[rid]
            rec = result_record(item, out)      # (an output's error in "error")
            if out is not None and not out.error and out.metrics is not None and out.metrics.ttft is not None:
                rec["ttft_s"], rec["itl_s"] = out.metrics.ttft, out.metrics.itls
            failed += "error" in rec
            out_file.write(json.dumps(rec) + "\n")
    finally:
        if out_file is not sys.stdout:
            out_file.close()
    if failed:
        print(f"picovllm.disagg.launch: {failed} of {len(items)} requests failed (see their \"error\" field)",
              file=sys.stderr)
    return 1 if failed else 0


def _driver_address(raw: bytes) -> list:
    """Rank 0's message, checked: {"driver": [host, port]}."""
    try:
        host, port = json.loads(raw)["driver"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{DRIVER_KEY}: expected {{\"driver\": [host, port]}}, got {raw[:200]!r}") from e
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"{DRIVER_KEY}: driver port must be an int in 1..65535, got {port!r}")
    return [check_host(f"{DRIVER_KEY} driver host", host), port]


def _leave_world() -> None:
    for name in TORCHRUN_WORLD:
        os.environ.pop(name, None)


def _text_item(index: int, text: str, args: argparse.Namespace) -> BatchItem:
    from picovllm.sampling_params import SamplingParams
    return BatchItem(index, prompt=text, params=SamplingParams(**sampling_kwargs(args)))


class _NoChatTemplate:
    """read_batch's stand-in for an LLM: the driver loads no tokenizer, so "messages" lines are refused."""

    def apply_chat_template(self, messages):
        raise ValueError("field 'messages' is not supported by picovllm.disagg.launch: give 'prompt' or "
                         "'prompt_token_ids'")


if __name__ == "__main__":
    sys.exit(main())
