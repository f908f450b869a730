"""Structured outputs in an engine: each constrained request's grammar (GrammarState, compiled at admission) and each
step's token masks. A row's mask is filled when the step is prepared if its grammar has taken every token so far, or
late, while the step's forward runs, when it waits for the token of the step in flight (ARCHITECTURE.md, "Structured
outputs under overlap")."""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from picovllm.layers.structured_output import BitmaskBuffers, GrammarState, StructuredOutputCompiler
from picovllm.reasoning import HarmonyTags, ThinkTags, reasoning_gate
from picovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from picovllm.engine.model_runner import StepResult
    from picovllm.engine.request import Request
    from picovllm.engine.scheduler import SchedulerOutput
    from picovllm.engine.step_input import StepInput


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
        accepted = GrammarState.accept_all(states, taken)
        if not all(accepted) or any(g.is_terminated or not g.masked for g in states):
            keep = [k for k, g in enumerate(states) if accepted[k] and g.masked and not g.is_terminated]
            rows, states = [rows[k] for k in keep], [states[k] for k in keep]
        step.token_bitmasks.fill(rows, states)
