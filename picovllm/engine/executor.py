"""The executor seam: how an Engine runs its model, on this process or on tensor-parallel ranks.

Engine drives one Executor and nothing below it: it sizes and allocates the KV cache through it,
then per step calls prepare (host only), launch (device work queued) and resolve (the step's one
host sync), or execute for both. The docstrings of Executor are the contract; each implementation
is one class that composes a ModelRunner (this process's model or shard), never subclasses one:

    InProcessExecutor   the model on this process (engine/executor.py)
    TPExecutor          rank 0's shard plus the workers' control channel (engine/tp_executor.py)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from picovllm.config import EngineConfig, ModelConfig
from picovllm.distributed import TPGroup
from picovllm.engine.model_runner import LaunchedStep, ModelRunner, StepInput, StepResult
from picovllm.engine.scheduler import SchedulerOutput
from picovllm.loader.source import ModelSource


class Executor(ABC):
    """Runs scheduled steps of one engine's model. Called from the engine's one loop thread only.

    `runner` is this process's ModelRunner (rank 0's shard under tensor parallelism): its model and
    KV cache are what a KV connector's transfer reads and writes. The properties below read it."""

    runner: ModelRunner

    # -- what the engine and the connectors read -----------------------------------------------
    @property
    def model_config(self) -> ModelConfig:
        """The model's config (the whole model's, not a shard's)."""
        return self.runner.model_config

    @property
    def device(self) -> torch.device:
        """The device of this process's model; the engine makes it current for a step."""
        return self.runner.device

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """This process's cache [layers, 2, blocks, block_size, its kv heads, head_dim]; None before allocation."""
        return self.runner.kv_cache

    @property
    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp8 KV: (k, v) scales [layers, total KV heads], the same on every rank; None for a float cache."""
        return self.runner.kv_scales

    @property
    def tp(self) -> TPGroup:
        """This process's place among the tensor-parallel ranks (size 1 when there are none)."""
        return self.runner.tp

    @property
    def failure(self) -> str | None:
        """Why no step can ever run again (a tensor-parallel rank died, a collective failed), or None. A failed step
        raises; this says whether the next one would too, so that a server stops taking requests (AsyncEngine)."""
        return None

    def check_alive(self) -> str | None:
        """Look whether every rank is still there, running nothing on them (no collective, no message), and return
        failure (None: all alive). A rank found dead fails the executor as a failed step would (failure names it from
        then on; the other ranks are stopped). For an engine that is not stepping, whose steps would not notice: a
        served engine's loop calls it while it waits for work, at most once a second (AsyncEngine._take_commands); a
        step never needs it. One process has no ranks to look at."""
        return self.failure

    # -- start-up: the KV cache -----------------------------------------------------------------
    @abstractmethod
    def profile_num_blocks(self) -> int:
        """How many KV blocks fit on every rank (the minimum over ranks). Called once, before allocate."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks KV blocks on every rank; returns when all have them (or raises)."""

    # -- a step ---------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, eos_token_ids: list[int]) -> StepInput:
        """The step's inputs as plain data. Host work only: it may run while another step is in flight."""
        return self.runner.prepare(sched, eos_token_ids)

    @abstractmethod
    def launch(self, step: StepInput, prev: LaunchedStep | None = None,
               before_sampling: Callable[[], None] | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling on every rank without waiting for the sampled tokens.
        prev: the step still in flight whose sampled tokens feed step.prev_dst (overlapped scheduling;
        only where supports_overlap). before_sampling: called on this process once the forward is queued
        and before the sampling is; it may wait for prev and fill rows of step.token_bitmasks (structured
        outputs). Raises ValueError for input it refuses before any rank ran."""

    def resolve(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step and read its sampled tokens (the step loop's one host sync)."""
        return self.runner.resolve(launched)

    def execute(self, step: StepInput) -> StepResult:
        """launch, then resolve: a step with nothing in flight."""
        return self.resolve(self.launch(step))

    @property
    def supports_overlap(self) -> bool:
        """Whether launch accepts a prev step (its tokens still on the device)."""
        return True

    # -- the end --------------------------------------------------------------------------------
    @abstractmethod
    def shutdown(self) -> None:
        """Release what lives outside this process (worker processes, process groups). Idempotent;
        after it, steps raise."""


class InProcessExecutor(Executor):
    """The whole model on this process: every call goes to the ModelRunner."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def profile_num_blocks(self) -> int:
        return self.runner.profile_num_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def launch(self, step: StepInput, prev: LaunchedStep | None = None,
               before_sampling: Callable[[], None] | None = None) -> LaunchedStep:
        return self.runner.launch(step, prev, before_sampling)

    def execute(self, step: StepInput) -> StepResult:
        return self.runner.execute(step)

    def shutdown(self) -> None:
        self.runner.shutdown()


def make_executor(config: EngineConfig, source: ModelSource) -> Executor:
    """The executor config asks for: tensor-parallel ranks when tensor_parallel_size > 1, else this process."""
    if config.tensor_parallel_size > 1:
        from picovllm.engine.tp_executor import TPExecutor   # imports torch.distributed machinery
        return TPExecutor(config, source)
    return InProcessExecutor(ModelRunner(config, source))
