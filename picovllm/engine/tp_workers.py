"""The worker processes that LLM(..., tensor_parallel_size=N) spawns itself, watched from rank 0.

Ranks 1..N-1 run as spawned children of the caller's process (rank 0). A watchdog thread wakes
the moment one of them exits, so rank 0 can raise a clear error instead of waiting on a peer that
is gone; the children, in turn, exit when the caller's process does (they poll their parent).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from multiprocessing import connection
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from picovllm.engine.tp_world import WORLD_TIMEOUT

STARTED_KEY = "picovllm/tp/started"


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker died or the ranks fell out of step; the engine cannot continue."""


class WorkerProcesses:
    def __init__(self, world_size: int, target: Callable[[int, int, int, int], None]) -> None:
        """Spawn ranks 1..world_size-1 running target(rank, world_size, store_port, parent_pid)."""
        ctx = mp.get_context("spawn")
        # The rendezvous store lives in this process; port 0 lets the OS pick a free port.
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                   timeout=WORLD_TIMEOUT)
        self.procs = [ctx.Process(target=target, args=(rank, world_size, self.store.port, os.getpid()),
                                  name=f"picovllm-tp-rank{rank}", daemon=True) for rank in range(1, world_size)]
        self.death: str | None = None                      # set by the watchdog: who died, how
        self.on_death: Callable[[], None] | None = None    # also run by the watchdog (e.g. abort NCCL)
        self._quiet_r, self._quiet_w = ctx.Pipe(duplex=False)
        self._reap_lock = threading.Lock()
        for p in self.procs:
            p.start()
        self._watchdog = threading.Thread(target=self._watch, name="picovllm-tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _watch(self) -> None:
        ready = connection.wait([p.sentinel for p in self.procs] + [self._quiet_r])
        if self._quiet_r in ready:
            return
        self.death = self.dead_worker()
        if self.on_death is not None:
            self.on_death()

    def dead_worker(self, wait: float = 0.0) -> str | None:
        """Describe the first worker that has exited (waiting up to `wait` s for one), or None."""
        ready = connection.wait([p.sentinel for p in self.procs], timeout=wait)
        with self._reap_lock:   # two threads reaping one child race: the loser reads no exit code
            for rank, p in enumerate(self.procs, start=1):
                if p.sentinel in ready:
                    p.join(1.0)   # its pipe closes a moment before it can be reaped
                    return f"tensor-parallel worker rank {rank} (pid {p.pid}) {describe_exit(p.exitcode)}"
        return None

    def wait_started(self) -> None:
        """Wait until every worker has reached init_process_group, failing fast if one died first."""
        deadline = time.monotonic() + WORLD_TIMEOUT.total_seconds()
        while self.store.add(STARTED_KEY, 0) < len(self.procs):
            dead = self.dead_worker()
            if dead:
                raise TPWorkerError(f"{dead} while starting")
            if time.monotonic() > deadline:
                raise TPWorkerError(f"tensor-parallel workers did not start within {WORLD_TIMEOUT}")
            time.sleep(0.02)

    def quiet(self) -> None:
        """Stop the watchdog: workers are about to exit on purpose."""
        if not self._quiet_w.closed:
            self._quiet_w.send_bytes(b"quiet")
            self._watchdog.join()
            self._quiet_w.close()
            self._quiet_r.close()

    def stop(self, grace: float) -> None:
        """Give workers `grace` seconds to exit by themselves, then terminate, then kill them."""
        self.quiet()
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
            p.close()
        self.procs = []


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}" + (" (its traceback is above)" if code == 1 else "")


def exit_with_parent(parent_pid: int, interval: float = 0.5) -> None:
    """Worker side: end this process as soon as its parent (rank 0) is gone, so none is orphaned."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="picovllm-parent-watch", daemon=True).start()
