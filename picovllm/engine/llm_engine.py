"""The engine: add_request, step, abort. One step = schedule, run, postprocess, collect outputs.

With overlapped scheduling (EngineConfig.async_scheduling; on by default on GPUs, TP included, unless
speculative decoding is set) a step
schedules and launches step N+1 before it reads step N's sampled tokens, so the host's work
(scheduling, input preparation, detokenizing, stop checks) runs while the device computes:

    step():  schedule N+1 -> launch N+1 (its decodes read N's tokens on the device) -> advance
             -> wait for N's tokens -> append them, check stops, emit outputs of N

Requests are advanced (computed tokens, one pending token) when a step is launched and get
their token when it is resolved. A request that finishes at step N has already been given a
slot in step N+1; that token is computed and dropped (its KV write lands in its own blocks,
ordered on the device before any later step that reuses them).

Roles "p" and "d" (prefill/decode disaggregation) are this same engine with a KV connector
(picovllm/engine/kv_connector.py): each step starts by polling it, and the scheduler asks it which
requests to hold for a handover and which arrive with their KV; see ARCHITECTURE.md.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from typing import TYPE_CHECKING

import torch

from picovllm.config import AUTO_MODEL_LEN, EngineConfig, model_len
from picovllm.engine.admission import (AdmissionLimits, check_capacity, check_length, check_offer,
                                       check_sampling_params, encode_text, max_tokens_of)
from picovllm.engine.block_manager import BlockManager, prefix_salt
from picovllm.engine.detokenizer import Detokenizer, check_stop, stop_token
from picovllm.engine.kv_connector import ConnectorReport, KVConnector
from picovllm.engine.executor import Executor, InProcessExecutor, make_executor
from picovllm.engine.grammar_masks import GrammarMasks
from picovllm.engine.model_runner import LaunchedStep, ModelRunner, StepResult
from picovllm.engine.pooling import engine_pooler, request_pooling
from picovllm.engine.request import DECODING, FinishReason, Request
from picovllm.engine.scheduler import Scheduler, SchedulerOutput
from picovllm.engine.spec_decode import NgramProposer
from picovllm.engine.step_log import STEP_LOG, Mark
from picovllm.engine.step_input import StepInput
from picovllm.gc_freeze import freeze_before_first_engine
from picovllm.layers.rotary import longrope_position_offset
from picovllm.loader import engine_model_source
from picovllm.loader.tokenizer import tokenizer_of
from picovllm.outputs import CompletionOutput, Logprob, RequestOutput
from picovllm.pooling_params import PoolingParams
from picovllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# read once a request a step: on Python 3.11 an enum member read through its class costs ~55 ns more (request.py)
CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY

if TYPE_CHECKING:
    from picovllm.disagg.channel import Channel
    from picovllm.disagg.transfer import TransferConfig

@dataclasses.dataclass
class InFlight:
    """Overlapped scheduling: the step launched and not read yet."""
    sched: SchedulerOutput
    launched: LaunchedStep

    def all_finished(self) -> bool:
        """Every request in it finished meanwhile (stopped, aborted): nothing of it is left to read."""
        return all(c.request.is_finished for c in self.sched.chunks)


@dataclasses.dataclass(slots=True)
class EngineCounters:
    """Engine.stats: totals since the engine was built, read by the server's metrics (EngineStats), the progress
    bar's rates and benchmarks. The speculative ones are vLLM's spec_decode counters."""
    prefill_tokens: int = 0
    decode_tokens: int = 0
    drafts: int = 0                 # speculative chunks (engine/spec_decode.py),
    draft_tokens: int = 0           # the drafted tokens they fed (vLLM's num_draft_tokens),
    accepted_tokens: int = 0        # and those kept (num_accepted_tokens)

    def as_dict(self) -> dict[str, int]:
        """The counters by name, for a message whose payload stays a dict (disagg SessionEnded.stats)."""
        return dataclasses.asdict(self)


class EngineClosedError(RuntimeError):
    """submit() after close(): the engine takes no more requests."""


def role_connector(role: str) -> KVConnector | None:
    """The connector a role runs with: none for "pd", the handover protocol's two ends for "p" and "d"."""
    if role == "pd":
        return None
    # Imported here: the colocated engine does not need the disaggregation package.
    from picovllm.disagg.decode import DecodeConnector
    from picovllm.disagg.prefill import PrefillConnector
    return PrefillConnector() if role == "p" else DecodeConnector()


