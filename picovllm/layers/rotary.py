"""Rotary position embedding (the 'rotate half' layout of HF checkpoints), with Llama-3, linear, YaRN or
LongRoPE scaling, or a divisor per frequency (a GGUF's rope_freqs: Llama 3's scaling as llama.cpp's converter
computed it); partial rotary (only each head's first rotary_dim dims turn) and interleaved pairs (Cohere's; GLM-4's,
within a partial rotary) as a full rotate-half rotation of reordered q and k (head_order).

LongRoPE (Phi-3): each frequency is divided by its factor, and cos and sin are scaled by the attention factor. A
sequence uses the short factors while it stays within original_max_position_embeddings and the long ones at every
position once it is longer: HF recomputes the whole sequence with the long factors when it passes that length. Here
a request that may pass it (prompt + max_tokens) takes the long factors from its first token (the engine offsets
its positions by max_position_embeddings into the second half of the table: longrope_position_offset), so its
tokens are HF's after the switch; one that stays within gets HF's short-factor tokens.

YaRN (Qwen's long-context setting, DeepSeek's): the frequencies that turn many times over the original context are
kept, those that turn less than once are divided by `factor`, the band between blended linearly by pair index; cos
and sin are scaled by the attention factor (0.1 ln(factor) + 1 unless the config gives it)."""
from __future__ import annotations

import math

import torch
from torch import nn

from picovllm.kernels.cpu import elementwise as cpu


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv.float()
    if scaling.get("rope_type") == "linear":   # positions divided by `factor`
        return (inv / scaling["factor"]).float()
    if scaling.get("rope_type") == "freq_factors":   # a GGUF's rope_freqs: each frequency divided by its own factor
        return (inv / torch.tensor(scaling["factors"], dtype=torch.float32)).float()
    if scaling.get("rope_type") == "yarn":
        return _yarn(inv, head_dim, theta, scaling)
    # Llama 3: long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    blend = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
    scaled = (1 - blend) * inv / factor + blend * inv
    return scaled.float()


def _yarn(inv: torch.Tensor, head_dim: int, theta: float, s: dict) -> torch.Tensor:
    factor, orig = s["factor"], s["original_max_position_embeddings"]

    def pair_index(turns: float) -> float:   # the (fractional) pair whose frequency turns `turns` times over orig
        return head_dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))
    lo, hi = pair_index(s.get("beta_fast") or 32), pair_index(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if hi == lo:
        hi += 0.001
    # 0 below lo (fast pairs, kept), 1 from hi on (slow pairs, interpolated)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return (inv * (1 - ramp) + inv / factor * ramp).float()


def attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: YaRN's and LongRoPE's attention factor (the config's, else derived from
    the scaling factor, as HF derives it); 1 for the other kinds."""
    kind = scaling.get("rope_type") if scaling else None
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if kind == "longrope":
        orig = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):      # DeepSeek's form
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale()


def longrope_position_offset(scaling: dict | None, max_position: int, prompt_len: int, max_tokens: int) -> int:
    """What to add to a request's positions: max_position (the long factors' half of the table) if it may grow
    past the original context under LongRoPE, else 0."""
    if not scaling or scaling.get("rope_type") != "longrope":
        return 0
    return max_position if prompt_len + max_tokens > scaling["original_max_position_embeddings"] else 0


def longrope_cos_sin(head_dim: int, max_position: int, theta: float, scaling: dict) -> torch.Tensor:
    """[2 * max_position, head_dim]: cos then sin, as RotaryEmbedding holds them, with the short factors for
    positions 0..max_position-1, then with the long ones (a long request's positions are offset by max_position)."""
    for name in ("short_factor", "long_factor"):      # one a rotary frequency
        if not isinstance(scaling[name], (list, tuple)) or len(scaling[name]) != head_dim // 2:
            got = f"{len(scaling[name])} entries" if isinstance(scaling[name], (list, tuple)) else repr(scaling[name])
            raise ValueError(f"config.json rope_scaling.{name}: {got}, where the rotary dimension {head_dim} takes "
                             f"{head_dim // 2} (one a frequency)")
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    pos = torch.arange(max_position, dtype=torch.float64)[:, None]
    short = pos * (base / torch.tensor(scaling["short_factor"], dtype=torch.float64))
    long = pos * (base / torch.tensor(scaling["long_factor"], dtype=torch.float64))
    freqs = torch.cat([short, long])
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor(scaling)).float()


