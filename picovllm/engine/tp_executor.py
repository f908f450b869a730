"""Tensor parallelism: rank 0's TPExecutor drives N-1 workers, each running its shard of the model.

Rank 0 is the caller's process and the only one with a scheduler. Each step it broadcasts a
RunStep message on the control group, then runs its own shard; the layers' collectives keep the
ranks in lock step, and only rank 0 samples. Decode steps replay CUDA graphs on every rank (each
rank captured the same sizes, so the collectives inside pair up). Under overlapped scheduling rank 0
broadcasts each step's sampled tokens on the TP group, on the device: the next step, prepared before
they reached the host, reads them there on every rank, exactly as one process does. Workers run `run_worker`: receive a message, do what
it says, repeat until Shutdown. TPExecutor spawns the workers itself, unless the ranks already
exist (torchrun, or a world set up by the caller): then ranks other than 0 call run_worker_from_env().
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
import weakref
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist

from picovllm.config import EngineConfig
from picovllm.distributed import TPGroup
from picovllm.engine import tp_kv
from picovllm.engine.executor import Executor
from picovllm.engine.messages import AllocateKVCache, GatherKV, ProfileKVCache, RunStep, ScatterKV, Setup, Shutdown
from picovllm.engine.model_runner import LaunchedStep, ModelRunner, StepInput, StepResult
from picovllm.engine.tp_workers import STARTED_KEY, TPWorkerError, WorkerProcesses, exit_with_parent
from picovllm.engine.tp_world import (WORLD_TIMEOUT, ControlChannel, join_external_world, launched_externally,
                                      new_control_group, new_tp_group, rank_device)
from picovllm.loader import engine_model_source
from picovllm.loader.source import ModelSource

SHUTDOWN_GRACE_S = 10.0    # how long workers get to leave their loop before they are terminated
DEATH_WAIT_S = 2.0         # after a collective fails: how long to wait for the worker's exit to show


# The session whose spawned workers make up this process's torch.distributed world, while it runs: a process has
# one world, so a second engine cannot spawn its own (its new_group would wait forever on the first's ranks)
_spawned_world: "TPSession | None" = None


class TPSession:
    """What a tensor-parallel engine holds outside rank 0's model: the groups and the workers."""

    def __init__(self) -> None:
        self.workers: WorkerProcesses | None = None   # None when torchrun (or the caller) started the ranks
        self.owns_world = False
        self.channel: ControlChannel | None = None
        self.tp: TPGroup | None = None
        self.local_rank = 0
        self.ranks: list[int] = []
        self.failure: str | None = None
        self.closed = False
        self._threads: int | None = None              # rank 0's torch thread count before we changed it

    def start(self, size: int, device: str) -> None:
        global _spawned_world
        if _spawned_world is not None and not _spawned_world.closed:
            raise ValueError(f"EngineConfig.tensor_parallel_size {size}: another tensor-parallel engine of this "
                             "process is running on workers it spawned (a process holds one torch.distributed "
                             "world); shut it down first (LLM.shutdown(), or leave its `with` block)")
        if launched_externally():
            self.local_rank, self.owns_world = join_external_world()
            if dist.get_rank() != 0:
                raise ValueError(f"rank {dist.get_rank()} must run picovllm.engine.tp_executor.run_worker_from_env(), "
                                 "not build an engine: only rank 0 does")
            if dist.get_world_size() != size:
                raise ValueError(f"EngineConfig.tensor_parallel_size is {size} but the torch.distributed world has "
                                 f"{dist.get_world_size()} ranks")
        else:
            if str(device).startswith("cuda") and torch.cuda.device_count() < size:
                raise ValueError(f"EngineConfig.tensor_parallel_size {size} needs {size} GPUs, "
                                 f"found {torch.cuda.device_count()}")
            self.workers = WorkerProcesses(size, spawned_worker_main)
            self.workers.wait_started()
            dist.init_process_group("gloo", store=self.workers.store, rank=0, world_size=size, timeout=WORLD_TIMEOUT)
            self.owns_world = True
            _spawned_world = self
        self.ranks = list(range(size))
        self.channel = ControlChannel(new_control_group(self.ranks), src=self.ranks[0])

    def make_tp_group(self, device: torch.device) -> TPGroup:
        self.tp = new_tp_group(self.ranks, device)
        if device.type == "cuda" and self.workers is not None:
            # A dead peer leaves NCCL kernels spinning, which no exception reaches: abort them.
            self.workers.on_death = lambda: _abort_group(self.tp.group)
        if device.type == "cpu" and self.workers is not None:
            self._threads = torch.get_num_threads()
            share_cpu_threads(self.tp.size)
        return self.tp

    def dead_worker(self, wait: float = 0.0) -> str | None:
        if self.workers is None or not self.workers.procs:
            return None
        return self.workers.death or self.workers.dead_worker(wait)

    def fail(self, what: str, exc: BaseException) -> str | None:
        """Record that a remote section failed and stop everything (the ranks may be out of step).

        Returns the reason when another rank is to blame (it died, or a collective failed)."""
        dead = self.dead_worker(DEATH_WAIT_S) if isinstance(exc, RuntimeError) else None
        if dead is None and _is_collective_error(exc):
            dead = f"a tensor-parallel collective failed, a rank may have died or hung ({exc})"
        if dead:
            self.failure = f"{dead} during {what}"
        else:
            self.failure = f"{type(exc).__name__} on rank 0 during {what}" + (f": {exc}" if str(exc) else "")
        self.close(graceful=False)
        return self.failure if dead else None

    def close(self, graceful: bool = True) -> None:
        """Stop the workers and destroy the groups; idempotent. Graceful: tell the workers to leave first."""
        if self.closed:
            return
        self.closed = True
        if self.workers is not None:
            self.workers.quiet()
        if graceful and self.failure is None and self.channel is not None:
            with contextlib.suppress(Exception):
                self.channel.send(Shutdown())
        if self.workers is not None:
            self.workers.stop(SHUTDOWN_GRACE_S if graceful else 0.0)
        if self.tp is not None and self.failure is not None:
            _abort_group(self.tp.group)
        if self.owns_world and dist.is_initialized():
            dist.destroy_process_group()
        elif dist.is_initialized():   # the world is the caller's: only our groups go
            for group in (self.tp.group if self.tp else None, self.channel.group if self.channel else None):
                if group is not None:
                    with contextlib.suppress(Exception):
                        dist.destroy_process_group(group)
        if self._threads is not None:
            torch.set_num_threads(self._threads)


