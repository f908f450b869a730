"""quantization="q8_0": an HF folder's float matrices quantized as they load, for the CPU's quantized kernels.

Each 2-d weight whose rows split into blocks of 32 (every linear layer, the embedding and the LM head) becomes
the kernels' q8 form (gguf_quants.DecodedBlocks): int8 codes and a float32 scale per 16 weights, the scale
being the block's largest magnitude / 127, so every weight is within half a step (scale / 2) of its value.
The rest (norms, biases, odd shapes) stays float32. The model then loads as a GGUF's quantized tensors do
(loader/quantized_weights.py). Opt-in: CPU, float32, one rank; anywhere else it is refused, never ignored.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import torch

from picovllm.loader.gguf_quants import DecodedBlocks
from picovllm.loader.source import ModelSource
from picovllm.loader.weights import unfused

GROUP = 16       # weights per scale
VERSION = 1      # in the cache key: a change to the rounding makes new entries


def quantize_q8(w: torch.Tensor) -> DecodedBlocks:
    """[n, k] float (k a multiple of 32) -> q8 blocks: code = round(w / d), d = max |w| over its 16 / 127."""
    n, k = w.shape
    groups = w.detach().to(torch.float32).reshape(n, k // GROUP, GROUP)
    d = groups.abs().amax(-1) / 127.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    codes = torch.round(groups / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return DecodedBlocks("q8", codes.reshape(n, k).numpy(), d.numpy().astype(np.float32), None, np.dtype(np.float32))


def quantizes(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".weight") and t.dim() == 2 and t.shape[1] % 32 == 0


def with_q8_0(source: ModelSource, device: torch.device, dtype: torch.dtype, tp_size: int) -> ModelSource:
    """source with stored_weights that quantize its matrices at load; ValueError naming the field where
    quantization='q8_0' cannot run."""
    if source.stored_weights is not None:
        raise ValueError("EngineConfig.quantization 'q8_0' quantizes an HF folder at load; a GGUF runs in its own "
                         "quantized form with 'auto' (or as float32 with 'none')")
    if source.config.num_experts:
        raise ValueError("EngineConfig.quantization 'q8_0' quantizes dense models; this one routes to experts "
                         f"({source.config.architecture}): give 'none' or 'bf16'")
    if device.type != "cpu" or dtype != torch.float32 or tp_size != 1:
        raise ValueError("EngineConfig.quantization 'q8_0' runs on the CPU in float32 with tensor_parallel_size 1, "
                         f"got device {device.type}, dtype {dtype}, tensor_parallel_size {tp_size}")

    def stored() -> Iterator[tuple[str, object]]:
        # q/k/v or gate/up stored fused (Phi-3, GLM-4) as their parts: the fused layers load each part's blocks
        for name, t in unfused(source.weights(), source.config):
            yield name, (quantize_q8(t) if quantizes(name, t) else t.to(torch.float32))

    identity = None if source.identity is None else (*source.identity, ("q8_0", GROUP, VERSION))
    return dataclasses.replace(source, stored_weights=stored, identity=identity)
