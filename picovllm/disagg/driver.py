"""The user's side of a disaggregated run on one host: P and D engines in their own processes.

    outs = generate_disaggregated(model, prompts, SamplingParams(temperature=0), backend="torch_dist")

or, keeping the engines up between calls (and for streaming submissions):

    with DisaggLLM(model, backend="cuda_ipc", prefill_device="cuda:0", decode_device="cuda:0") as llm:
        outs = llm.generate(prompts, params)            # one session: submit all, close, drain
        s = llm.session(async_transfer=False)           # the lower-level shape: submit, poll, close, is_done
        rid = s.submit("Hello", params); s.close(); s.wait()

Each session is a full lifecycle: link handshake, requests, the close call ("no more requests"),
drain, Bye. Worker processes are spawned (so a script using this needs an
`if __name__ == "__main__":` guard) and never outlive the driver (daemonic, or, when they run
tensor-parallel ranks of their own, watching their parent). P and D TP sizes may differ
(prefill={"tensor_parallel_size": 2}, decode={...}): KV heads are re-split on the way
(picovllm.engine.tp_kv; torch_dist backend only).

Across hosts: every socket of the run binds `host` (default 127.0.0.1) and is announced as
`advertise_host` (picovllm.disagg.hosts). A role in `remote_roles` is not spawned: its worker runs
worker_main on another host and connects to the driver's `listener` (picovllm.disagg.launch starts
it under torchrun and passes the listener, whose address it has told that host).

Every socket of the run authenticates its peer with the P/D secret (picovllm.disagg.auth): a
worker proves it to the driver's listener, D proves it to P's link listener. On one host the
driver makes a fresh secret per DisaggLLM and hands it to the workers it spawns; with remote roles
the caller passes the secret both hosts share (launch: --pd-secret-file or $PICOVLLM_PD_SECRET).
"""
from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import time
from typing import Sequence

from picovllm.config import EngineConfig
from picovllm.disagg.auth import FleetSecret
from picovllm.disagg.channel import Channel, Listener, PeerGone
from picovllm.disagg.hosts import HostOptions
from picovllm.disagg.messages import BuildEngine, Shutdown, WorkerHello, WorkerReady
from picovllm.disagg.session import NAMES, ROLES, DisaggSession
from picovllm.disagg.transfer import BACKENDS
from picovllm.disagg.worker import worker_main
from picovllm.entrypoints.llm import normalize_prompts
from picovllm.entrypoints.parallel_sampling import prompt_output, sample_params
from picovllm.generation_config import sampling_defaults
from picovllm.outputs import RequestOutput
from picovllm.sampling_params import SamplingParams


