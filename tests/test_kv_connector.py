"""The KV-connector seam (picovllm/engine/kv_connector.py) with a connector written for the test.

Two in-process connectors hand requests from one Engine to another through a Python mailbox:
the sender copies a held request's blocks out of its cache in start_send, the receiver writes
them into the blocks the scheduler allocated in start_recv. Nothing of picovllm.disagg is used,
so what is tested is the contract itself: the hooks are called when their docstrings say, the
scheduler moves the requests, a connector's answer keeps blocks allocated, and the two engines
together make the colocated engine's tokens. conftest checks every block is free afterwards.
"""
from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from picovllm import LLM, EngineConfig, SamplingParams
from picovllm.engine.kv_connector import ConnectorReport, KVConnector
from picovllm.engine.llm_engine import Engine
from picovllm.engine.request import Request, RequestStatus


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # tiny models on a shared 2-core machine


class Mailbox:
    def __init__(self) -> None:
        self.offers: deque = deque()     # sender -> receiver: (request fields, num_kv_tokens, KV blocks)
        self.acks: deque = deque()       # receiver -> sender: request ids whose KV arrived


class Sender(KVConnector):
    def __init__(self, box: Mailbox, log: list) -> None:
        self.box, self.log = box, log
        self.engine: Engine | None = None
        self.sending: dict[str, Request] = {}

    def hold_after_prefill(self, req: Request) -> bool:
        self.log.append(("hold", req.request_id, req.num_pending_tokens, len(req.output_token_ids)))
        return True

    def request_finished(self, req: Request) -> bool:
        return req.request_id in self.sending       # the receiver may still be reading them

    def start_send(self, req: Request) -> None:
        assert req.request_id in self.engine.scheduler.held and req not in self.engine.scheduler.running
        self.log.append(("send", req.request_id, req.num_pending_tokens, len(req.output_token_ids)))
        bs = self.engine.block_manager.block_size
        blocks = req.block_table[:-(-req.num_computed_tokens // bs)]
        kv = self.engine.runner.kv_cache[:, :, blocks].clone()
        fields = (req.request_id, list(req.prompt_token_ids), list(req.output_token_ids), req.params, req.max_tokens)
        self.box.offers.append((fields, req.num_computed_tokens, kv))
        self.sending[req.request_id] = req

    def poll(self, idle: bool) -> ConnectorReport:
        rep = ConnectorReport()
        while self.box.acks:
            rid = self.box.acks.popleft()
            if self.sending.pop(rid, None) is not None:
                rep.released.append(rid)
        return rep


class Receiver(KVConnector):
    def __init__(self, box: Mailbox, log: list) -> None:
        self.box, self.log = box, log
        self.engine: Engine | None = None
        self.offered: dict[str, tuple[int, torch.Tensor]] = {}
        self.arriving: list[str] = []

    def num_external_tokens(self, req: Request) -> int:
        if req.request_id not in self.offered:
            return 0
        self.log.append(("asked", req.request_id))
        return self.offered[req.request_id][0]

    def answers_for(self, req: Request) -> bool:
        return req.request_id not in self.offered and req.request_id not in self.arriving

    def start_recv(self, req: Request) -> None:
        n, kv = self.offered.pop(req.request_id)
        bs = self.engine.block_manager.block_size
        assert req.num_computed_tokens == n and len(req.block_table) * bs >= n + 1
        assert req.request_id in self.engine.scheduler.held and req.status == RequestStatus.WAITING
        self.log.append(("recv", req.request_id))
        self.engine.runner.kv_cache[:, :, req.block_table[:kv.shape[2]]] = kv
        self.arriving.append(req.request_id)

    def poll(self, idle: bool) -> ConnectorReport:
        rep = ConnectorReport(arrived=self.arriving)
        self.box.acks.extend(self.arriving)
        self.arriving = []
        while self.box.offers:
            (rid, prompt, output, params, max_tokens), n, kv = self.box.offers.popleft()
            req = Request(rid, prompt, params)
            req.output_token_ids, req.max_tokens = output, max_tokens
            self.offered[rid] = (n, kv)
            rep.offered.append(req)
        return rep


def linked_pair(path: str, overlap: bool, p_kw: dict, d_kw: dict) -> tuple[Engine, Engine, list]:
    box, log = Mailbox(), []
    engines = []
    for conn, kw in ((Sender(box, log), p_kw), (Receiver(box, log), d_kw)):
        eng = Engine(EngineConfig(path, async_scheduling=overlap, **kw), connector=conn)
        conn.engine = eng
        engines.append(eng)
    return engines[0], engines[1], log


def run_pair(p: Engine, d: Engine, limit: int = 2000) -> dict:
    finals = {}
    for _ in range(limit):
        for out in p.step() + d.step():
            if out.finished:
                assert out.request_id not in finals, "two final outputs for one request"
                finals[out.request_id] = out
        if not (p.has_unfinished_requests() or d.has_unfinished_requests()):
            return finals
    raise AssertionError("the pair did not finish")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
def test_handover_through_the_hooks_equals_colocated(tiny_models, overlap):
    ps = prompts(12)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)]         # done on the sender
    params = [params[i % 3] for i in range(len(ps))]
    ref = LLM(tiny_models["qwen3"], block_size=4, num_kv_blocks=256).generate(ps, params, use_tqdm=False)
    # The receiver's 40 blocks of 4 cannot take every request at once: admission waits for room.
    p, d, log = linked_pair(tiny_models["qwen3"], overlap, dict(block_size=4, num_kv_blocks=256,
                                                                 max_num_batched_tokens=16),
                            dict(block_size=4, num_kv_blocks=40))
    ids = [p.add_request(x, sp) for x, sp in zip(ps, params)]
    finals = run_pair(p, d)
    for rid, r in zip(ids, ref):
        assert finals[rid].outputs[0].token_ids == r.outputs[0].token_ids, rid
        assert finals[rid].outputs[0].finish_reason == r.outputs[0].finish_reason
    assert p.stats.decode_tokens == 0 and d.stats.prefill_tokens == 0   # no recompute anywhere
    for rid, sp in zip(ids, params):
        events = [e for e in log if e[1] == rid and e[0] != "asked"]
        # Held when its prompt's last chunk was launched (token pending with overlap), sent once known.
        assert events[0] == ("hold", rid, 1, 0) if overlap else events[0][0] == "hold"
        if sp.max_tokens == 1:
            assert len(events) == 1            # finished at its first token: never sent
        else:
            assert events[1:] == [("send", rid, 0, 1), ("recv", rid)]
    sent = sum(e[0] == "send" for e in log)
    assert sum(e[0] == "asked" for e in log) > sent, "meant to make the receiver wait for room"


def test_blocks_stay_held_while_the_connector_uses_them(tiny_models):
    p, d, _ = linked_pair(tiny_models["llama"], False, dict(block_size=4, num_kv_blocks=32),
                          dict(block_size=4, num_kv_blocks=32))
    bm = p.block_manager
    rid = p.add_request(prompts(1, seed=5)[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    while rid not in p.connector.sending:
        p.step()
    req = p.requests[rid]
    blocks = list(req.block_table)
    assert blocks and rid in p.scheduler.held and not p.scheduler.running
    out = p.abort(rid)                          # the sender answers for it: a final output now...
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert p.abort(rid) is None                 # ...once
    assert all(bm.ref_counts[b] == 1 for b in blocks), "freed while the connector still reads them"
    assert p.has_unfinished_requests() and not p.is_done()
    p.connector.box.offers.clear()              # the receiver never takes it, but lets go
    p.connector.box.acks.append(rid)
    p.step()
    assert bm.num_free_blocks == bm.num_blocks and not p.requests and not p.scheduler.held
    p.close()
    assert p.is_done()
