"""An engine process of a disaggregated run: one P or D engine, driven by the driver over a channel.

The process loads the model once (BuildEngine), then serves sessions: each StartSession builds a
fresh engine on the same weights, links it to its peer, and runs the engine's loop, forwarding
Submit/Abort/CloseSession from the driver and sending outputs back, until the engine is done.
A session is one whole lifecycle of the design: handshake, requests, close, drain, Bye.

Faults for tests (StartSession.fault, "<action>:<what>:<n>"):
    exit:<Message>:<n>   the process exits right after sending its n-th <Message> to the peer
    stop:<Message>:<n>   the process freezes itself (SIGSTOP) right after it
    drop:start_send:<n>  the n-th transfer is never started on P (so it never completes)
"""
from __future__ import annotations

import os
import select
import signal
import sys
import traceback

from picovllm.config import EngineConfig
from picovllm.disagg.auth import FleetSecret
from picovllm.disagg.channel import Channel, Listener, PeerGone
from picovllm.disagg.hosts import HostOptions
from picovllm.disagg.messages import (Abort, BuildEngine, CloseSession, Output, OutputEncoder, SessionEnded,
                                      Shutdown, StartSession, Submit, SubmitResult, WorkerHello, WorkerReady)
from picovllm.disagg.session import NAMES
from picovllm.disagg.transfer import TransferConfig
from picovllm.engine.llm_engine import Engine
from picovllm.engine.step_loop import StepLoop
from picovllm.engine.tp_workers import exit_with_parent
from picovllm.sampling_params import SamplingParams


