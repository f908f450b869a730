"""Prefill/decode disaggregation: a P engine computes prompts, a D engine decodes, KV moves between.

Roles (EngineConfig.role): "pd" is the colocated Engine; "p" and "d" are the same Engine with a KV
connector (the seam: picovllm/engine/kv_connector.py): PrefillConnector (prefill.py) and
DecodeConnector (decode.py) speak the handover protocol over a control channel (messages.py,
channel.py, link.py). The engine's surface for a session: connect, submit, step, close, is_done, abort.
The KV transfer is its own layer under the connectors (transfer/base.py holds the contract; one
module per backend).

    driver process (DisaggLLM / generate_disaggregated)
       | Submit, Abort, CloseSession            ^ Output (finals), SessionEnded
       v                                        |
    +--------------------------+  Offer ------------------->  +--------------------------+
    | P engine (role "p")      |  <------ Accept(dst blocks)  | D engine (role "d")      |
    |  prefill + first token   |  ==== KV blocks ==========>  |  allocate when room      |
    |  request parked, blocks  |      torch_dist: P sends     |  (flow control), write   |
    |  held until Ack/Release  |      cuda_ipc:   D pulls     |  KV, decode to the end   |
    |  frees blocks on Ack     |  <------ Ack / Release       |                          |
    +--------------------------+  Cancel (aborts) -------->   +--------------------------+
               heartbeats both ways; a peer silent for lease_s, or whose socket closes, is dead

Lifecycle of a session and the close call ("no more requests"):
    1. link:   P sends Hello(layout, backend info); D checks the layout and answers; the backend
               connects (process group / mapping P's cache). Heartbeats start.
    2. serve:  requests flow as above; P's cache is the buffer while D is full.
    3. close:  P.close(): submit() now raises EngineClosedError; P finishes every prefill and
               hands everything over; when nothing is left it sends EndOfStream.
    4. drain:  D, on EndOfStream (nothing of P's is in flight by then), unmaps/releases the link,
               sends Bye and decodes what it has to the end; P, on Bye, closes its end.
    5. done:   both is_done(); in a worker process the session ends and the process can exit.

Faults: an abort anywhere frees KV on both sides (P holds a handed-over request's blocks until D
answers Ack or Release; a Cancel after the Ack aborts it on D). D dead or silent for lease_s:
P fails what it was handing over and frees it, and keeps serving (later handovers fail at
once). P dead: D fails the offers and transfers it was waiting for, frees them, decodes the
rest, and ends. A transfer not done within timeout_s fails on both sides.

A fleet (many P and many D behind `picovllm router`, any P to any D) uses the same seam with other
connectors: fleet_prefill.py publishes a request's KV, fleet_decode.py claims, pulls and releases it,
through a PullTransfer (transfer/base.py; tcp or nixl); see fleet_server.py and router.py.

Different TP sizes (P TP=2 -> D TP=1, 1 -> 2, ...): each engine's rank 0 gathers its ranks' KV
heads into full heads before sending, or scatters each rank its heads after receiving
(picovllm.engine.tp_kv; docs/tensor_parallel.md). torch_dist only; cuda_ipc needs TP=1 on both.
"""
import importlib

# What each public name is imported from: the package imports them when first used, so that
# `picovllm --help` (whose parser takes the PD flags from disagg/cli.py) does not load torch.
_EXPORTS = {
    "DisaggLLM": "picovllm.disagg.driver", "DisaggSession": "picovllm.disagg.driver",
    "generate_disaggregated": "picovllm.disagg.driver", "DecodeConnector": "picovllm.disagg.decode",
    "PrefillConnector": "picovllm.disagg.prefill", "EngineClosedError": "picovllm.engine.llm_engine",
    "BACKENDS": "picovllm.disagg.transfer", "TransferConfig": "picovllm.disagg.transfer",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
