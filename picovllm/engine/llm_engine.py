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
import os
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from picovllm.config import EngineConfig
from picovllm.gc_freeze import freeze_before_first_engine
from picovllm.engine.block_manager import BlockManager, prefix_salt
from picovllm.engine.detokenizer import Detokenizer, check_stop, stop_token
from picovllm.engine.kv_connector import ConnectorReport, KVConnector
from picovllm.engine.executor import Executor, InProcessExecutor, make_executor
from picovllm.engine.model_runner import LaunchedStep, ModelRunner, StepResult
from picovllm.engine.pooling import engine_pooler, request_pooling
from picovllm.engine.request import FinishReason, Request, RequestStatus
from picovllm.engine.scheduler import Scheduler, SchedulerOutput
from picovllm.engine.spec_decode import NgramProposer
from picovllm.engine.step_log import STEP_LOG, Mark
from picovllm.engine.step_input import StepInput
from picovllm.layers.logits_processors import bad_words_token_ids
from picovllm.layers.rotary import longrope_position_offset
from picovllm.layers.structured_output import BitmaskBuffers, GrammarState, StructuredOutputCompiler
from picovllm.loader import engine_model_source, open_model_source
from picovllm.outputs import CompletionOutput, Logprob, RequestOutput
from picovllm.pooling_params import PoolingParams
from picovllm.reasoning import HarmonyTags, ThinkTags, reasoning_gate
from picovllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

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


def tokenizer_of(source, config: EngineConfig):
    """The tokenizer an engine of this config uses: config.tokenizer's, else the model source's, or None (none there,
    skip_tokenizer_init)."""
    if config.skip_tokenizer_init:
        return None
    if config.tokenizer is not None:
        return open_tokenizer(config.tokenizer, config.disk_cache)
    return None if source.load_tokenizer is None else source.load_tokenizer()


def open_tokenizer(name: str, disk_cache: bool = True):
    """vLLM's --tokenizer: an HF folder's or Hub repository's tokenizer files (no config.json needed), or a .gguf
    file's; ValueError naming EngineConfig.tokenizer when there is none to load."""
    from picovllm.loader.hf_folder import TOKENIZER_FILES
    from picovllm.loader.source import resolve_model
    try:
        path = resolve_model(name, weights_needed=False)
        if os.path.isdir(path):
            if not any(os.path.exists(os.path.join(path, n)) for n in TOKENIZER_FILES):
                raise ValueError(f"the folder has none of the tokenizer files {', '.join(TOKENIZER_FILES)}")
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(path)
        load = open_model_source(path, disk_cache, weights_needed=False).load_tokenizer
        if load is None:
            raise ValueError("it holds no tokenizer")
        return load()
    except (ValueError, OSError) as e:
        raise ValueError(f"EngineConfig.tokenizer {name!r}: {e}") from None