def worker_main(role: str, driver_address: list, hosts: HostOptions | None, secret: FleetSecret) -> None:
    """Process entry point. Exits with os._exit so no library teardown can keep the process alive.

    hosts: where this worker binds (P: its link listener; both: the transfer) and is reached.
    secret: the run's P/D secret; the driver and the peer must prove it, and so does this worker.
    The driver spawns it, or, for a role on another host, picovllm.disagg.launch calls it."""
    code = 0
    exit_with_parent(os.getppid())   # not daemonic when it runs TP workers: never outlive the driver
    try:
        driver = Channel.connect(driver_address, secret=secret)
        driver.send(WorkerHello(role, os.getpid()))
        Worker(role, driver, hosts or HostOptions(), secret).serve()
    except PeerGone:
        code = 2              # the driver went away: nothing left to serve
    except BaseException:     # noqa: BLE001
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Worker:
    def __init__(self, role: str, driver: Channel, hosts: HostOptions, secret: FleetSecret) -> None:
        self.role, self.driver, self.hosts, self.secret = role, driver, hosts, secret
        self.listener = Listener(hosts.host, advertise_host=hosts.advertise_host, secret=secret) \
            if role == "p" else None
        self.shutting_down = False
        self._wire: dict[str, OutputEncoder] = {}     # streamed requests' output encoders

    def serve(self) -> None:
        msg = self.driver.recv(timeout_s=3600)
        if not isinstance(msg, BuildEngine):
            raise RuntimeError(f"expected BuildEngine, got {msg!r}")
        try:
            config = EngineConfig(**msg.config)
            if config.role != self.role:
                raise ValueError(f"EngineConfig.role must be {self.role!r} for this worker, got {config.role!r}")
            if str(config.device).startswith("cuda"):
                import torch
                torch.cuda.set_device(config.device)
            engine = Engine(config)     # the role's connector comes with the config
        except Exception as e:  # noqa: BLE001 - reported to the driver, which raises it
            traceback.print_exc()
            self.driver.send(WorkerReady(self.role, os.getpid(), 0, error=f"{type(e).__name__}: {e}"))
            return
        address = self.listener.address if self.listener else None
        self.driver.send(WorkerReady(self.role, os.getpid(), engine.block_manager.num_blocks, address))
        while not self.shutting_down:
            msg = self.driver.recv(timeout_s=1.0)
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, StartSession):
                self._session(engine, msg)     # one engine serves every session: same weights, same cache
            elif isinstance(msg, Submit):      # arrived after its session ended: never drop one silently
                self.driver.send(SubmitResult(msg.request_id, "the prefill engine is closed (no session running)"))
        if self.listener:
            self.listener.close()
        engine.shutdown()              # a tensor-parallel engine stops its worker ranks here

    # -- one session ---------------------------------------------------------------------------
    def _session(self, engine, start: StartSession) -> None:
        # the driver's lease on this process (DisaggSession.poll): a frozen one goes silent, a busy one beats on
        self.driver.start_heartbeat(start.lease_s / 4)
        tc = TransferConfig(backend=start.backend, async_transfer=start.async_transfer,
                            timeout_s=start.transfer_timeout_s, lease_s=start.lease_s,
                            connect_timeout_s=start.connect_timeout_s, host=self.hosts.host,
                            advertise_host=self.hosts.advertise_host)
        try:
            if self.role == "p":
                channel = self.listener.accept(tc.connect_timeout_s)
            else:
                channel = Channel.connect(start.peer_address, tc.connect_timeout_s, secret=self.secret)
            engine.connect(channel, tc, start.session)
        except (ConnectionError, TimeoutError, OSError) as e:
            self._end(engine, start, error=f"{self.role} engine could not link to its peer: {e}")
            return
        if start.fault:
            _inject(engine, start.fault)
        try:
            self._loop(engine, start)
        except PeerGone:                 # the driver is gone: drop everything, the peer sees us leave
            engine.connector.link.close()
            raise
        except Exception as e:
            self._fail(engine, start, e)
            raise                        # the process exits: this engine cannot step again
        self._end(engine, start)

    def _fail(self, engine, start: StartSession, exc: Exception) -> None:
        """The engine failed mid-session (a tensor-parallel rank died): end the session with the reason, so that the
        driver fails its requests naming it (else all it saw was "the engine process died (exit code 1)"); the
        peer sees the link close at once."""
        try:
            self._end(engine, start, error=f"the {NAMES[self.role]} engine failed: {type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - best effort: the driver still sees the process die
            traceback.print_exc()

    def _loop(self, engine: Engine, start: StartSession) -> None:
        def send(outputs: list) -> None:
            for out in outputs:
                if out.finished or start.stream:
                    self._send_output(out)

        # Not streamed: only final outputs go to the driver, so the engine builds no others (a RequestOutput per
        # request per step copies its tokens: at batch 256 that was ms per step, more than the colocated
        # engine's LLM.generate pays, which builds none either)
        StepLoop(engine, lambda wait_s: self._take_input(engine, wait_s), unfinished_outputs=start.stream) \
            .run_until(engine.is_done, send)

    def _send_output(self, out) -> None:
        """Each request's outputs go as one OutputEncoder stream, closed by its final output."""
        wire = self._wire.pop(out.request_id, None) or OutputEncoder()
        self.driver.send(Output(wire.encode(out)))
        if not out.finished:
            self._wire[out.request_id] = wire

    def _command(self, engine, cmd) -> None:
        if isinstance(cmd, Submit):
            try:
                params = SamplingParams(**cmd.params)
                engine.submit(cmd.prompt, params, cmd.request_id, cmd.arrival_time)
                self.driver.send(SubmitResult(cmd.request_id))
            except (ValueError, RuntimeError, TypeError) as e:
                self.driver.send(SubmitResult(cmd.request_id, error=str(e)))
        elif isinstance(cmd, Abort):
            out = engine.abort(cmd.request_id)
            if out is not None:
                self._send_output(out)
        elif isinstance(cmd, CloseSession):
            engine.close()
        elif isinstance(cmd, Shutdown):
            self.shutting_down = True
            engine.close()

    def _take_input(self, engine: Engine, wait_s: float | None) -> bool:
        """The driver's commands; with nothing to compute, first sleep up to wait_s until the driver
        or the peer says something."""
        if wait_s != 0:
            link = engine.connector.link
            fds = [self.driver.sock]
            if link is not None and not link.closed:
                fds.append(link.channel.sock)
            try:
                select.select(fds, [], [], wait_s)
            except (OSError, ValueError):
                pass
        for cmd in self.driver.recv_all():
            self._command(engine, cmd)
        return True

    def _end(self, engine, start: StartSession, error: str | None = None) -> None:
        self._wire.clear()
        engine.abort_all()      # only after an error: a finished session holds none
        if engine.connector.link is not None:
            engine.connector.link.close()
        bm = engine.block_manager
        self.driver.send(SessionEnded(start.session, bm.num_blocks, bm.num_free_blocks,
                                      len(engine.requests), engine.stats.as_dict(), error))


def _inject(engine, fault: str) -> None:
    action, what, n = fault.split(":")
    count = {"n": 0}
    link = engine.connector.link
    if action == "drop":
        real = link.transfer.start_send

        def start_send(spec):
            count["n"] += 1
            if count["n"] != int(n):
                real(spec)
        link.transfer.start_send = start_send
        return
    real_send = link.send

    def send(msg):
        real_send(msg)
        if type(msg).__name__ == what:
            count["n"] += 1
            if count["n"] == int(n):
                if action == "exit":
                    os._exit(3)
                os.kill(os.getpid(), signal.SIGSTOP)
    link.send = send
