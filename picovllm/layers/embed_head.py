"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from picovllm.distributed import SINGLE, TPGroup
from picovllm.kernels.cpu.quant_gemm import QuantizedWeight, refine_top_logits


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // tp.size)
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden), requires_grad=False)
        self.weight.weight_loader = self.load
        self.quantized = None   # a QuantizedWeight of the table on the CPU (loader/quantized_weights.py)

    def load(self, param: nn.Parameter, w: torch.Tensor, shard: object = None, name: str = "") -> None:
        if w.shape[0] != self.vocab_size or w.shape[1] != param.shape[1]:
            raise ValueError(f"weight {name}: shape mismatch, model expects ({self.vocab_size}, {param.shape[1]}), "
                             f"checkpoint has {tuple(w.shape)}")
        part = w[self.start:self.start + self.shard]
        param.data[:part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:   # tensor parallel size 1
            return self.quantized.dequantize(ids.reshape(-1)).view(*ids.shape, -1)
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        out = F.embedding(local.clamp(0, self.shard - 1), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(vocab_size, hidden, tp)
        self.packed = None   # a PackedWeight on the CPU (see packed_linear.py), set after loading

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.packed(hidden) if self.packed is not None else F.linear(hidden, self.weight)
        if isinstance(self.packed, QuantizedWeight) and hidden.dim() == 2:
            local = refine_top_logits(local, hidden, self.packed)
        logits = self.tp.all_gather_last_dim(local)
        return logits[..., :self.vocab_size]
