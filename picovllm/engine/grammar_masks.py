"""Structured outputs in an engine: each constrained request's grammar (GrammarState, compiled at admission) and each
step's token masks. A row's mask is filled when the step is prepared if its grammar has taken every token so far, or
late, while the step's forward runs, when it waits for the token of the step in flight (ARCHITECTURE.md, "Structured
outputs under overlap")."""
from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from picovllm.layers.structured_output import BitmaskBuffers, GrammarState, StructuredOutputCompiler
from picovllm.reasoning import HarmonyTags, ThinkTags, reasoning_gate
from picovllm.sampling_params import SamplingParams

OFFER_COMPILE_THREADS = 4     # a decode engine's offers' grammars compiling at once (AsyncEngine's adds: its own)

if TYPE_CHECKING:
    import torch

    from picovllm.engine.model_runner import StepResult
    from picovllm.engine.request import Request
    from picovllm.engine.scheduler import SchedulerOutput
    from picovllm.engine.step_input import StepInput


class CompileThreads:
    """Threads that compile grammars off an engine's loop (AsyncEngine's adds, a decode engine's offers), `size` at
    once, in the order submitted; each job's Future says how it ended. A job cancelled before it starts (its request
    aborted meanwhile) is skipped. The threads are daemons: a compile still running when the process ends (a 50,000-
    value choice list takes minutes) does not hold up its exit, as concurrent.futures' threads would (Python joins
    those at exit whatever shutdown(wait=False) said)."""

    def __init__(self, size: int, name: str) -> None:
        self.size, self.name = size, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()     # (Future, fn, args), or None: a thread's end
        self._threads: list[threading.Thread] = []      # started as jobs come, `size` at most
        self._closed = False

    def submit(self, fn: Callable, *args) -> Future:
        if self._closed:
            raise RuntimeError(f"{self.name}: the compile threads are shut down")
        future: Future = Future()
        self._jobs.put((future, fn, args))
        if len(self._threads) < self.size:
            thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():     # cancelled while it waited
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - the Future carries it to whoever waits for the job
                future.set_exception(e)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Cancel the jobs not started and let the threads go; a job running finishes on its own, unwaited for."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)