class TPExecutor(Executor):
    """Rank 0 of a tensor-parallel engine: a ModelRunner for its own shard, plus the control channel
    to the workers. Every call that the ranks must run together is sent to the workers first."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.session = TPSession()
        try:
            self.session.start(config.tensor_parallel_size, config.device)
            device = rank_device(config.device, self.session.local_rank)
            with self._remote("start-up"):
                self.session.channel.send(Setup(replace(config, model=source.path)))
                tp = self.session.make_tp_group(device)
                self.runner = ModelRunner(config, source, tp, device)
            self.overlap = config.async_scheduling   # then the workers keep each step's sampled tokens
        except BaseException:
            self.session.close(graceful=False)
            raise
        self._finalizer = weakref.finalize(self, _close, self.session, self.runner)   # also at interpreter exit

    @property
    def worker_pids(self) -> list[int]:
        return self.session.workers.pids if self.session.workers is not None else []

    @property
    def supports_overlap(self) -> bool:
        return self.overlap

    @property
    def failure(self) -> str | None:
        return self.session.failure     # set once a step's collectives failed: the session is closed for good

    def check_alive(self) -> str | None:
        """The spawned workers' processes, looked at (an exit the watchdog saw, or one not yet reaped); ranks that
        torchrun (or the caller) started are not this process's children: a dead one shows at the next step."""
        s = self.session
        if not s.closed:
            dead = s.dead_worker()
            if dead:
                s.fail("a wait for work", RuntimeError(dead))
        return s.failure

    def shutdown(self) -> None:
        self._finalizer()

    @contextlib.contextmanager
    def _remote(self, what: str):
        """A section in which all ranks run collectives together: a failure inside ends the engine."""
        s = self.session
        if s.closed:
            raise TPWorkerError("the tensor-parallel engine is shut down" + (f" (after {s.failure})" if s.failure else ""))
        dead = s.dead_worker()
        if dead:
            s.fail(what, RuntimeError(dead))
            raise TPWorkerError(s.failure)
        try:
            yield
        except BaseException as e:
            reason = s.fail(what, e)
            if reason is not None:
                raise TPWorkerError(reason) from e
            raise

    def profile_num_blocks(self) -> int:
        with self._remote("KV cache profiling"):
            self.session.channel.send(ProfileKVCache())
            return self.session.channel.min(self.runner.profile_num_blocks())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        with self._remote("KV cache allocation"):
            self.session.channel.send(AllocateKVCache(num_blocks))
            self.runner.allocate_kv_cache(num_blocks)
            self.session.channel.min(1)   # every rank has allocated (an out-of-memory shows up now)

    @torch.inference_mode()
    def launch(self, step: StepInput, prev: LaunchedStep | None = None,
               before_sampling: Callable[[], None] | None = None) -> LaunchedStep:
        in_flight = prev.tokens if prev is not None else None
        if step.prev_dst and not self.overlap:   # refused before the workers see anything
            raise ValueError("a step reads tokens of a step in flight, but EngineConfig.async_scheduling is off")
        with self._remote("a step"):
            # workers only run the forward: the sampling rows (token lists under penalties) stay here
            self.session.channel.send(RunStep(replace(step, sampling=[])))
            logits = self.runner.compute_logits(step, self.runner.prev_tokens(step, in_flight))
            if before_sampling is not None:
                before_sampling()
            launched = self.runner.launch_sampling(logits, step, in_flight)
            if self.overlap and launched.tokens is not None:
                self.runner.tp.broadcast(launched.tokens)   # the workers' copy, for the next step's prev_dst
        return launched

    def resolve(self, launched: LaunchedStep) -> StepResult:
        if launched.done is not None:
            with self._remote("a step"):
                self._wait_for(launched.done)
        return self.runner.resolve(launched)

    def gather_kv(self, block_ids: list[int]) -> torch.Tensor:
        """These blocks with every rank's KV heads, on the CPU (engine/tp_kv.py)."""
        with self._remote("a KV gather"):
            self.session.channel.send(GatherKV(list(block_ids)))
            return tp_kv.gather_blocks(self.runner, self.session.channel.group, self.session.channel.src, block_ids)

    def scatter_kv(self, block_ids: list[int], full: torch.Tensor) -> None:
        """Write full-head blocks into every rank's cache, each rank its own heads."""
        with self._remote("a KV scatter"):
            self.session.channel.send(ScatterKV(list(block_ids)))
            tp_kv.scatter_blocks(self.runner, self.session.channel.group, self.session.channel.src, block_ids, full)

    def _wait_for(self, done: torch.cuda.Event) -> None:
        """Wait for the step's kernels while watching the workers: a dead NCCL peer would block a sync forever."""
        while not done.query():
            dead = self.session.dead_worker()
            if dead:
                raise RuntimeError(dead)
            time.sleep(20e-6)


