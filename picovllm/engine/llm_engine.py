"""The engine: add_request, step, abort. One step = schedule, run, postprocess, collect outputs."""
from __future__ import annotations

import itertools
import time

from picovllm.config import EngineConfig
from picovllm.engine.block_manager import BlockManager, prefix_salt
from picovllm.engine.detokenizer import Detokenizer, check_stop
from picovllm.engine.model_runner import ModelRunner, StepResult
from picovllm.engine.request import FinishReason, Request, RequestStatus
from picovllm.engine.scheduler import Scheduler, SchedulerOutput
from picovllm.loader import open_model_source
from picovllm.outputs import CompletionOutput, RequestOutput
from picovllm.sampling_params import SamplingParams


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        source = open_model_source(config.model)
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
        vocab = self.model_config.vocab_size
        # These would otherwise fail inside a step, taking the whole batch down with them.
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"SamplingParams.logprobs must be <= the vocabulary size {vocab}, got {params.logprobs}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be in [0, {vocab}), got {params.stop_token_ids}")
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
        return self.scheduler.has_unfinished()

    def shutdown(self) -> None:
        """Stop the runner's helper processes (tensor-parallel workers), if any; idempotent."""
        self.runner.shutdown()

    # -- the step ------------------------------------------------------------------------------
    def step(self, unfinished_outputs: bool = True) -> list[RequestOutput]:
        """One engine step. With unfinished_outputs=False only finished requests get a RequestOutput
        (LLM.generate's case: building one per request per step costs ~1 ms at batch 256)."""
        sched = self.scheduler.schedule()
        if sched.is_empty():
            return []
        now = time.time()
        for c in sched.chunks:
            if c.request.metrics.first_scheduled_time is None:
                c.request.metrics.first_scheduled_time = now
        step = self.runner.prepare(sched, self.eos_token_ids)
        result = self.runner.execute(step)
        return self.postprocess(sched, result, unfinished_outputs)

    def postprocess(self, sched: SchedulerOutput, result: StepResult,
                    unfinished_outputs: bool = True) -> list[RequestOutput]:
        now = time.time()
        outputs, sampled = [], iter(zip(result.token_ids, result.logprobs))
        for chunk in sched.chunks:
            req = chunk.request
            samples = chunk.samples
            if req.status == RequestStatus.DECODING:
                self.stats["decode_tokens"] += chunk.num_new_tokens
            else:
                self.stats["prefill_tokens"] += chunk.num_new_tokens
            req.num_computed_tokens += chunk.num_new_tokens
            self.block_manager.cache_full_blocks(req)
            if not samples:
                continue
            token, logprobs = next(sampled)
            self.append_token(req, token, logprobs, now)
            if unfinished_outputs or req.is_finished:
                outputs.append(self.make_output(req))
            if req.is_finished:
                self.scheduler.remove(req)
                del self.requests[req.request_id]
        return outputs

    def append_token(self, req: Request, token: int, logprobs, now: float) -> None:
        req.status = RequestStatus.DECODING
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
