"""The one loop that drives an Engine. The offline API (LLM), the server's engine thread (AsyncEngine)
and a disaggregated run's engine workers are its callers, not copies of it: each says where its
input comes from (take_input) and what to do with the outputs.

An iteration: take the caller's input, waiting for it only while the engine has nothing to compute,
then step once. How long it may wait (wait_s, handed to take_input) is the loop's rule:

    something to compute or to read back (a step in flight)    0: step at once
    a connector (roles p, d): the peer may speak at any time   POLL_S, or IN_FLIGHT_POLL_S while a
                                                               transfer may end with no message
    nothing at all                                             until input comes (None)

A caller's take_input may wait otherwise when the loop may wait at all: a served P or D engine
(disagg/pd_http.py, disagg/fleet_server.py: _poll_timeout) polls its peer on intervals of its own.
"""
from __future__ import annotations

from typing import Callable

from picovllm.engine.llm_engine import Engine
from picovllm.outputs import RequestOutput

# A caller's input: wait up to timeout_s (None: until some comes) for commands, apply them to the
# engine, and return False to end the loop.
TakeInput = Callable[[float | None], bool]

POLL_S = 0.02               # a P or D engine with nothing to compute: how often it looks at its peer
IN_FLIGHT_POLL_S = 0.0005   # ...while a KV transfer may complete without a message


class StepLoop:
    def __init__(self, engine: Engine, take_input: TakeInput | None = None, unfinished_outputs: bool = True) -> None:
        self.engine = engine
        self.take_input = take_input
        self.unfinished_outputs = unfinished_outputs    # False: only finished requests get an output

    def wait_s(self) -> float | None:
        """How long the next iteration may wait for input before it steps (see the module doc)."""
        engine = self.engine
        if engine.has_work():
            return 0.0
        if engine.connector is not None:
            return IN_FLIGHT_POLL_S if engine.connector.transfers_in_flight else POLL_S
        return 0.0 if engine.has_unfinished_requests() else None

    def run_once(self) -> list[RequestOutput] | None:
        """Take input, then step if there is anything to step. None: the input ended the loop."""
        if self.take_input is not None and not self.take_input(self.wait_s()):
            return None
        engine = self.engine
        if engine.connector is None and not engine.has_unfinished_requests():
            return []
        return engine.step(self.unfinished_outputs)

    def run_until(self, done: Callable[[], bool], on_outputs: Callable[[list[RequestOutput]], None]) -> bool:
        """Iterate until done() (True) or the input ends the loop (False), handing each step's outputs on."""
        while not done():
            outputs = self.run_once()
            if outputs is None:
                return False
            on_outputs(outputs)
        return True
