"""PICOVLLM_STEP_LOG=PATH, a debugging aid: how a served engine's steps ran (benchmarks/step_log.py sets them beside
the planner's profile).

Each scheduled step's entry (a list, its slots as ENTRY names them): its wall time, prompt tokens, decodes, sequences,
requests waiting, the decodes' tokens of context and the engine thread's CPU time then; overlapped, the wall times at
which it was launched, the step before's result was read, Engine.step returned and it was prepared for the launch
(Mark); then the requests it schedules for the first time. Written to PATH.<pid> as JSON when the process exits, and
Python's garbage collections to PATH.<pid>.gc: (start wall time, generation, seconds, objects collected).
"""
from __future__ import annotations

import enum
import gc
import json
import multiprocessing.util
import os
import time

ENTRY = ("wall", "prompt_tokens", "decodes", "sequences", "waiting", "context", "thread_time",
         "launched", "read", "returned", "prepared", "admitted")


class Mark(enum.IntEnum):
    """The slots an overlapped step sets as it goes: wall times."""
    LAUNCHED = 7
    READ = 8
    RETURNED = 9
    PREPARED = 10


class StepLog:
    """One a process (every engine of it appends here), written when the process exits."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.steps: list[list] = []
        self.collections: list[list] = []
        gc.callbacks.append(self._log_gc)
        # multiprocessing's children skip atexit; its finalizers run in every process
        multiprocessing.util.Finalize(None, self._write, exitpriority=100)

    def scheduled(self, sched, num_waiting: int, now: float) -> list | None:
        """A scheduled step's new entry (None for a step without chunks), for its marks to go in."""
        if not sched.chunks:
            return None
        context = sum(c.request.num_tokens for c in sched.chunks if c.is_decode)
        admitted = sum(c.request.metrics.first_scheduled_time is None for c in sched.chunks)
        entry = [now, sched.num_tokens - sched.num_decodes, sched.num_decodes, len(sched.chunks), num_waiting,
                 context, time.thread_time(), None, None, None, None, admitted]
        self.steps.append(entry)
        return entry

    def _log_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.collections.append([time.time(), info["generation"], time.perf_counter(), 0])
        elif self.collections:
            self.collections[-1][2:] = [time.perf_counter() - self.collections[-1][2], info["collected"]]

    def _write(self) -> None:
        path = f"{self.path}.{os.getpid()}"
        for name, log in ((path, self.steps), (path + ".gc", self.collections)):
            with open(name, "w") as f:
                json.dump(log, f)


# the process's log, when PICOVLLM_STEP_LOG asks for one (set before the engine module is imported)
STEP_LOG: StepLog | None = StepLog(os.environ["PICOVLLM_STEP_LOG"]) if os.environ.get("PICOVLLM_STEP_LOG") else None