class DisaggLLM:
    """A P engine process and a D engine process on this host, linked by a KV-transfer backend.

    Engine options (EngineConfig fields) in **engine_kwargs apply to both sides; `prefill` and
    `decode` hold per-side overrides (e.g. decode={"num_kv_blocks": 64}). The transfer options
    are defaults for every session; session() and generate() can override them per call.
    host / advertise_host: where this driver and the workers it spawns bind and are reached;
    remote_roles: roles whose workers connect to `listener` from elsewhere (see the module doc);
    secret: the P/D secret every socket is authenticated with (default: a fresh one; required, and
    the listener's, with remote_roles).
    """

    def __init__(self, model: str | None = None, *, backend: str = "torch_dist", async_transfer: bool = True,
                 prefill_device: str = "auto", decode_device: str = "auto", prefill: dict | None = None,
                 decode: dict | None = None, transfer_timeout_s: float = 30.0, lease_s: float = 10.0,
                 connect_timeout_s: float = 60.0, startup_timeout_s: float = 900.0, host: str = "127.0.0.1",
                 advertise_host: str | None = None, remote_roles: Sequence[str] = (),
                 listener: Listener | None = None, secret: FleetSecret | None = None, **engine_kwargs) -> None:
        self.defaults = dict(backend=backend, async_transfer=async_transfer, transfer_timeout_s=transfer_timeout_s,
                             lease_s=lease_s, connect_timeout_s=connect_timeout_s)
        _check_session_options(self.defaults)
        self.hosts = HostOptions(host, advertise_host)
        if isinstance(remote_roles, str) or not set(remote_roles) <= set(ROLES):
            raise ValueError(f"remote_roles must be a list of roles out of {list(ROLES)}, got {remote_roles!r}")
        self.remote_roles = tuple(remote_roles)
        if self.remote_roles and listener is None:
            raise ValueError("listener: with remote_roles, pass the Listener whose address the remote workers got")
        if self.remote_roles and (secret is None or listener.secret != secret):
            raise ValueError("secret: with remote_roles, pass the P/D secret the remote workers share "
                             "(and the listener's)")
        self.secret = secret or FleetSecret.generate()
        self.sampling_defaults = sampling_defaults(model, engine_kwargs.get("generation_config", "auto"),
                                                   engine_kwargs.get("override_generation_config"),
                                                   engine_kwargs.get("revision"), engine_kwargs.get("download_dir"))
        configs = _side_configs(model, engine_kwargs, prefill_device, decode_device, prefill or {}, decode or {})
        self.procs: dict[str, mp.Process] = {}
        self.channels: dict[str, Channel] = {}
        self.gone: dict[str, str] = {}          # role -> why its process is gone
        self.ready: dict[str, WorkerReady] = {}
        self._sessions = itertools.count()
        self._ids = itertools.count()
        self._active: DisaggSession | None = None
        self._listener = listener or Listener(self.hosts.host, advertise_host=self.hosts.advertise_host,
                                              secret=self.secret)
        try:
            self._start(configs, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, configs: dict[str, dict], timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        for role in ROLES:
            if role in self.remote_roles:
                continue              # its worker connects from another host
            # A daemonic process may not have children, and a TP engine spawns its worker ranks; the
            # engine process exits with the driver either way (worker_main watches its parent).
            daemon = configs[role]["tensor_parallel_size"] == 1
            self.procs[role] = ctx.Process(target=worker_main,
                                           args=(role, self._listener.address, self.hosts, self.secret),
                                           daemon=daemon, name=f"picovllm-{NAMES[role]}")
            self.procs[role].start()
        deadline = time.monotonic() + timeout_s
        while len(self.channels) < 2:
            self._check_alive(deadline, timeout_s)
            try:
                ch = self._listener.accept(0.5)
            except TimeoutError:
                continue
            hello = ch.recv(timeout_s=30.0)
            if not isinstance(hello, WorkerHello) or hello.role not in ROLES or hello.role in self.channels:
                raise RuntimeError(f"unexpected first message from an engine worker: {hello!r}")
            self.channels[hello.role] = ch
        # Two engines on one GPU size their caches one after the other: each sees the other's memory.
        one_gpu = configs["p"]["device"] == configs["d"]["device"] and configs["p"]["device"].startswith("cuda")
        for group in (["p"], ["d"]) if one_gpu else [["p", "d"]]:
            for role in group:
                self.channels[role].send(BuildEngine(configs[role]))
            for role in group:
                msg = None
                while msg is None:
                    self._check_alive(deadline, timeout_s)
                    try:
                        msg = self.channels[role].recv(timeout_s=0.5)
                    except PeerGone:
                        msg = None
                if not isinstance(msg, WorkerReady):
                    raise RuntimeError(f"the {NAMES[role]} engine sent {msg!r} instead of WorkerReady")
                if msg.error:
                    kind = ValueError if msg.error.startswith("ValueError") else RuntimeError
                    raise kind(f"the {NAMES[role]} engine failed to start: {msg.error}")
                self.ready[role] = msg

    def _check_alive(self, deadline: float, timeout_s: float) -> None:
        for role, proc in self.procs.items():
            if proc.exitcode is not None:
                raise RuntimeError(f"the {NAMES[role]} engine process exited during start-up "
                                   f"(exit code {proc.exitcode}; see its traceback above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engines did not start within {timeout_s:g} s")

    @property
    def pids(self) -> dict[str, int]:
        return {role: p.pid for role, p in self.procs.items()}

    # -- sessions ------------------------------------------------------------------------------
    def session(self, *, stream: bool = False, fault: dict | None = None, **options) -> DisaggSession:
        """Start one lifecycle of the two engines. options override the transfer defaults."""
        if self._active is not None and not self._active.is_done():
            raise RuntimeError("a session is still running: close() it and wait() for it first")
        if self.gone:
            raise RuntimeError(f"an engine process is gone ({'; '.join(self.gone.values())}): "
                               f"start a new DisaggLLM")
        opts = {**self.defaults, **options}
        _check_session_options(opts)
        self._active = DisaggSession(self, next(self._sessions), opts, stream, fault or {})
        return self._active

    def get_default_sampling_params(self) -> SamplingParams:
        """As LLM's: the model's generation config on top of SamplingParams' defaults."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, timeout_s: float | None = None, **options) -> list[RequestOutput]:
        """As LLM.generate: one session with every prompt submitted at once, then closed and drained. A prompt's
        params.n samples are requests of their own (the engines run one sample a request), merged back into one
        RequestOutput, as LLM.generate does (picovllm.entrypoints.parallel_sampling)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        prompts, params = normalize_prompts(prompts, sampling_params)
        s = self.session(**options)
        groups = [[s.submit(p, one) for one in sample_params(sp)] for p, sp in zip(prompts, params)]
        ids = [rid for g in groups for rid in g]
        s.close()
        s.wait_submitted(timeout_s)
        if s.rejected:
            for rid in ids:
                s.abort(rid)
        s.wait(timeout_s, use_tqdm=use_tqdm)
        if s.rejected:
            raise ValueError(next(iter(s.rejected.values())))
        return [prompt_output(g, s.results) for g in groups]

    def next_request_id(self) -> str:
        return f"pd-{next(self._ids)}"

    # -- the end -------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop both processes (Shutdown, then a kill for any that is still up after timeout_s; at once for one the
        driver has given up on: silent past its lease, frozen)."""
        for ch in self.channels.values():
            try:
                ch.send(Shutdown())
            except PeerGone:
                pass
        for role, p in self.procs.items():
            if role in self.gone and p.is_alive():
                p.kill()
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for ch in self.channels.values():
            ch.close()
        self.channels = {}
        self._listener.close()

    def __enter__(self) -> "DisaggLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# -- helpers --------------------------------------------------------------------------------------
def generate_disaggregated(model: str | None, prompts, sampling_params=None, *, backend: str = "torch_dist",
                           async_transfer: bool = True, prefill_device: str = "auto", decode_device: str = "auto",
                           use_tqdm: bool = False, **kwargs) -> list[RequestOutput]:
    """One offline disaggregated generation: spawn P and D, generate, shut both down.

    Returns what LLM.generate returns, in prompt order, each with metrics (TTFT, ITLs).
    kwargs: EngineConfig fields for both sides, `prefill`/`decode` per-side overrides, and the
    transfer options of DisaggLLM (transfer_timeout_s, lease_s, connect_timeout_s).
    """
    with DisaggLLM(model, backend=backend, async_transfer=async_transfer, prefill_device=prefill_device,
                   decode_device=decode_device, **kwargs) as llm:
        return llm.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _check_session_options(opts: dict) -> None:
    if opts["backend"] not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {opts['backend']!r}")
    for name in ("transfer_timeout_s", "lease_s", "connect_timeout_s"):
        if not isinstance(opts[name], (int, float)) or opts[name] <= 0:
            raise ValueError(f"{name} must be a number > 0, got {opts[name]!r}")
    unknown = set(opts) - {"backend", "async_transfer", "transfer_timeout_s", "lease_s", "connect_timeout_s"}
    if unknown:
        raise ValueError(f"unknown session options: {sorted(unknown)}")


def _side_configs(model, common: dict, p_device: str, d_device: str, p_over: dict, d_over: dict) -> dict[str, dict]:
    """Validated EngineConfig fields per side, as JSON-safe dicts."""
    for name, over in (("prefill", p_over), ("decode", d_over)):
        if "role" in over:
            raise ValueError(f"{name}['role'] is set by the side it configures")
        for field in ("model", "revision", "download_dir", "hf_overrides"):   # D reads the KV P computed: one model
            if field in over:
                raise ValueError(f"{name}[{field!r}]: both sides run one model; give it once, for both")
    out = {}
    for role, device, over in (("p", p_device, p_over), ("d", d_device, d_over)):
        shared = common if role == "d" else {k: v for k, v in common.items() if k != "speculative_config"}
        cfg = EngineConfig(model=model, **{**shared, "device": device, **over, "role": role})   # only D decodes
        fields = dataclasses.asdict(cfg)
        fields["dtype"] = str(cfg.torch_dtype).removeprefix("torch.")
        out[role] = fields
    if out["p"]["device"] == out["d"]["device"] and out["p"]["device"].startswith("cuda") \
            and "gpu_memory_utilization" not in {**common, **p_over}:
        # One GPU: P takes half the budget; D, sized after P, sees P's memory as used and takes the rest.
        out["p"]["gpu_memory_utilization"] = out["p"]["gpu_memory_utilization"] / 2
    return out


__all__ = ["DisaggLLM", "DisaggSession", "generate_disaggregated"]