class Engine:
    def __init__(self, config: EngineConfig, executor: ModelRunner | Executor | None = None,
                 connector: KVConnector | None = None) -> None:
        """executor: run the model through this (a ModelRunner runs in this process) instead of the
        executor the config asks for (tests inject one); connector: instead of the role's."""
        self.config = config
        # as vLLM's: the generators unseeded sampling draws from start from config.seed, so the same requests in the
        # same order sample the same tokens run to run (a request's own seed makes it independent of the rest);
        # seed None, as vLLM's: fresh entropy, so they differ run to run
        random.seed(config.seed)
        torch.manual_seed(config.seed if config.seed is not None else random.randrange(2**63))
        freeze_before_first_engine()      # full garbage collections stay short (gc_freeze.py)
        source = engine_model_source(config)
        self.model_config = source.config
        self.tokenizer = tokenizer_of(source, config)
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None \
                and self.tokenizer.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids.append(self.tokenizer.eos_token_id)
        # vLLM's model EOS (the tokenizer's, else the config's first): a stop at another EOS id reports it
        self.primary_eos = self.tokenizer.eos_token_id if self.tokenizer is not None and \
            self.tokenizer.eos_token_id is not None else next(iter(self.eos_token_ids), None)
        # structured outputs' grammars and masks; it checks the config's reasoning parser now, before the weights load
        self.grammar_masks = GrammarMasks(self.tokenizer, self.model_config.vocab_size, config.reasoning_parser)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len not in (None, AUTO_MODEL_LEN) and config.max_model_len > limit:
            # cut, and said (vLLM refuses it; benchmarks here pass one length to models of every context)
            logger.warning("EngineConfig.max_model_len %d is longer than the model's context, %d (max_position_"
                           "embeddings, with its rope scaling): max_model_len is %d",
                           config.max_model_len, limit, limit)
        self.max_model_len = model_len(config.max_model_len, limit)
        if config.runner == "generate" and not self.model_config.has_lm_head:
            raise ValueError(f"{source.path}: its config.json names a bare model (no LM head), which embeds only: "
                             "EngineConfig.runner 'pooling' (--runner pooling)")
        # a pooling engine's pooler (engine/pooling.py): its requests are prompts to embed, never to decode
        self.pooler = engine_pooler(config.pooler_config, source.path) if config.runner == "pooling" else None
        if isinstance(executor, ModelRunner):
            executor = InProcessExecutor(executor)
        self.executor: Executor = executor or make_executor(config, source)   # in-process, or TP ranks
        num_blocks = self.executor.profile_num_blocks()
        self.executor.allocate_kv_cache(num_blocks)
        salt = prefix_salt(source.path, config.torch_dtype)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, salt)
        self.connector = connector if connector is not None else role_connector(config.role)
        # every layer slides: a decoding request holds only the window (admission counts so on every role: a P's
        # requests are decoded by its D), and blocks behind it are given back as requests go (and at admission), but
        # not on P, which hands the whole prompt's KV over
        window = self._kv_window()
        self.window = None if config.role == "p" else window
        if config.max_model_len == AUTO_MODEL_LEN and window is None \
                and num_blocks * config.block_size < self.max_model_len:
            logger.info("max_model_len -1: %d tokens, what %d KV blocks hold (the model's context is %d)",
                        num_blocks * config.block_size, num_blocks, self.max_model_len)
            self.max_model_len = num_blocks * config.block_size
        spec = config.speculative_config      # speculative decoding: the drafts' proposer (engine/spec_decode.py)
        self.proposer = NgramProposer(spec, self.max_model_len, config.async_scheduling) if spec is not None else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.connector, config.scheduling_policy, self.proposer, config.max_decode_rows,
                                   self.window)
        self.limits = AdmissionLimits(self.model_config.vocab_size, self.max_model_len, num_blocks * config.block_size,
                                      config.block_size, window, config.max_num_batched_tokens,
                                      config.max_logprobs, whole_prompt=config.role == "p")
        self.closed = False            # close() was called: submit() refuses
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._held: list[RequestOutput] = []    # outputs another stepper took for requests not its own (hold_outputs)
        # CUMULATIVE requests' outputs hold only what is new, as DELTA ones' do: for a consumer that adds them up
        # itself (the engine process's OutputDeltas), spared copying every request's whole output every step. Every
        # request's (an engine process's, a D's: requests a connector adds included); add_request's stream_deltas
        # asks it for one request (a server's engine thread, whose engine LLM.generate may share)
        self.stream_deltas = False
        self.overlap = config.async_scheduling
        if self.overlap and not self.executor.supports_overlap:
            raise ValueError("EngineConfig.async_scheduling: this executor cannot launch a step behind one in flight")
        self._in_flight: InFlight | None = None   # overlap: the step launched, not read yet
        self._stalled = False      # the last schedule changed nothing: its waiting requests wait for blocks or slots
        self._step_marks: list | None = None   # PICOVLLM_STEP_LOG: the last scheduled step's entry, if it has one
        self._ids = itertools.count()
        self.stats = EngineCounters()
        # drafts kept by position in their chunk (vLLM's num_accepted_tokens_per_pos): entry i counts the chunks whose
        # first i + 1 drafts were kept, so it never grows along the list
        self.accepted_per_pos = [0] * (spec.num_speculative_tokens if spec is not None else 0)

    def _kv_window(self) -> int | None:
        """The longest sliding window when every layer has one (None if any layer attends to everything)."""
        mc = self.model_config
        windows = [mc.layer_window(i) for i in range(mc.num_hidden_layers)]
        if not windows or None in windows:
            return None
        return max(windows)

    @property
    def runner(self) -> ModelRunner:
        """This process's ModelRunner (rank 0's shard under TP): its model and KV cache, for inspection."""
        return self.executor.runner

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model has no tokenizer: pass token ids")
            return encode_text(self.tokenizer, prompt, "prompt")
        if not isinstance(prompt, (list, tuple)) or not all(map(isinstance, prompt, itertools.repeat(int))):
            raise ValueError("prompt must be a string or a list of int token ids")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, priority: int = 0, *,
                    stream_deltas: bool = False) -> str:
        """Validate and queue a request. Raises ValueError naming the bad field; nothing else changes.
        params: a pooling engine's are PoolingParams (None: the defaults), a generating one's SamplingParams.
        priority: the "priority" scheduling policy's order (lower first); with "fcfs" it must be 0.
        stream_deltas: a CUMULATIVE request's outputs hold only what is new, as a DELTA one's (for a caller that adds
        them up itself: Engine.stream_deltas for one request)."""
        if isinstance(params, PoolingParams) or (params is None and self.pooler is not None):
            return self._add_pooling_request(prompt, params or PoolingParams(), request_id, arrival_time, priority)
        if self.pooler is not None:
            raise ValueError("this engine pools (EngineConfig.runner 'pooling'): it embeds prompts (PoolingParams: "
                             "LLM.embed, /v1/embeddings) and generates nothing; generation needs runner 'generate'")
        self._check_priority(priority)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        params.validate()   # again: fields may have been set after construction
        if params.n != 1:
            raise ValueError(f"SamplingParams.n must be 1 for Engine.add_request (one request per sample: "
                             f"LLM.generate and the server fan n out), got {params.n}")
        bad_words = check_sampling_params(params, self.limits, self.eos_token_ids, self.tokenizer)
        ids = self._prompt_ids(prompt, params.truncate_prompt_tokens, self.max_model_len - 1)
        check_length(len(ids), self.max_model_len)
        request_id = self._new_request_id(request_id)
        params, grammar = self.grammar_masks.for_request(params, ids, self.eos_token_ids)
        req = Request(request_id, ids, params, prompt if isinstance(prompt, str) else None, arrival_time)
        req.grammar, req.bad_words_ids, req.priority = grammar, bad_words, priority
        req.stream_deltas = stream_deltas
        req.max_tokens = max_tokens_of(params, len(ids), self.limits)
        check_capacity(len(ids), req.max_tokens, self.limits)
        self._queue(req)
        return request_id

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's grammar ahead of its add_request, which then finds it compiled: the one method of an
        Engine that may run on another thread while the engine steps (a served loop compiles there, AsyncEngine).
        ValueError naming the field if it cannot be compiled, as add_request would raise (its fields are checked
        first, as add_request checks them: params may have been changed since they were built)."""
        params.validate()
        self.grammar_masks.precompile(params, self.eos_token_ids)

    def _add_pooling_request(self, prompt: str | list[int], params: PoolingParams, request_id: str | None,
                             arrival_time: float | None, priority: int) -> str:
        """add_request on a pooling engine (engine/pooling.py): the prompt is prefilled, never decoded; its request
        finishes with its embedding once its last chunk is computed. ValueError naming the field, as add_request."""
        if self.pooler is None:
            raise ValueError("PoolingParams: embedding needs a pooling engine (EngineConfig.runner 'pooling', "
                             "--runner pooling); this one generates")
        self._check_priority(priority)
        pooling = request_pooling(params, self.pooler, self.model_config)
        ids = self._prompt_ids(prompt, params.truncate_prompt_tokens, self.max_model_len)
        if len(ids) > self.max_model_len:           # nothing to generate: a prompt may fill the context
            raise ValueError(f"prompt is {len(ids)} tokens, longer than max_model_len {self.max_model_len}")
        check_capacity(len(ids), 0, self.limits)
        request_id = self._new_request_id(request_id)
        # the sampling fields are unused, but the cache_salt is the block manager's (its hits only within one salt)
        req = Request(request_id, ids, SamplingParams(cache_salt=params.cache_salt),
                      prompt if isinstance(prompt, str) else None, arrival_time)
        req.pooling, req.priority, req.max_tokens = pooling, priority, 0
        self._queue(req)
        return request_id

    def _prompt_ids(self, prompt: str | list[int], truncate: int | None, most: int) -> list[int]:
        """The prompt's token ids (its last `truncate` ones, -1: `most`; the server truncates as it encodes),
        checked."""
        if truncate is not None and truncate > self.max_model_len:    # as vLLM's
            raise ValueError(f"truncate_prompt_tokens ({truncate}) is greater than max_model_len "
                             f"({self.max_model_len})")
        ids = self.tokenize(prompt)
        if truncate is not None:
            ids = ids[-(most if truncate == -1 else truncate):]
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:     # C-level scans: a long prompt's check costs microseconds
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _new_request_id(self, request_id: str | None) -> str:
        if request_id is None:      # the counter's next id no request holds: a caller may have chosen "3" itself
            return next(i for i in map(str, self._ids) if i not in self.requests)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return request_id

    def _check_priority(self, priority) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs the priority scheduling policy (EngineConfig."
                             f"scheduling_policy='priority', --scheduling-policy priority); this engine's is "
                             f"{self.config.scheduling_policy!r}")

    def _queue(self, req: Request) -> None:
        """Hand an admitted request to the scheduler (add_request, a pooling request, a peer's offer)."""
        # LongRoPE: a request that may grow past the original context rotates every key with the long factors; P and
        # D apply the same rule, so both sides rotate the request's keys alike
        req.position_offset = longrope_position_offset(self.model_config.rope_scaling,
                                                       self.model_config.max_position_embeddings,
                                                       req.num_prompt_tokens, req.max_tokens)
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
               arrival_time: float | None = None, priority: int = 0) -> str:
        """add_request for a session's driver: refused after close(), and on a decode engine."""
        if self.config.role == "d":
            raise RuntimeError("a decode engine takes requests from its prefill engine, not submit()")
        if self.closed:
            raise EngineClosedError("the engine is closed (no more requests): submit refused")
        return self.add_request(prompt, params, request_id, arrival_time, priority)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request; its final output, or None if it is gone, or its output is the peer's to send."""
        req = self.requests.get(request_id)
        if req is None:
            offered = self.grammar_masks.drop_offer(request_id)    # D: an offer whose grammar compiles
            if offered is not None:
                return self._refuse_offer(offered, FinishReason.ABORT)
            if self.connector is not None:
                self.connector.forward_abort(request_id)
            return None
        if req.is_finished:        # aborted already; its blocks wait for the connector
            return None
        answers = self.connector is None or self.connector.answers_for(req)
        req.finish(FinishReason.ABORT)
        self._drop(req)
        if self._in_flight is not None and self._in_flight.all_finished():
            self._in_flight = None     # nothing of it is read: else has_work stays true and an idle loop spins
        return self.make_output(req) if answers else None

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request the engine tracks; the outputs abort gives (those that are this engine's to send)."""
        outputs = [self.abort(rid) for rid in list(self.requests) + list(self.grammar_masks.offers)]
        return [out for out in outputs if out is not None]

    def _drop(self, req: Request) -> None:
        """A finished request leaves the scheduler; it stays listed while the connector holds its blocks."""
        self._stalled = False              # its slot (and blocks) may admit a waiting request: schedule again
        if not self.scheduler.finish(req):    # else held: listed until the connector releases it
            del self.requests[req.request_id]

    @property
    def num_running(self) -> int:
        """Requests the scheduler runs (the server's vllm:num_requests_running)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (vllm:num_requests_waiting)."""
        return len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._held) or self.scheduler.has_unfinished() \
            or self._in_flight is not None and not self._in_flight.all_finished()

    def hold_outputs(self, outputs: list[RequestOutput]) -> None:
        """Outputs a caller stepping the engine for its own requests (LLM.generate) took for others (a request added
        through this step API beside it): the next step() returns them first, so no final output is lost."""
        self._held.extend(outputs)

    def has_work(self) -> bool:
        """Anything to compute or a step's tokens to read, as opposed to requests only held for the
        connector (waiting on the peer): a loop may wait for input only when there is none. Waiting
        requests the last schedule could not admit are not work either: only the connector (blocks
        released, KV arrived) or input frees room for them, so the loop polls instead of spinning, which
        would hold the GIL from the transfer's threads (a full P stalled its KV server to ~0.4 pulls/s)."""
        return bool(self._held) or self._in_flight is not None or self.scheduler.has_work() and not self._stalled

    def shutdown(self) -> None:
        """Stop the executor's helper processes (tensor-parallel workers), if any; idempotent."""
        self.executor.shutdown()
        self.grammar_masks.close()

    # -- a session (roles p and d): connect, close, is_done ------------------------------------
    def connect(self, channel: Channel, transfer: TransferConfig, session: int = 0) -> None:
        """Link a P or D engine to its peer on `channel`; blocks up to transfer.connect_timeout_s.
        Starts a session: an engine whose last session is done may connect again (same weights and
        cache, a new link)."""
        from picovllm.disagg.peer_connector import PeerConnector   # roles p and d only
        if not isinstance(self.connector, PeerConnector):
            raise RuntimeError(f"a {self.config.role!r} engine without a peer connector has no peer to connect to")
        if self.connector.link is not None and not self.is_done():
            raise RuntimeError(f"the {self.config.role} engine's session is still running")
        self.connector.connect(channel, transfer, session, self.executor)
        self.closed = False

    def close(self) -> None:
        """No more requests: submit() refuses; P hands over what it has, then ends the stream to D;
        D gives back offers it has not taken and decodes what it holds."""
        self.closed = True
        if self.connector is not None:
            self.connector.close()

    def is_done(self) -> bool:
        idle = not (self.has_unfinished_requests() or self.grammar_masks.offers)   # (offers whose grammar compiles)
        return self.connector.is_done(idle) if self.connector is not None else self.closed and idle

    # -- the step ------------------------------------------------------------------------------
    def step(self, unfinished_outputs: bool = True) -> list[RequestOutput]:
        """One engine step. With unfinished_outputs=False only finished requests get a RequestOutput
        (LLM.generate's case: building one per request per step costs ~1 ms at batch 256).
        Overlapped, the outputs returned are those of the step launched by the previous call."""
        device = self.executor.device
        if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):     # Triton launches on the caller's current device
                return self._step(unfinished_outputs)
        return self._step(unfinished_outputs)

    def _step(self, unfinished_outputs: bool) -> list[RequestOutput]:
        outputs, self._held = self._held, []
        if self.connector is not None:
            outputs += self._poll_connector()
        run = self._run_overlapped if self.overlap else self._run_serial
        return outputs + run(unfinished_outputs)

    def _run_serial(self, unfinished_outputs: bool) -> list[RequestOutput]:
        """Schedule a step, run it, apply its results."""
        sched = self._schedule()
        if sched.is_empty():
            return []
        step, _ = self._prepare(sched)    # nothing is in flight: no mask waits for a token
        return self.postprocess(sched, self.executor.execute(step), unfinished_outputs)

    def _run_overlapped(self, unfinished_outputs: bool) -> list[RequestOutput]:
        """Schedule and launch step N+1, then read step N (in flight) and apply its results (the module doc)."""
        try:
            sched = self._schedule()
            launched, early = self._launch(sched) if not sched.is_empty() else (None, None)
            self._mark(Mark.LAUNCHED)
            outputs = self._apply_in_flight(early, unfinished_outputs)
            self._in_flight = InFlight(sched, launched) if launched is not None else None
            if self._in_flight is not None and self._in_flight.all_finished():
                self._in_flight = None     # every request in it has finished meanwhile: nothing to read
            self._mark(Mark.RETURNED)
            return outputs
        except BaseException:
            self._in_flight = None     # a failed step is not read again (the caller aborts its requests)
            raise

    def _launch(self, sched: SchedulerOutput) -> tuple[LaunchedStep, StepResult | None]:
        """Launch a step behind the one in flight, and account it. Constrained rows that wait on the step in flight's
        tokens get their masks while the device computes this step's forward, which reads that step early: its
        result is returned then (else None)."""
        prev = self._in_flight
        step, late = self._prepare(sched)
        self._mark(Mark.PREPARED)
        read: list[StepResult] = []

        def fill_late_masks() -> None:     # the executor calls it before this step's sampling
            read.append(self.executor.resolve(prev.launched))
            self.grammar_masks.fill_late(step, late, prev.sched, read[0])

        launched = self.executor.launch(step, prev.launched if prev else None, fill_late_masks if late else None)
        self.advance(sched)
        return launched, (read[0] if read else None)

    def _apply_in_flight(self, early: StepResult | None, unfinished_outputs: bool) -> list[RequestOutput]:
        """The step in flight's results (read now, unless _launch read them early), applied."""
        if self._in_flight is None:
            return []
        result = early if early is not None else self.executor.resolve(self._in_flight.launched)
        self._mark(Mark.READ)
        return self.apply_results(self._in_flight.sched, result, unfinished_outputs)

    def _mark(self, mark: Mark) -> None:
        """PICOVLLM_STEP_LOG: a wall time in the scheduled step's entry (engine/step_log.py)."""
        if self._step_marks is not None:
            self._step_marks[mark] = time.time()

    def _prepare(self, sched: SchedulerOutput) -> tuple[StepInput, list[tuple[int, Request]]]:
        """The executor's StepInput, with the masks of constrained rows whose grammar has taken every
        token so far; and the others, (row, Request), which wait for a token in flight (GrammarMasks.fill_late)."""
        step = self.executor.prepare(sched, self.eos_token_ids)
        return step, self.grammar_masks.fill(step, sched, self.executor.device)

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        self._stalled = not (sched.chunks or sched.preempted or sched.kv_to_receive)
        now = time.time()
        if STEP_LOG is not None:     # before first_scheduled_time is set: the entry counts the requests admitted
            self._step_marks = STEP_LOG.scheduled(sched, len(self.scheduler.waiting), now)
        for c in sched.chunks:
            if c.request.metrics.first_scheduled_time is None:
                c.request.metrics.first_scheduled_time = now
        for req in sched.kv_to_receive:      # their blocks are allocated: the KV may come in
            self.connector.start_recv(req)
        return sched

    # -- the connector's report ----------------------------------------------------------------
    def _poll_connector(self) -> list[RequestOutput]:
        """Apply what the connector saw since the last step: requests offered, arrived, released,
        failed, aborted by the peer. Queue changes go through the scheduler."""
        rep: ConnectorReport = self.connector.poll(idle=not self.has_unfinished_requests())
        outputs = self._take_compiled_offers() if self.grammar_masks.offers else []
        for req in rep.offered:
            refused = self._take_offer(req)
            outputs += [refused] if refused is not None else []
        for rid in rep.arrived:
            req = self.requests[rid]
            for token in req.output_token_ids:     # the text state, as if this engine had sampled them
                req.text += self.detokenizer.append(req, token)
            self.scheduler.kv_arrived(req)
        for rid in rep.released:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.release(req)
            else:
                self.grammar_masks.drop_offer(rid)     # given back while its grammar compiled
        for rid, error in rep.failed.items():
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.release(req)
            elif (req := self.grammar_masks.drop_offer(rid)) is None:    # (failed while its grammar compiled)
                continue
            if not req.is_finished:          # an aborted one had its final output already
                req.finish(FinishReason.ERROR, error=error)
                outputs.append(self.make_output(req))
        for rid, handover in rep.published.items():   # its last output here; the blocks stay held
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                out = self.make_output(req)
                out.finished, out.kv_handover = True, handover
                outputs.append(out)
        for rid in rep.aborted:                   # last: whatever the lists above did to it stands
            out = self.abort(rid)
            outputs += [out] if out is not None else []
        return outputs

    def _take_offer(self, req: Request) -> RequestOutput | None:
        """Queue a request the peer offers (its KV is there), or refuse it: the connector tells the peer
        why, and the refusal is this engine's output if it answers for the request. One with a grammar is
        queued once the grammar has compiled, off this thread (GrammarMasks.compile_offer): a long one takes
        seconds, which every request decoding here would wait out (_take_compiled_offers)."""
        rid = req.request_id
        try:
            if rid in self.requests or rid in self.grammar_masks.offers:
                raise ValueError(f"request_id {rid!r} is already in use on the {self.config.role} engine")
            req.bad_words_ids = check_offer(req, self.limits, self.config.role, self.tokenizer)
        except ValueError as e:
            return self._refuse_offer(req, FinishReason.ERROR, str(e))
        if req.params.structured_outputs is not None:
            self.grammar_masks.compile_offer(req, self.eos_token_ids)
        else:
            self._queue(req)
        return None

    def _take_compiled_offers(self) -> list[RequestOutput]:
        """Offers whose grammar has compiled, queued with their matcher advanced by the peer's tokens; refused
        (naming the field) where it did not compile or does not take those tokens."""
        outputs = []
        for req, error in self.grammar_masks.compiled_offers():
            try:
                if error is not None:
                    raise error
                req.grammar = self.grammar_masks.state_on_decode(req, self.eos_token_ids)
            except Exception as e:  # noqa: BLE001 - a ValueError names the field; anything else fails this offer only
                why = str(e) if isinstance(e, ValueError) else \
                    f"{req.params.structured_outputs.field_name}: compiling the grammar failed: {type(e).__name__}: {e}"
                refused = self._refuse_offer(req, FinishReason.ERROR, why)
                outputs += [refused] if refused is not None else []
                continue
            self._queue(req)
        return outputs

    def _refuse_offer(self, req: Request, reason: FinishReason, error: str | None = None) -> RequestOutput | None:
        """An offered request not queued (refused, or aborted while its grammar compiled): the connector gives it
        back to the peer; its output if this engine answers for it."""
        req.finish(reason, error=error)
        answers = self.connector.answers_for(req)      # asked first: request_finished forgets it
        self.connector.request_finished(req)
        return self.make_output(req) if answers else None

    # -- applying a step's results, and outputs ------------------------------------------------
    def postprocess(self, sched: SchedulerOutput, result: StepResult,
                    unfinished_outputs: bool = True) -> list[RequestOutput]:
        self.advance(sched)
        return self.apply_results(sched, result, unfinished_outputs)

    def advance(self, sched: SchedulerOutput) -> None:
        """Account a launched step: its chunks' tokens are computed, and each sampling chunk's
        request is decoding and has one token pending (its row among the sampled rows)."""
        row = 0
        for chunk in sched.chunks:
            req = chunk.request
            if chunk.drafts:     # its last token is computed; the drafts' KV counts once apply_results keeps them
                self.stats.decode_tokens += 1
                req.num_computed_tokens += 1
                req.speculating = True
            else:
                if chunk.is_decode:
                    self.stats.decode_tokens += chunk.num_new_tokens
                else:
                    self.stats.prefill_tokens += chunk.num_new_tokens
                req.num_computed_tokens += chunk.num_new_tokens
            self.block_manager.cache_full_blocks(req)
            if self.window is not None:
                self.block_manager.free_slid_out(req, self.window)
            if chunk.samples:
                req.status = DECODING
                req.num_pending_tokens += 1
                req.pending_row = row
                row += chunk.num_samples
                if not chunk.is_decode:
                    self.scheduler.prompt_computed(req)

    def apply_results(self, sched: SchedulerOutput, result: StepResult,
                      unfinished_outputs: bool = True) -> list[RequestOutput]:
        """Give each sampling chunk's request its token (a pooling step: each pooling chunk's its pooled row);
        finish, free and report as needed."""
        if result.pooled is not None:
            return self._apply_pooled(sched, result.pooled)
        now = time.time()
        # the step's sequences: a chunk each, but a speculative one's decode rows (step_input.build_step_input)
        seqs = [c for c in sched.chunks for _ in range(1 + len(c.drafts))] if result.prompt_logprobs else []
        for seq, pos, logprobs in result.prompt_logprobs:
            scored = seqs[seq].request.prompt_logprobs
            if pos + 1 == len(scored):   # else scored before a preemption, or the request is gone
                self._decode_tokens(logprobs)
                scored.append(logprobs)
        outputs, tokens, logprobs = [], result.token_ids, result.logprobs
        for row, chunk in sched.sampling_chunks():
            req = chunk.request
            if req.is_finished:      # finished or aborted while this step ran: its token is dropped
                continue
            req.num_pending_tokens -= 1
            self.append_token(req, tokens[row], logprobs[row], now)
            if chunk.drafts:         # the rows after the token's: one a draft
                after = slice(row + 1, row + chunk.num_samples)
                self._keep_drafts(req, chunk.drafts, list(zip(tokens[after], logprobs[after])), now)
            self.block_manager.cache_full_blocks(req)   # a block ending in this token may be full now
            finished = req.is_finished
            if finished or (unfinished_outputs and self._streams_now(req)
                            and req.params.output_kind != FINAL_ONLY):
                outputs.append(self.make_output(req))
            if finished:
                self._drop(req)
            elif not chunk.is_decode and req.request_id in self.scheduler.held:
                self.connector.start_send(req)          # held after its prompt: its first token is known
        return outputs

    def _keep_drafts(self, req: Request, drafts: list[int], after: list[tuple], now: float) -> None:
        """Speculative decoding (engine/spec_decode.py): the request has its chunk's first sampled token; after[i] is
        (the token, its logprobs) sampled after drafts[i]. Each draft equal to the token sampled before it was the
        right input, so the token after it follows; the first draft that differs, or a finish, ends the run. The
        drafts kept count as computed."""
        kept, token = 0, req.output_token_ids[-1]
        decoding = req.status is DECODING    # before a kept token finishes it
        for draft, (token_after, logprobs) in zip(drafts, after):
            if req.is_finished or token != draft:
                break
            kept += 1
            self.append_token(req, token_after, logprobs, now)
            token = token_after
        req.speculating = False       # it may be scheduled again: a step that left it out did not stall
        self._stalled = False
        self.proposer.record(req, kept)
        if decoding:          # not preempted while its step was in flight (overlapped); finished here or not,
            req.num_computed_tokens += kept     # its KV holds the kept drafts'
        self.stats.decode_tokens += kept      # advance counted the chunk's first row
        self.stats.drafts += 1
        self.stats.draft_tokens += len(drafts)
        self.stats.accepted_tokens += kept
        for i in range(kept):
            self.accepted_per_pos[i] += 1
        if self.window is not None:     # blocks the kept drafts filled may be behind the window already: cache first
            self.block_manager.cache_full_blocks(req)
            self.block_manager.free_slid_out(req, self.window)

    def _apply_pooled(self, sched: SchedulerOutput, pooled: torch.Tensor) -> list[RequestOutput]:
        """A pooling step's rows, one per pooling chunk in order, added to its request's sum (mean pooling; a chunk
        from the prompt's start begins it again: the request was preempted and is recomputed). After its prompt's
        last chunk a request has its embedding, finishes and frees its blocks (engine/pooling.py)."""
        outputs, rows = [], iter(pooled)
        for chunk in sched.chunks:
            if not chunk.pools:
                continue
            row, req = next(rows), chunk.request
            if req.is_finished:      # aborted while this step ran
                continue
            restart = chunk.start == 0 or not req.pooling.mean
            req.pooled = row if restart else req.pooled + row
            if chunk.start + chunk.num_new_tokens == req.num_prompt_tokens:
                req.embedding = req.pooling.embedding(req.pooled, req.num_prompt_tokens)
                req.finish(FinishReason.STOP)
                outputs.append(self.make_output(req))
                self._drop(req)
        return outputs

    def append_token(self, req: Request, token: int, logprobs, now: float) -> None:
        req.output_token_ids.append(token)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.token_times.append(now)
        if logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs[token].logprob
        stops = stop_token(req, token, self.eos_token_ids)
        delta = ""
        if not stops or req.params.include_stop_str_in_output:
            delta = self.detokenizer.append(req, token)      # a stop token's text stays out (vLLM's)
            req.text += delta
        check_stop(req, token, delta, self.eos_token_ids, self.max_model_len, stops, self.primary_eos)
        grammar = req.grammar
        if grammar is not None and not req.is_finished:
            # it takes its newest token, unless GrammarMasks.fill_late gave it already; it refuses one only if the mask
            # was overridden (e.g. min_tokens)
            if grammar.num_accepted < len(req.output_token_ids) and not grammar.accept(token):
                req.finish(FinishReason.ERROR, error=f"token {token} does not match the structured output's grammar")
            elif grammar.is_terminated:     # a stop token the grammar ends with, e.g. under ignore_eos
                req.finish(FinishReason.STOP, stop_reason=token)

    def _decode_tokens(self, logprobs: dict[int, Logprob]) -> None:
        if self.tokenizer is not None:
            for tok, lp in logprobs.items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.tokenizer.decode([tok])

    def _streams_now(self, req: Request) -> bool:
        """A running request's output goes out at its first token, then once stream_interval tokens are new."""
        return req.num_streamed_tokens == 0 \
            or len(req.output_token_ids) - req.num_streamed_tokens >= self.config.stream_interval

    def make_output(self, req: Request) -> RequestOutput:
        """The request's output: all of it so far, or (SamplingParams.output_kind DELTA) what is new since its last
        one: the tokens and logprobs after those, and the text after what went out. Either way, while it runs, the
        text's last (longest stop string - 1) characters are held back, as vLLM's: a stop string completing later
        would cut them, and no output takes back text an earlier one showed (none with include_stop_str_in_output,
        whose cut keeps all that came before)."""
        p, finished = req.params, req.is_finished
        delta = p.output_kind == DELTA or (p.output_kind == CUMULATIVE and (self.stream_deltas or req.stream_deltas))
        first = req.num_streamed_tokens if delta else 0      # the first output token this output holds
        req.num_streamed_tokens = len(req.output_token_ids)
        logprobs = req.logprobs
        if logprobs is not None:
            for d in logprobs[req.num_decoded_logprobs:]:     # each position's texts once, not at every output
                self._decode_tokens(d)
            req.num_decoded_logprobs = len(logprobs)
            if delta and first < len(logprobs) and self.config.role != "p":
                # out now, never again: the request lets them go (a served engine's full collections walked each
                # one); a P engine hands them to D
                kept, logprobs = logprobs, logprobs[first:]
                kept[first:] = [None] * len(logprobs)
            else:
                logprobs = logprobs[first:]
        text = req.text
        hold = max(map(len, p.stop)) - 1 if p.stop and not (finished or p.include_stop_str_in_output) else 0
        start = req.num_streamed_chars if delta else 0
        end = max(req.num_streamed_chars, len(text) - hold)      # a text shorter than the held-back tail: no more
        text, req.num_streamed_chars = text[start:end], end
        comp = CompletionOutput(0, text, req.output_token_ids[first:],
                                req.cumulative_logprob if logprobs is not None else None, logprobs,
                                req.finish_reason.value if req.finish_reason else None, req.stop_reason)
        prompt_logprobs = list(req.prompt_logprobs) if req.prompt_logprobs is not None and not (delta and first) \
            else None
        # the prompt ids never change after add_request, so they are shared rather than copied per step
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], finished,
                             req.metrics, req.error, req.num_cached_tokens, prompt_logprobs, embedding=req.embedding)