class Engine:
    def __init__(self, config: EngineConfig, executor: ModelRunner | Executor | None = None,
                 connector: KVConnector | None = None) -> None:
        """executor: run the model through this (a ModelRunner runs in this process) instead of the
        executor the config asks for (tests inject one); connector: instead of the role's."""
        self.config = config
        # as vLLM's: the generators unseeded sampling draws from start from config.seed, so the same requests in the
        # same order sample the same tokens run to run (a request's own seed makes it independent of the rest)
        random.seed(config.seed)
        torch.manual_seed(config.seed)
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
        # the reasoning parsers' gates (structured outputs), by name: the config's (checked before the weights load),
        # or at a request's first ask
        self._reasoning_gates: dict[str, ThinkTags | HarmonyTags] = {}
        if config.reasoning_parser:
            self._reasoning_gate(config.reasoning_parser, f"EngineConfig.reasoning_parser {config.reasoning_parser!r}")
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            # cut, and said (vLLM refuses it; benchmarks here pass one length to models of every context)
            logger.warning("EngineConfig.max_model_len %d is longer than the model's context, %d (max_position_"
                           "embeddings, with its rope scaling): max_model_len is %d",
                           config.max_model_len, limit, limit)
        self.max_model_len = min(config.max_model_len or limit, limit)
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
        spec = config.speculative_config      # speculative decoding: the drafts' proposer (engine/spec_decode.py)
        self.proposer = NgramProposer(spec, self.max_model_len, config.async_scheduling) if spec is not None else None
        # every layer slides: blocks behind the window are given back as requests go (and at admission)
        self.window = self._kv_window()
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.connector, config.scheduling_policy, self.proposer, config.max_decode_rows,
                                   self.window)
        self.closed = False            # close() was called: submit() refuses
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.overlap = config.async_scheduling
        if self.overlap and not self.executor.supports_overlap:
            raise ValueError("EngineConfig.async_scheduling: this executor cannot launch a step behind one in flight")
        self._in_flight: InFlight | None = None   # overlap: the step launched, not read yet
        self._stalled = False      # the last schedule changed nothing: its waiting requests wait for blocks or slots
        self._step_marks: list | None = None   # PICOVLLM_STEP_LOG: the last scheduled step's entry, if it has one
        self._ids = itertools.count()
        self._structured: StructuredOutputCompiler | None = None   # built at the first structured request
        self._bitmasks: BitmaskBuffers | None = None       # the grammar masks' buffers, at the first such step
        # speculative decoding's draft_tokens fed, accepted_tokens kept (vLLM's spec_decode num_draft_tokens and
        # num_accepted_tokens) and drafts (speculative chunks)
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        # drafts kept by position in their chunk (vLLM's num_accepted_tokens_per_pos): entry i counts the chunks whose
        # first i + 1 drafts were kept, so it never grows along the list
        self.accepted_per_pos = [0] * (spec.num_speculative_tokens if spec is not None else 0)

    def _kv_window(self) -> int | None:
        """The longest sliding window when every layer has one (None if any layer attends to everything). P keeps
        every block: it hands the whole prompt's KV over."""
        mc = self.model_config
        windows = [mc.layer_window(i) for i in range(mc.num_hidden_layers)]
        if self.config.role == "p" or not windows or None in windows:
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
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(map(isinstance, prompt, itertools.repeat(int))):
            raise ValueError("prompt must be a string or a list of int token ids")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, priority: int = 0) -> str:
        """Validate and queue a request. Raises ValueError naming the bad field; nothing else changes.
        params: a pooling engine's are PoolingParams (None: the defaults), a generating one's SamplingParams.
        priority: the "priority" scheduling policy's order (lower first); with "fcfs" it must be 0."""
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
        vocab = self.model_config.vocab_size
        # These would otherwise fail inside a step, taking the whole batch down with them.
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"SamplingParams.logprobs must be <= the vocabulary size {vocab}, got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise ValueError(f"SamplingParams.prompt_logprobs must be <= the vocabulary size {vocab}, "
                             f"got {params.prompt_logprobs}")
        if any(t >= vocab for t in params.stop_token_ids):   # banned from the logits before min_tokens
            raise ValueError(f"SamplingParams.stop_token_ids must be in [0, {vocab}), got {params.stop_token_ids}")
        allowed = params.allowed_token_ids
        if allowed is not None:
            if max(allowed) >= vocab:
                raise ValueError(f"SamplingParams.allowed_token_ids must be token ids in [0, {vocab}), "
                                 f"got {max(allowed)}")
            if params.structured_outputs is not None:   # the two masks could leave no token at all
                raise ValueError("SamplingParams.allowed_token_ids cannot be combined with structured outputs")
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if params.min_tokens and set(allowed) <= ends:   # banned before min_tokens: nothing left to sample
                raise ValueError("SamplingParams.allowed_token_ids holds only stop tokens, which min_tokens bans")
        if params.min_tokens and params.structured_outputs is not None:   # the grammar may end before min_tokens
            raise ValueError("SamplingParams.min_tokens cannot be combined with structured outputs: the grammar may "
                             "end before it, and min_tokens bans the end")
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids in [0, {vocab}), got "
                             f"{max(params.logit_bias)}")
        bad_words = self._bad_words(params)
        ids = self._prompt_ids(prompt, params.truncate_prompt_tokens, self.max_model_len - 1)
        self._check_length(len(ids))
        request_id = self._new_request_id(request_id)
        so = params.structured_outputs
        if so is not None and so.reasoning_parser is None and self.config.reasoning_parser is not None:
            # the engine's parser goes with the request (a copy: the caller's params stay as they were), so a
            # decode engine it is handed to gates its grammar as this engine did, whatever its own config says
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                so, reasoning_parser=self.config.reasoning_parser))
        grammar = self._grammar_state(params, ids) if params.structured_outputs is not None else None
        req = Request(request_id, ids, params, prompt if isinstance(prompt, str) else None, arrival_time)
        req.grammar = grammar
        req.bad_words_ids = bad_words
        req.priority = priority
        room = self.max_model_len - len(ids)
        if params.max_tokens is None:      # the room left: in the context, and in a KV cache that holds less
            bm = self.block_manager
            unset = room if self.window is not None else min(room, bm.num_blocks * bm.block_size - len(ids))
            req.max_tokens = max(unset, 1)   # a prompt that fills the cache: _check_capacity refuses it
        else:
            req.max_tokens = min(params.max_tokens, room)
        req.position_offset = longrope_position_offset(self.model_config.rope_scaling,
                                                       self.model_config.max_position_embeddings, len(ids),
                                                       req.max_tokens)
        self._check_capacity(len(ids), req.max_tokens)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

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
        self._check_capacity(len(ids), 0)
        request_id = self._new_request_id(request_id)
        # the sampling fields are unused, but the cache_salt is the block manager's (its hits only within one salt)
        req = Request(request_id, ids, SamplingParams(cache_salt=params.cache_salt),
                      prompt if isinstance(prompt, str) else None, arrival_time)
        req.pooling, req.priority, req.max_tokens = pooling, priority, 0
        req.position_offset = longrope_position_offset(self.model_config.rope_scaling,
                                                       self.model_config.max_position_embeddings, len(ids), 0)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def _prompt_ids(self, prompt: str | list[int], truncate: int | None, most: int) -> list[int]:
        """The prompt's token ids (its last `truncate` ones, -1: `most`; the server truncates as it encodes),
        checked."""
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
        request_id = str(next(self._ids)) if request_id is None else request_id
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

    def _bad_words(self, params: SamplingParams) -> list[list[int]]:
        """SamplingParams.bad_words as token ids; ValueError naming the field if they cannot be honoured."""
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs the model's tokenizer")
        # with another mask on the row, the two could leave no token at all
        if params.structured_outputs is not None:
            raise ValueError("SamplingParams.bad_words cannot be combined with structured outputs")
        if params.allowed_token_ids is not None:
            raise ValueError("SamplingParams.bad_words cannot be combined with allowed_token_ids")
        ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        if any(t >= self.model_config.vocab_size for word in ids for t in word):
            raise ValueError(f"SamplingParams.bad_words: a word has a token outside the model's vocabulary "
                             f"({self.model_config.vocab_size})")
        return ids

    def _reasoning_gate(self, parser: str, what: str) -> ThinkTags | HarmonyTags:
        """The tokens a reasoning parser's grammar gate watches for (picovllm/reasoning.py); ValueError naming `what`
        where the tokenizer has none."""
        if parser in self._reasoning_gates:
            return self._reasoning_gates[parser]
        if self.tokenizer is None:
            raise ValueError(f"{what} needs the model's tokenizer")
        gate = reasoning_gate(self.tokenizer, parser, what)
        ids = gate.token_ids
        if max(ids) >= self.model_config.vocab_size:
            raise ValueError(f"{what}: the tokenizer's reasoning tokens {sorted(set(ids))} are not all inside the "
                             f"model's vocabulary ({self.model_config.vocab_size})")
        self._reasoning_gates[parser] = gate
        return gate

    def _grammar_state(self, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> GrammarState:
        """A matcher for the request's structured output; ValueError naming the field if it cannot be. With a
        reasoning parser, it starts where the prompt leaves the output (picovllm/reasoning.py's gates' begin)."""
        so = params.structured_outputs
        if self.tokenizer is None:
            raise ValueError(f"{so.field_name}: structured outputs need the model's tokenizer")
        if self._structured is None:
            self._structured = StructuredOutputCompiler(self.tokenizer, self.model_config.vocab_size,
                                                        self.eos_token_ids)
        parser = so.reasoning_parser or self.config.reasoning_parser      # the request's own (a front end's) first
        if parser is None:
            return self._structured.new_state(so)
        gate = self._reasoning_gate(parser, f"SamplingParams.structured_outputs.reasoning_parser {parser!r}")
        return self._structured.new_state(so, gate, *gate.begin(prompt_ids))

    def _grammar_on_decode(self, req: Request) -> GrammarState:
        """D: the matcher of an offered request, advanced by the tokens P sampled under the same grammar (P and D
        compile it each, from the request's params); ValueError naming the field if they do not match it."""
        grammar = self._grammar_state(req.params, req.prompt_token_ids)
        for token in req.output_token_ids:
            if not grammar.accept(token):
                raise ValueError(f"{req.params.structured_outputs.field_name}: the prefill engine's token {token} "
                                 f"does not match the grammar here (another tokenizer or grammar version, or a "
                                 f"prefill engine without the EngineConfig.reasoning_parser "
                                 f"{self.config.reasoning_parser!r} this one has?)")
        return grammar

    def _check_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt is {num_prompt_tokens} tokens, longer than max_model_len - 1 = "
                             f"{self.max_model_len - 1}")

    def _check_capacity(self, num_prompt_tokens: int, max_tokens: int) -> None:
        bm = self.block_manager
        capacity = bm.num_blocks * bm.block_size
        need = num_prompt_tokens + max_tokens
        if self.window is not None:   # at most the window, a chunk and a block on either side at once
            need = min(need, self.window + self.config.max_num_batched_tokens + 2 * bm.block_size)
        if need > capacity:
            raise ValueError(f"prompt ({num_prompt_tokens}) + max_tokens ({max_tokens}) tokens exceed the KV cache "
                             f"({capacity} tokens)")

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

    def _drop(self, req: Request) -> None:
        """A finished request leaves the scheduler; it stays listed while the connector holds its blocks."""
        self._stalled = False              # its slot (and blocks) may admit a waiting request: schedule again
        if not self.scheduler.finish(req):    # else held: listed until the connector releases it
            del self.requests[req.request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None and not self._in_flight.all_finished()

    def has_work(self) -> bool:
        """Anything to compute or a step's tokens to read, as opposed to requests only held for the
        connector (waiting on the peer): a loop may wait for input only when there is none. Waiting
        requests the last schedule could not admit are not work either: only the connector (blocks
        released, KV arrived) or input frees room for them, so the loop polls instead of spinning, which
        would hold the GIL from the transfer's threads (a full P stalled its KV server to ~0.4 pulls/s)."""
        return self._in_flight is not None or self.scheduler.has_work() and not self._stalled

    def shutdown(self) -> None:
        """Stop the executor's helper processes (tensor-parallel workers), if any; idempotent."""
        self.executor.shutdown()

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
        idle = not self.has_unfinished_requests()
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
        outputs = self._poll_connector() if self.connector is not None else []
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
            self._fill_late_masks(step, late, prev.sched, read[0])

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
        token so far; and the others, (row, Request), which wait for a token in flight (_fill_late_masks)."""
        step = self.executor.prepare(sched, self.eos_token_ids)
        late: list[tuple[int, Request]] = []
        if self._structured is None:
            return step, late
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
                self._bitmasks = BitmaskBuffers(self.model_config.vocab_size, self.executor.device)
            step.token_bitmasks = self._bitmasks.for_step(len(step.sampling))
            step.token_bitmasks.fill(rows, states)
            for first, grammar, drafts in ahead:
                grammar.fill_ahead(step.token_bitmasks, first, drafts)
        return step, late

    @staticmethod
    def _fill_late_masks(step: StepInput, late: list, done_sched: SchedulerOutput, done: StepResult) -> None:
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
        outputs = []
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
        for rid, error in rep.failed.items():
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self.scheduler.release(req)
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
        why, and the refusal is this engine's output if it answers for the request."""
        try:
            if req.request_id in self.requests:
                raise ValueError(f"request_id {req.request_id!r} is already in use on the {self.config.role} engine")
            self._check_length(req.num_prompt_tokens)
            if req.num_prompt_tokens + req.max_tokens > self.max_model_len:    # P resolved it against its own
                raise ValueError(f"max_tokens: prompt ({req.num_prompt_tokens}) + max_tokens ({req.max_tokens}) "
                                 f"exceed the {self.config.role} engine's max_model_len ({self.max_model_len})")
            self._check_capacity(req.num_prompt_tokens, req.max_tokens)
            req.bad_words_ids = self._bad_words(req.params)
            if req.params.structured_outputs is not None:
                req.grammar = self._grammar_on_decode(req)
        except ValueError as e:
            req.finish(FinishReason.ERROR, error=str(e))
            answers = self.connector.answers_for(req)      # asked first: request_finished forgets it
            self.connector.request_finished(req)
            return self.make_output(req) if answers else None
        # the same rule as add_request's on P: both sides rotate the request's keys alike
        req.position_offset = longrope_position_offset(self.model_config.rope_scaling,
                                                       self.model_config.max_position_embeddings,
                                                       req.num_prompt_tokens, req.max_tokens)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return None

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
                self.stats["decode_tokens"] += 1
                req.num_computed_tokens += 1
                req.speculating = True
            else:
                self.stats["decode_tokens" if chunk.is_decode else "prefill_tokens"] += chunk.num_new_tokens
                req.num_computed_tokens += chunk.num_new_tokens
            self.block_manager.cache_full_blocks(req)
            if self.window is not None:
                self.block_manager.free_slid_out(req, self.window)
            if chunk.samples:
                req.status = RequestStatus.DECODING
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
        outputs, sampled = [], list(zip(result.token_ids, result.logprobs))
        for row, chunk in sched.sampling_chunks():
            token, logprobs = sampled[row]
            req = chunk.request
            if req.is_finished:      # finished or aborted while this step ran: its token is dropped
                continue
            req.num_pending_tokens -= 1
            self.append_token(req, token, logprobs, now)
            if chunk.drafts:         # the rows after the token's: one a draft
                self._keep_drafts(req, chunk.drafts, sampled[row + 1:row + chunk.num_samples], now)
            self.block_manager.cache_full_blocks(req)   # a block ending in this token may be full now
            if req.is_finished or (unfinished_outputs and self._streams_now(req)
                                   and req.params.output_kind != RequestOutputKind.FINAL_ONLY):
                outputs.append(self.make_output(req))
            if req.is_finished:
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
        for draft, (token_after, logprobs) in zip(drafts, after):
            if req.is_finished or token != draft:
                break
            kept += 1
            self.append_token(req, token_after, logprobs, now)
            token = token_after
        req.speculating = False       # it may be scheduled again: a step that left it out did not stall
        self._stalled = False
        self.proposer.record(req, kept)
        if req.status == RequestStatus.DECODING:      # not preempted while its step was in flight (overlapped)
            req.num_computed_tokens += kept
        self.stats["decode_tokens"] += kept      # advance counted the chunk's first row
        self.stats["drafts"] += 1
        self.stats["draft_tokens"] += len(drafts)
        self.stats["accepted_tokens"] += kept
        for i in range(kept):
            self.accepted_per_pos[i] += 1
        if self.window is not None:
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
            # it takes its newest token, unless _fill_late_masks gave it already; it refuses one only if the mask
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
        delta = req.params.output_kind == RequestOutputKind.DELTA
        first = req.num_streamed_tokens if delta else 0      # the first output token this output holds
        req.num_streamed_tokens = len(req.output_token_ids)
        if req.logprobs is not None:
            for d in req.logprobs[first:]:
                self._decode_tokens(d)
        text, p = req.text, req.params
        hold = 0 if req.is_finished or p.include_stop_str_in_output else max(map(len, p.stop), default=1) - 1
        start = req.num_streamed_chars if delta else 0
        end = max(req.num_streamed_chars, len(text) - hold)      # a text shorter than the held-back tail: no more
        text, req.num_streamed_chars = text[start:end], end
        comp = CompletionOutput(0, text, req.output_token_ids[first:],
                                req.cumulative_logprob if req.logprobs is not None else None,
                                req.logprobs[first:] if req.logprobs is not None else None,
                                req.finish_reason.value if req.finish_reason else None, req.stop_reason)
        prompt_logprobs = list(req.prompt_logprobs) if req.prompt_logprobs is not None and not (delta and first) \
            else None
        # the prompt ids never change after add_request, so they are shared rather than copied per step
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], req.is_finished,
                             req.metrics, req.error, req.num_cached_tokens, prompt_logprobs, embedding=req.embedding)