def _close(session: TPSession, runner: ModelRunner) -> None:
    if session.failure is None:   # after a failure the device may be stuck: leave the graphs to the exit
        with contextlib.suppress(Exception):
            runner.shutdown()
    session.close()


def run_worker(ranks: list[int], local_rank: int) -> None:
    """A worker's whole life: build its shard from rank 0's Setup, then run what rank 0 sends until Shutdown."""
    channel = ControlChannel(new_control_group(ranks), src=ranks[0])
    setup = channel.recv()
    if not isinstance(setup, Setup):
        raise ValueError(f"expected a Setup message first, got {type(setup).__name__}")
    device = rank_device(setup.config.device, local_rank)
    tp = new_tp_group(ranks, device)
    if device.type == "cpu":
        share_cpu_threads(tp.size)
    config = setup.config
    runner = ModelRunner(config, engine_model_source(config), tp, device)
    sampled = None    # overlapped scheduling: the last step's sampled tokens, as rank 0 broadcast them
    while True:
        msg = channel.recv()
        if isinstance(msg, RunStep):
            with torch.inference_mode():
                step = msg.step
                # only rank 0 samples; this rank's part is the collectives
                runner.compute_logits(step, runner.prev_tokens(step, sampled))
                if setup.config.async_scheduling and step.sample_indices:
                    sampled = tp.broadcast(torch.empty(len(step.sample_indices), dtype=torch.long, device=device))
        elif isinstance(msg, ProfileKVCache):
            channel.min(runner.profile_num_blocks())
        elif isinstance(msg, AllocateKVCache):
            runner.allocate_kv_cache(msg.num_blocks)
            channel.min(1)
        elif isinstance(msg, Shutdown):
            runner.shutdown()
            return
        elif not tp_kv.serve(runner, channel, msg):
            raise ValueError(f"unexpected message {type(msg).__name__} after start-up")


def run_worker_from_env() -> None:
    """Under torchrun, ranks other than 0 call this: join the world from the environment and serve rank 0."""
    local_rank, owns_world = join_external_world()
    try:
        run_worker(list(range(dist.get_world_size())), local_rank)
    finally:
        if owns_world:
            dist.destroy_process_group()


def spawned_worker_main(rank: int, world_size: int, store_port: int, parent_pid: int) -> None:
    """Entry point of a worker process spawned by TPExecutor."""
    exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is rank 0's to handle; it then stops us
    try:
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=WORLD_TIMEOUT)
        store.add(STARTED_KEY, 1)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=WORLD_TIMEOUT)
        run_worker(list(range(world_size)), local_rank=rank)
        dist.destroy_process_group()
    except BaseException:
        print(f"picovllm tensor-parallel worker rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def share_cpu_threads(num_ranks: int) -> None:
    """CPU ranks split the cores between them unless the user chose a thread count."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_ranks))


def _is_collective_error(exc: BaseException) -> bool:
    # NCCL raises DistBackendError; gloo a plain RuntimeError whose text names its source file.
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


def _abort_group(group) -> None:
    """Best effort: only NCCL groups can be aborted, and only through a private torch API."""
    if group is None or dist.get_backend(group) != "nccl":
        return
    with contextlib.suppress(Exception):
        dist.distributed_c10d._abort_process_group(group)
