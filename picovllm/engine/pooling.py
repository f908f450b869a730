"""Pooling (embedding) models: EngineConfig.runner "pooling", as vLLM's runner="pooling".

A request is a prompt that is prefilled and never decodes. Its embedding is made from the final-norm hidden states
of its prompt tokens (what a generating engine gives the LM head): the last token's, or the mean over all of them;
cut to its first `dimensions` (Matryoshka models), then L2-normalized.

Where: ModelRunner.compute_logits, the seam where hidden states become logits, sums rows of the step's hidden states
instead (StepInput.pooled_rows: a prompt's last row, or under mean pooling every row of each chunk), and
ModelRunner.launch_sampling copies those sums to the host in place of sampled tokens (StepResult.pooled). The engine
adds a request's chunks up (Request.pooled) and, after its prompt's last chunk, makes its embedding and finishes it,
which frees its blocks. The model has no LM head (ModelRunner drops it; a bare checkpoint has none).

Chunked prefill needs nothing more: a mean is the sum of its chunks' sums over the prompt's length. Prefix caching:
last-token pooling takes cached blocks as generation does (the prompt's last token is always computed); mean pooling
needs every token's hidden state, so its requests take none (their own blocks are cached for others), and one that is
preempted starts again from its first token, whose chunk restarts the sum.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from picovllm.config import ModelConfig, PoolerConfig
from picovllm.engine.sampling import LaunchedStep, _to_host
from picovllm.engine.step_input import to_device
from picovllm.pooling_params import PoolingParams


@dataclass(frozen=True)
class Pooling:
    """One request's pooling, resolved from its PoolingParams, the engine's pooler and the model."""
    mean: bool                     # the mean over every prompt token, else the last token's hidden state
    normalize: bool
    dimensions: int | None = None  # Matryoshka: the first this many values

    def embedding(self, pooled: torch.Tensor, num_tokens: int) -> list[float]:
        """pooled: float32 on the host, the last token's hidden state or (mean) the sum over num_tokens tokens."""
        v = pooled / num_tokens if self.mean else pooled
        if self.dimensions is not None:     # cut, then normalize (vLLM's order)
            v = v[:self.dimensions]
        if self.normalize:
            v = torch.nn.functional.normalize(v, dim=-1)
        return v.tolist()


def request_pooling(params: PoolingParams, pooler: PoolerConfig, model: ModelConfig) -> Pooling:
    """A request's Pooling; ValueError naming the PoolingParams field it cannot honour."""
    params.validate()
    dims = params.dimensions
    if dims is not None:
        if not model.is_matryoshka:
            raise ValueError(f"PoolingParams.dimensions {dims}: the model is not Matryoshka-trained (its config.json "
                             "has no is_matryoshka or matryoshka_dimensions), so a cut embedding would be a poor one; "
                             "hf_overrides '{\"is_matryoshka\": true}' if it is")
        if model.matryoshka_dimensions is not None and dims not in model.matryoshka_dimensions:
            raise ValueError(f"PoolingParams.dimensions {dims}: the model is trained for "
                             f"{model.matryoshka_dimensions} only")
        if dims > model.hidden_size:
            raise ValueError(f"PoolingParams.dimensions {dims} exceeds the model's hidden size {model.hidden_size}")
    normalize = pooler.normalize if params.normalize is None else params.normalize
    return Pooling(pooler.pooling_type == "MEAN", normalize, dims)


# sentence-transformers' Pooling module's modes -> vLLM's pooling types (those picovllm runs; others are refused)
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
             "pooling_mode_max_tokens": "MAX", "pooling_mode_mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
             "pooling_mode_weightedmean_tokens": "WEIGHTED_MEAN"}


def engine_pooler(given: PoolerConfig | None, model_path: str) -> PoolerConfig:
    """The engine's pooler: EngineConfig.pooler_config's fields, else what the model folder's sentence-transformers
    config says (modules.json: its Pooling module's mode, a Normalize module or not; vLLM reads them alike), else
    vLLM's defaults for decoder models: the last token, normalized. ValueError naming what it cannot run."""
    given = given or PoolerConfig()
    folder = PoolerConfig()
    modules_path = os.path.join(model_path, "modules.json")
    if os.path.isdir(model_path) and os.path.isfile(modules_path):
        with open(modules_path) as f:
            modules = json.load(f)
        types = [str(m.get("type", "")) for m in modules]
        folder.normalize = any(t.endswith(".Normalize") for t in types)
        pooling = next((m for m, t in zip(modules, types) if t.endswith(".Pooling")), None)
        config_path = os.path.join(model_path, str(pooling.get("path", "")), "config.json") if pooling else ""
        if os.path.isfile(config_path):
            with open(config_path) as f:
                modes = [_ST_MODES.get(k, k) for k, on in json.load(f).items() if k.startswith("pooling_mode") and on]
            if modes and given.pooling_type is None:
                if len(modes) > 1 or modes[0] not in ("LAST", "MEAN"):
                    raise ValueError(f"{config_path}: pooling {' + '.join(modes)}; picovllm pools LAST or MEAN only "
                                     "(EngineConfig.pooler_config pooling_type sets one)")
                folder.pooling_type = modes[0]
    return PoolerConfig(given.pooling_type or folder.pooling_type or "LAST",
                        next(n for n in (given.normalize, folder.normalize, True) if n is not None))


def pool_rows(hidden: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    """[len(rows), hidden] float32 on the device: each range [a, b) of the step's rows summed (one row: that row)."""
    segment = [i for i, (a, b) in enumerate(rows) for _ in range(a, b)]
    flat = [r for a, b in rows for r in range(a, b)]
    out = torch.zeros(len(rows), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    index = to_device(flat, torch.long, hidden.device)
    return out.index_add_(0, to_device(segment, torch.long, hidden.device), hidden.index_select(0, index).float())


def launch_pooled(pooled: torch.Tensor) -> LaunchedStep:
    """A pooling step's LaunchedStep: the pooled rows' copy to the host queued (resolve reads StepResult.pooled)."""
    launched = LaunchedStep(None, [], [], None, pooled=_to_host(pooled))
    if pooled.is_cuda:
        launched.done = torch.cuda.Event()
        launched.done.record()
    return launched