class GrammarMasks:
    """One engine's grammar compiler, reasoning parsers' gates and mask buffers (the compiler and the buffers are
    built at their first use: an engine without structured requests needs neither)."""

    def __init__(self, tokenizer, vocab_size: int, reasoning_parser: str | None) -> None:
        """reasoning_parser: EngineConfig.reasoning_parser, checked now (before the weights load) and given to the
        structured requests that name none."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.reasoning_parser = reasoning_parser
        self.compiler: StructuredOutputCompiler | None = None   # built at the first structured request
        self._compiler_lock = threading.Lock()     # precompile runs on another thread than the engine's
        self._bitmasks: BitmaskBuffers | None = None       # the grammar masks' buffers, at the first such step
        self._reasoning_gates: dict[str, ThinkTags | HarmonyTags] = {}     # the reasoning parsers' gates, by name
        # a decode engine's offered requests whose grammar compiles (compile_offer), by id, in the order they came
        self.offers: dict[str, tuple[Request, Future]] = {}
        self._offer_threads: CompileThreads | None = None     # their compiles' threads, at the first one
        if reasoning_parser:
            self.reasoning_gate(reasoning_parser, f"EngineConfig.reasoning_parser {reasoning_parser!r}")

    # -- a request's grammar -------------------------------------------------------------------
    def for_request(self, params: SamplingParams, prompt_ids: Sequence[int],
                    eos_token_ids: list[int]) -> tuple[SamplingParams, GrammarState | None]:
        """A new request's params and its grammar (None if unconstrained); ValueError naming the field if it cannot
        be compiled."""
        so = params.structured_outputs
        if so is None:
            return params, None
        if so.reasoning_parser is None and self.reasoning_parser is not None:
            # the engine's parser goes with the request (a copy: the caller's params stay as they were), so a
            # decode engine it is handed to gates its grammar as this engine did, whatever its own config says
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                so, reasoning_parser=self.reasoning_parser))
        return params, self.new_state(params, prompt_ids, eos_token_ids)

    def precompile(self, params: SamplingParams, eos_token_ids: list[int]) -> None:
        """Compile params' grammar into the compiler's cache, so that the request's add (new_state) finds it there.
        Safe on another thread than the engine's (AsyncEngine compiles there: a long grammar takes seconds, which on
        the engine's thread would stall every request). ValueError naming the field if it cannot be compiled; nothing
        without a grammar or a tokenizer (the add says why)."""
        so = params.structured_outputs
        if so is not None and self.tokenizer is not None:
            self._compiler(eos_token_ids).compile(so)

    def _compiler(self, eos_token_ids: list[int]) -> StructuredOutputCompiler:
        with self._compiler_lock:
            if self.compiler is None:
                self.compiler = StructuredOutputCompiler(self.tokenizer, self.vocab_size, eos_token_ids)
            return self.compiler

    def new_state(self, params: SamplingParams, prompt_ids: Sequence[int], eos_token_ids: list[int]) -> GrammarState:
        """A matcher for the request's structured output; ValueError naming the field if it cannot be. With a
        reasoning parser, it starts where the prompt leaves the output (picovllm/reasoning.py's gates' begin)."""
        so = params.structured_outputs
        if self.tokenizer is None:
            raise ValueError(f"{so.field_name}: structured outputs need the model's tokenizer")
        self._compiler(eos_token_ids)
        parser = so.reasoning_parser or self.reasoning_parser      # the request's own (a front end's) first
        if parser is None:
            return self.compiler.new_state(so)
        gate = self.reasoning_gate(parser, f"SamplingParams.structured_outputs.reasoning_parser {parser!r}")
        return self.compiler.new_state(so, gate, *gate.begin(prompt_ids))

    def state_on_decode(self, req: Request, eos_token_ids: list[int]) -> GrammarState:
        """D: the matcher of an offered request, advanced by the tokens P sampled under the same grammar (P and D
        compile it each, from the request's params); ValueError naming the field if they do not match it."""
        grammar = self.new_state(req.params, req.prompt_token_ids, eos_token_ids)
        for token in req.output_token_ids:
            if not grammar.accept(token):
                raise ValueError(f"{req.params.structured_outputs.field_name}: the prefill engine's token {token} "
                                 f"does not match the grammar here (another tokenizer or grammar version, or a "
                                 f"prefill engine without the EngineConfig.reasoning_parser "
                                 f"{self.reasoning_parser!r} this one has?)")
        return grammar

    # -- an offered request's grammar (a decode engine) ---------------------------------------
    def compile_offer(self, req: Request, eos_token_ids: list[int]) -> None:
        """D: compile an offered request's grammar on threads of its own, not the engine's (a long one takes
        seconds, which every request decoding there would wait out); compiled_offers gives the request back once
        its compile has ended, and state_on_decode then finds the grammar compiled."""
        if self._offer_threads is None:
            self._offer_threads = CompileThreads(OFFER_COMPILE_THREADS, "picovllm-offer-grammar")
        self.offers[req.request_id] = (req, self._offer_threads.submit(self.precompile, req.params, eos_token_ids))

    def compiled_offers(self) -> list[tuple[Request, BaseException | None]]:
        """The offers whose compile has ended, in the order they came, each with its error (None: compiled; a
        ValueError names the field); forgotten here."""
        done = [(rid, req, compiled) for rid, (req, compiled) in self.offers.items() if compiled.done()]
        for rid, _, _ in done:
            del self.offers[rid]
        return [(req, compiled.exception()) for _, req, compiled in done]

    def drop_offer(self, request_id: str) -> Request | None:
        """Forget an offer whose grammar compiles (aborted, or given back by the connector); its compile is skipped
        if it has not started. The request, or None if no such offer compiles."""
        entry = self.offers.pop(request_id, None)
        if entry is None:
            return None
        entry[1].cancel()
        return entry[0]

    def close(self) -> None:
        """The engine is going away: offers' compiles not started are skipped, running ones left to end alone."""
        if self._offer_threads is not None:
            self._offer_threads.shutdown()

    def reasoning_gate(self, parser: str, what: str) -> ThinkTags | HarmonyTags:
        """The tokens a reasoning parser's grammar gate watches for (picovllm/reasoning.py); ValueError naming `what`
        where the tokenizer has none."""
        if parser in self._reasoning_gates:
            return self._reasoning_gates[parser]
        if self.tokenizer is None:
            raise ValueError(f"{what} needs the model's tokenizer")
        gate = reasoning_gate(self.tokenizer, parser, what)
        ids = gate.token_ids
        if max(ids) >= self.vocab_size:
            raise ValueError(f"{what}: the tokenizer's reasoning tokens {sorted(set(ids))} are not all inside the "
                             f"model's vocabulary ({self.vocab_size})")
        self._reasoning_gates[parser] = gate
        return gate

    # -- a step's masks ------------------------------------------------------------------------
    def fill(self, step: StepInput, sched: SchedulerOutput, device: torch.device) -> list[tuple[int, Request]]:
        """Give the step the masks of constrained rows whose grammar has taken every token so far; return the
        others, (row, Request), which wait for a token in flight (fill_late)."""
        late: list[tuple[int, Request]] = []
        if self.compiler is None:
            return late
        rows, states, ahead = [], [], []
        for row, chunk in sched.sampling_chunks():
            req = chunk.request
            if req.grammar is None:
                continue
            if chunk.drafts:        # a row a draft: each with the grammar advanced by the drafts before it
                ahead.append((row, req.grammar, chunk.drafts))
            elif req.num_pending_tokens:
                late.append((row, req))
            elif req.grammar.masked:
                rows.append(row)
                states.append(req.grammar)
        if rows or late or ahead:
            if self._bitmasks is None:
                self._bitmasks = BitmaskBuffers(self.vocab_size, device)
            step.token_bitmasks = self._bitmasks.for_step(len(step.sampling))
            step.token_bitmasks.fill(rows, states)
            for first, grammar, drafts in ahead:
                grammar.fill_ahead(step.token_bitmasks, first, drafts)
        return late

    @staticmethod
    def fill_late(step: StepInput, late: list[tuple[int, Request]], done_sched: SchedulerOutput,
                  done: StepResult) -> None:
        """Structured outputs under overlap: rows (index, Request) of the step being launched whose grammar
        waits on the token `done` holds for them; advance the grammars by them (one call into xgrammar) and
        fill the rows' masks. apply_results later appends the token without advancing the grammar again
        (GrammarState.num_accepted). A token the grammar refuses, or one that ends it, leaves the row
        unmasked: apply_results finishes the request and drops the row's token."""
        sampled = [c.request for c in done_sched.chunks for _ in range(c.num_samples)]     # by row
        n, tokens = len(sampled), done.token_ids
        rows, states, taken = [], [], []
        for i, req in late:
            row, grammar = req.pending_row, req.grammar    # its row in `done` (advance() set it)
            if row < n and sampled[row] is req and not req.is_finished and \
                    grammar.num_accepted == len(req.output_token_ids):
                rows.append(i)
                states.append(grammar)
                taken.append(tokens[row])
        step.token_bitmasks.accept_and_fill(rows, states, taken)
