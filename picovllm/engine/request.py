"""A request's state as it moves WAITING -> PREFILL (one or more chunks) -> DECODING -> FINISHED."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from picovllm.outputs import Logprob, RequestMetrics
from picovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from picovllm.engine.pooling import Pooling
    from picovllm.engine.step_input import SamplingRow


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, no KV computed (or preempted: KV dropped)
    PREFILL = "prefill"      # some prompt tokens computed, more chunks to go
    DECODING = "decoding"    # prompt done, one token per step
    FINISHED = "finished"


# The members as module names, for the checks made several times a request a step: on Python 3.11 a member read
# through its class costs ~55 ns more than a global (EnumType's __getattr__ slows every attribute read of an enum class)
WAITING, PREFILL = RequestStatus.WAITING, RequestStatus.PREFILL
DECODING, FINISHED = RequestStatus.DECODING, RequestStatus.FINISHED


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        # A fresh list per request: a shared default list once merged every request's outputs.
        self.output_token_ids: list[int] = []    # only appended to (penalties count it as it grows: PenaltyCounts)
        self.params = params
        self.priority = 0                # the "priority" scheduling policy's: lower goes first (vLLM's)
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_computed_tokens = 0     # tokens whose K/V is in the cache (or is being computed)
        # Overlapped scheduling: a token sampled on the device by a step still in flight, not yet
        # appended here (0 or 1), and that token's row among the step's sampled rows.
        self.num_pending_tokens = 0
        self.pending_row = -1
        # speculative decoding: the proposer's state (spec_decode.LookupState); a speculative chunk of it is in flight
        self.lookup = None
        self.speculating = False
        self.num_cached_tokens = 0       # of the prompt, how many the prefix cache held at its first admission
        self.prefix_hit_tokens = 0       # of the computed ones, how many the cache gave at the latest admission
        # Only appended to in place: any other change assigns a new list (the graph runners' StagedTables, which
        # write only a table's new entries, rely on it, and so does the TP wire, which sends only those:
        # engine/step_codec.py).
        self.block_table: list[int] = []
        self.num_slid_out_blocks = 0     # the table's first entries, given back (block_manager.SLID_OUT)
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks, in order
        # each output position's, until a DELTA output (Engine.make_output) gives it out: None from then on
        self.logprobs: list[dict[int, Logprob] | None] | None = [] if params.logprobs is not None else None
        self.num_decoded_logprobs = 0    # of those, the first ones whose texts are filled in (Engine.make_output)
        # Filled in prompt order as the prompt's chunks are computed; entry i is prompt token i's.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = \
            [None] if params.prompt_logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        self.text = ""                   # detokenized output (stop string trimmed)
        self.num_streamed_tokens = 0     # output tokens in the last RequestOutput made (EngineConfig.stream_interval)
        self.num_streamed_chars = 0      # of the text, shown by the outputs made so far (Engine.make_output)
        self.stream_deltas = False       # CUMULATIVE, yet its outputs hold only what is new (Engine.add_request)
        self.detok_state: object | None = None
        self.max_tokens = params.max_tokens  # resolved against max_model_len by the engine
        self.grammar = None              # structured outputs: a GrammarState, set by the engine
        self.bad_words_ids: list[list[int]] = []   # SamplingParams.bad_words as token ids, set by the engine
        # the SamplingRow its later steps share once none of its fields changes from step to step (step_input.py)
        self.fixed_sampling_row: SamplingRow | None = None
        # Added to every position the rotary embedding sees (LongRoPE's long factors: layers/rotary.py); the
        # prefix cache keeps such a request's blocks apart from others', whose keys were rotated otherwise.
        self.position_offset = 0
        # A pooling engine's request (engine/pooling.py): its prompt is prefilled, never decoded (params are
        # SamplingParams' defaults, unused); its chunks' pooled rows add up in `pooled` (float32, on the host)
        self.pooling: Pooling | None = None
        self.pooled: torch.Tensor | None = None
        self.embedding: list[float] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Every token of the sequence, including one still being sampled by a step in flight."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host (num_tokens less the pending one)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def awaiting_last_token(self) -> bool:
        """Its last allowed token is being sampled (a pooling request: its prompt's last chunk is launched):
        another step for it would be wasted."""
        if self.pooling is not None:
            return self.num_computed_tokens >= self.num_prompt_tokens
        return self.num_pending_tokens > 0 and self.num_output_tokens >= self.max_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens start .. end - 1 of the sequence (known ones), by slicing, not building all_token_ids."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def token_id(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    @property
    def is_finished(self) -> bool:
        return self.status is FINISHED

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.metrics.finished_time = time.time()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})")