def head_order(cfg) -> list[int] | None:
    """The order the loaders put each q and k head's dims in (new position -> checkpoint dim), so that the model's
    rotation is the rotate-half kind over the whole head every kernel runs; None where the checkpoint's already is.
    Interleaved pairs (Cohere's over the whole head, GLM-4's within its rotated part) first become rotate-half pairs
    of the rotated part, which a partial rotary's rotary_order then spreads over the head. DeepSeek's MLA: None (its
    rope part is not a head's rows here; models/deepseek.py reorders its interleaved pairs itself)."""
    if cfg.kv_lora_rank:
        return None
    d = cfg.head_dim
    rd = cfg.rotary_dim or d
    order = list(range(d))
    if cfg.rotary_interleaved:       # pairs (2i, 2i + 1) -> (i, i + rd / 2)
        order = [*range(0, rd, 2), *range(1, rd, 2), *range(rd, d)]
    if cfg.rotary_dim is not None:
        order = [order[j] for j in rotary_order(d, rd)]
    return None if order == list(range(d)) else order


def head_rows(rows: int, head_dim: int, order: list[int]) -> torch.Tensor:
    """The row indices that put each of `rows // head_dim` heads' dims in `order` (a projection's rows, its bias or
    norm): what both loaders take from a q or k tensor."""
    return torch.arange(rows).view(-1, head_dim)[:, order].reshape(-1)


def rotary_order(head_dim: int, rotary_dim: int) -> list[int]:
    """Partial rotary as a full one: the order of a head's dims (new position -> checkpoint dim) that puts HF's
    rotated pairs (i, i + rotary_dim / 2) at (i, i + head_dim / 2) and pairs up the passed dims two by two, which a
    rotation by angle 0 leaves as they are (RotaryEmbedding's table past rotary_dim / 2). The loaders reorder q's and
    k's rows (and their biases and norms) so; q.k, and so attention, does not change under one order of both."""
    rot, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return [*range(rot), *range(rotary_dim, rotary_dim + rest), *range(rot, rotary_dim),
            *range(rotary_dim + rest, head_dim)]


class RotaryEmbedding(nn.Module):
    """cos_sin [positions, head_dim]: cos then sin of each of the head_dim / 2 pairs' angles; with rotary_dim (partial
    rotary, q and k in rotary_order), the pairs past rotary_dim / 2 turn by angle 0 (cos 1, sin 0)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        rd = rotary_dim or head_dim
        if scaling and scaling.get("rope_type") == "longrope":
            cos_sin = longrope_cos_sin(rd, max_position, theta, scaling)
        else:
            inv = inverse_frequencies(rd, theta, scaling)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
            cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor(scaling)
        if rd < head_dim:
            cos, sin = cos_sin.chunk(2, dim=-1)
            pad = (head_dim - rd) // 2
            cos_sin = torch.cat([cos, torch.ones(len(cos), pad), sin, torch.zeros(len(sin), pad)], dim=-1)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    @classmethod
    def identity(cls, head_dim: int, rows: int) -> "RotaryEmbedding":
        """A rotation by angle 0 at every one of `rows` positions (cos 1, sin 0; as many rows as the model's other
        table, LongRoPE's second half included): a NoPE layer's, on every rotary path."""
        rot = cls(head_dim, 1, 10000.0)
        half = (rows, head_dim // 2)
        rot.cos_sin = torch.cat([torch.ones(half, dtype=torch.float32), torch.zeros(half, dtype=torch.float32)], dim=-1)
        return rot

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D]."""
        if _c_path(q, k, positions, self.cos_sin):    # one C pass each (float32 on the CPU)
            return cpu.rope(q, positions, self.cos_sin), cpu.rope(k, positions, self.cos_sin)
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _c_path(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    heads_contiguous = all(x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k))
    return heads_contiguous and positions.dtype == torch.int64 and positions.device.type == "cpu" \
        and cos_sin.is_contiguous() and cpu.usable(q, k, cos_sin, contiguous=False)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
