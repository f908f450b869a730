"""The engine: add_request, step, abort. One step = schedule, run, postprocess, collect outputs.

With overlapped scheduling (EngineConfig.async_scheduling; on by default on one GPU) a step
schedules and launches step N+1 before it reads step N's sampled tokens, so the host's work
(scheduling, input preparation, detokenizing, stop checks) runs while the device computes:

    step():  schedule N+1 -> launch N+1 (its decodes read N's tokens on the device) -> advance
             -> wait for N's tokens -> append them, check stops, emit outputs of N

Requests are advanced (computed tokens, one pending token) when a step is launched and get
their token when it is resolved. A request that finishes at step N has already been given a
slot in step N+1; that token is computed and dropped (its KV write lands in its own blocks,
ordered on the device before any later step that reuses them).
"""
from __future__ import annotations

import itertools
import time

import torch

from picovllm.config import EngineConfig
from picovllm.engine.block_manager import BlockManager, prefix_salt
from picovllm.engine.detokenizer import Detokenizer, check_stop
from picovllm.engine.model_runner import LaunchedStep, ModelRunner, StepResult
from picovllm.engine.request import FinishReason, Request, RequestStatus
from picovllm.engine.scheduler import Scheduler, SchedulerOutput
from picovllm.loader import open_model_source
from picovllm.outputs import CompletionOutput, RequestOutput
from picovllm.sampling_params import SamplingParams


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        source = open_model_source(config.model, config.disk_cache)
        self.model_config = source.config
        self.tokenizer = None
        if not config.skip_tokenizer_init and source.load_tokenizer is not None:
            self.tokenizer = source.load_tokenizer()
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None \
                and self.tokenizer.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids.append(self.tokenizer.eos_token_id)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.runner = runner or self._make_runner(source)
        num_blocks = self.runner.profile_num_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        salt = prefix_salt(source.path, config.torch_dtype)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, salt)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self.overlap = config.async_scheduling
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None   # overlap: launched, not read
        self._ids = itertools.count()
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0}

    def _make_runner(self, source) -> ModelRunner:
        if self.config.tensor_parallel_size > 1:
            from picovllm.engine.tp_executor import TPModelRunner
            return TPModelRunner(self.config, source)
        return ModelRunner(self.config, source)

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt must be a string or a list of int token ids")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validate and queue a request. Raises ValueError naming the bad field; nothing else changes."""
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
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be in [0, {vocab}), got {params.stop_token_ids}")
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids in [0, {vocab}), got "
                             f"{max(params.logit_bias)}")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):   # banned from the logits before min_tokens
            raise ValueError(f"SamplingParams.stop_token_ids must be in [0, {vocab}), got {params.stop_token_ids!r}")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"SamplingParams.logprobs must be <= the vocabulary size {vocab}, got {params.logprobs}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, longer than max_model_len - 1 = {self.max_model_len - 1}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        req = Request(request_id, ids, params, prompt if isinstance(prompt, str) else None, arrival_time)
        room = self.max_model_len - len(ids)
        req.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(ids) + req.max_tokens > capacity:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({req.max_tokens}) tokens exceed the KV cache "
                             f"({capacity} tokens)")
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.remove(req)
        req.finish(FinishReason.ABORT)
        return self.make_output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None and \
            not all(c.request.is_finished for c in self._in_flight[0].chunks)

    def shutdown(self) -> None:
        """Stop the runner's helper processes (tensor-parallel workers), if any; idempotent."""
        self.runner.shutdown()

    # -- the step ------------------------------------------------------------------------------
    def step(self, unfinished_outputs: bool = True) -> list[RequestOutput]:
        """One engine step. With unfinished_outputs=False only finished requests get a RequestOutput
        (LLM.generate's case: building one per request per step costs ~1 ms at batch 256).
        Overlapped, the outputs returned are those of the step launched by the previous call."""
        device = self.runner.device
        if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):     # Triton launches on the caller's current device
                return self._step(unfinished_outputs)
        return self._step(unfinished_outputs)

    def _step(self, unfinished_outputs: bool) -> list[RequestOutput]:
        if self.overlap:
            return self._overlapped_step(unfinished_outputs)
        sched = self._schedule()
        if sched.is_empty():
            return []
        result = self.runner.execute(self.runner.prepare(sched, self.eos_token_ids))
        return self.postprocess(sched, result, unfinished_outputs)

    def _overlapped_step(self, unfinished_outputs: bool) -> list[RequestOutput]:
        try:
            return self._overlapped_step_inner(unfinished_outputs)
        except BaseException:
            self._in_flight = None     # a failed step is not read again (the caller aborts its requests)
            raise

    def _overlapped_step_inner(self, unfinished_outputs: bool) -> list[RequestOutput]:
        sched = self._schedule()
        launched = None
        if not sched.is_empty():
            prev = self._in_flight[1] if self._in_flight else None
            launched = self.runner.launch(self.runner.prepare(sched, self.eos_token_ids), prev)
            self.advance(sched)
        outputs = []
        if self._in_flight is not None:
            done_sched, done = self._in_flight
            outputs = self.apply_results(done_sched, self.runner.resolve(done), unfinished_outputs)
        self._in_flight = (sched, launched) if launched is not None else None
        if launched is not None and all(c.request.is_finished for c in sched.chunks):
            self._in_flight = None     # every request in it has finished meanwhile: nothing to read
        return outputs

    def _schedule(self) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        now = time.time()
        for c in sched.chunks:
            if c.request.metrics.first_scheduled_time is None:
                c.request.metrics.first_scheduled_time = now
        return sched

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
            self.stats["decode_tokens" if chunk.is_decode else "prefill_tokens"] += chunk.num_new_tokens
            req.num_computed_tokens += chunk.num_new_tokens
            self.block_manager.cache_full_blocks(req)
            if chunk.samples:
                req.status = RequestStatus.DECODING
                req.num_pending_tokens += 1
                req.pending_row = row
                row += 1

    def apply_results(self, sched: SchedulerOutput, result: StepResult,
                      unfinished_outputs: bool = True) -> list[RequestOutput]:
        """Give each sampling chunk's request its token; finish, free and report as needed."""
        now = time.time()
        outputs, sampled = [], iter(zip(result.token_ids, result.logprobs))
        for chunk in sched.chunks:
            if not chunk.samples:
                continue
            token, logprobs = next(sampled)
            req = chunk.request
            if req.is_finished:      # finished or aborted while this step ran: its token is dropped
                continue
            req.num_pending_tokens -= 1
            self.append_token(req, token, logprobs, now)
            self.block_manager.cache_full_blocks(req)   # a block ending in this token may be full now
            if unfinished_outputs or req.is_finished:
                outputs.append(self.make_output(req))
            if req.is_finished:
                self.scheduler.remove(req)
                del self.requests[req.request_id]
        return outputs

    def append_token(self, req: Request, token: int, logprobs, now: float) -> None:
        req.output_token_ids.append(token)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.token_times.append(now)
        if logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs[token].logprob
        delta = self.detokenizer.append(req, token)
        req.text += delta
        check_stop(req, token, delta, self.eos_token_ids, self.max_model_len)

    def make_output(self, req: Request) -> RequestOutput:
        if req.logprobs is not None and self.tokenizer is not None:
            for d in req.logprobs:
                for tok, lp in d.items():
                    if lp.decoded_token is None:
                        lp.decoded_token = self.tokenizer.decode([tok])
        comp = CompletionOutput(0, req.text, list(req.output_token_ids),
                                req.cumulative_logprob if req.logprobs is not None else None,
                                list(req.logprobs) if req.logprobs is not None else None,
                                req.finish_reason.value if req.finish_reason else None, req.stop_reason)
        # the prompt ids never change after add_request, so they are shared rather than copied per step
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], req.is_finished,
                             req.metrics, req.error, req.num_cached_tokens)
