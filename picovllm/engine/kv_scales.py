"""FP8 KV cache (EngineConfig.kv_cache_dtype "fp8"): the scales, and the one quantization rule every path shares.

Every attention path (the torch reference here and in layers/attention.py, the Triton store, decode and prefill
kernels) stores x8 = fp8_e4m3fn(clamp(x / scale, -448, 448)) and reads x8 * scale, with one float32 scale per
layer and KV head, for K and for V apart.

How the scales are obtained: a calibration at load. The model runs one forward in its own dtype over a fixed
built-in English text (CALIBRATION_TEXT; token ids from a fixed generator when the model has no tokenizer), and
each layer records the largest |K| and |V| of each KV head (K after its norm and rotary, both times the layer's
kv_rotation: as the cache holds them).
scale = 2 ** ceil(log2(HEADROOM * amax / 448)): the largest representable value is 2-4x the calibrated amax
(headroom for texts that excite a head more than this one; beyond it values clamp at ±448 * scale), and a power
of two makes x / scale and x8 * scale exact, so the only error is fp8's own rounding (3 mantissa bits), the
same in every kernel. Powers of two also make the scales robust: engines that compute the calibration forward
with slightly different sums (TP=1 and TP=2, GPU and CPU) land on the same power of two unless an amax sits
right on a boundary; P and D compare their scales at the handshake (KVLayout.kv_scales) and refuse a mismatch.

Checkpoint scales (the k_scale/v_scale tensors of FP8-quantized checkpoints) are not read: the families
picovllm loads ship none, and a calibration costs one short forward (~256 tokens).
"""
from __future__ import annotations

import hashlib
import math

import torch

from picovllm.layers.attention import (FP8_DTYPE, FP8_MAX, AttentionBackend, AttentionMetadata,  # noqa: F401
                                       TorchAttentionBackend, dequantize, kv_rotation, quantize)
from picovllm.layers.fp8_weights import has_float8

HEADROOM = 2.0
CALIBRATION_TOKENS = 256
CALIBRATION_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had "
    "done before him. From the lamp room he could see the harbour, the fishing boats coming home, and the long "
    "grey line of the coast running north towards the city. On clear nights the beam reached twenty miles out "
    "to sea. He kept a logbook of the weather, the ships that passed, and the birds that rested on the gallery "
    "rail: gulls, terns, once a tired owl that stayed until morning. Question: why do lighthouses still matter "
    "when ships carry satellite navigation? Answer: because instruments fail, storms knock out power, and a "
    "light on a rock is a simple thing that works. In 1848 the keeper's log recorded 312 ships; in 1998, 41. "
    "def count_ships(log):\n    return sum(1 for line in log if line.startswith('ship'))\n"
    "Les phares guident les marins depuis l'Antiquite. El faro de Alejandria era una de las siete maravillas. "
    "Numbers, names and punctuation -- 3.14159, Ada Lovelace, (brackets), [lists], {sets} -- all pass through.")


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Per-head |x| maxima -> power-of-two scales that put HEADROOM * amax within ±448."""
    need = (amax.double().clamp_min(1e-6) * HEADROOM / FP8_MAX).log2().ceil()
    return torch.pow(2.0, need).float()


def calibration_ids(load_tokenizer, vocab_size: int) -> list[int]:
    """CALIBRATION_TEXT's first CALIBRATION_TOKENS token ids, or fixed pseudo-random ids without a tokenizer."""
    if load_tokenizer is not None:
        ids = list(load_tokenizer()(CALIBRATION_TEXT).input_ids)[:CALIBRATION_TOKENS]
        if len(ids) >= 16:
            return ids
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (CALIBRATION_TOKENS,), generator=g).tolist()


class _AmaxRecorder(AttentionBackend):
    """One layer's backend during calibration: records |K|, |V| maxima per KV head, attends without a cache."""

    def __init__(self) -> None:
        self.k_amax: torch.Tensor | None = None
        self.v_amax: torch.Tensor | None = None

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None, softcap=None, kv_scales=None, sinks=None):
        self.k_amax = k.float().abs().amax(dim=(0, 2))
        self.v_amax = v.float().abs().amax(dim=(0, 2))
        return TorchAttentionBackend._attend(q, k, v, scale, window, softcap, sinks)


@torch.inference_mode()
def calibrate(model: torch.nn.Module, token_ids: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over token_ids (one sequence, positions from 0) -> (k_scales, v_scales) [layers, this rank's
    KV heads] float32 on device. Every tensor-parallel rank must call it at once (the forward's collectives)."""
    layers = model.attention_layers()
    saved = [a.backend for a in layers]
    recorders = [_AmaxRecorder() for _ in layers]
    n = len(token_ids)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
        num_decodes=0, max_query_len=n, max_seq_len=n, query_lens_cpu=[n], seq_lens_cpu=[n])
    try:
        for a, r in zip(layers, recorders):
            a.backend = r
        model(torch.tensor(token_ids, dtype=torch.long, device=device), torch.arange(n, device=device), meta)
    finally:
        for a, b in zip(layers, saved):
            a.backend = b
    k = torch.stack([scales_from_amax(r.k_amax) for r in recorders]).to(device)
    v = torch.stack([scales_from_amax(r.v_amax) for r in recorders]).to(device)
    return k, v


def scales_digest(k_scales: torch.Tensor, v_scales: torch.Tensor) -> str:
    """A short fingerprint of full-head scales [layers, total KV heads], what P and D compare at the handshake."""
    data = torch.stack([k_scales, v_scales]).detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def describe(k_scales: torch.Tensor, v_scales: torch.Tensor) -> str:
    """The scales' range, for logs and errors."""
    def span(s: torch.Tensor) -> str:
        return f"2^{int(math.log2(s.min().item()))}..2^{int(math.log2(s.max().item()))}"
    return f"K {span(k_scales)}, V {span(v_scales)}"


def bind_calibrated(model: torch.nn.Module, source, tp, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibrate, give each attention layer its (k_scale, v_scale) of this rank's KV heads, and return the
    full-head scales [layers, total KV heads] (under tensor parallelism: every rank's, gathered by a max-reduce,
    so every rank returns the same)."""
    if not has_float8(device):
        raise ValueError("EngineConfig.kv_cache_dtype 'fp8' needs a GPU with float8 e4m3 (compute capability 8.9+: "
                         f"Ada, Hopper), this one is {torch.cuda.get_device_name(device)}")
    ids = calibration_ids(source.load_tokenizer, source.config.vocab_size)
    ids = ids[:source.config.max_position_embeddings]      # positions within the rotary table
    dtype = next(model.parameters()).dtype
    for a in model.attention_layers():      # first: the calibration sees K and V as the cache will hold them
        a.kv_rotation = kv_rotation(a.head_dim, dtype, device)
    k, v = calibrate(model, ids, device)
    for i, a in enumerate(model.attention_layers()):
        a.kv_scales = (k[i].contiguous(), v[i].contiguous())
    if device.type == "cuda":   # the CPU's packed, quantized and C-stack weights keep the output's matmul
        fold_output_rotations(model)
    if tp.size == 1:
        return k, v
    import torch.distributed as dist

    start, count = _local_kv_heads(model)
    full = torch.zeros(2, k.shape[0], source.config.num_key_value_heads, dtype=torch.float32, device=device)
    full[0, :, start:start + count], full[1, :, start:start + count] = k, v
    dist.all_reduce(full, op=dist.ReduceOp.MAX, group=tp.group)    # replicated heads: the same on each rank
    return full[0], full[1]


def fold_output_rotations(model: torch.nn.Module) -> int:
    """Where an attention module's output projection is its `o_proj` (the shared decoder's and Gemma's layers), move
    the cache's rotation R into that projection: o_proj(out R) = x_rot @ (W B)^T with B = diag(R, ..., R) over the
    heads, so W's columns of head h become W_h R (in float64, rounded once to W's dtype) and the attention output
    stays rotated (Attention.output_rotated): one [tokens, heads, D] x [D, D] matmul a layer fewer. Under tensor
    parallelism a rank's o_proj holds its own heads' columns, so the fold is local. An fp8 o_proj is not folded
    (its codes would change). Returns the layers folded."""
    from picovllm.layers.attention import Attention
    n = 0
    for m in model.modules():
        attn, o_proj = getattr(m, "attn", None), getattr(m, "o_proj", None)
        if not isinstance(attn, Attention) or attn.kv_rotation is None or attn.output_rotated or o_proj is None:
            continue
        w = getattr(o_proj, "weight", None)
        if w is None or w.dim() != 2 or not w.dtype.is_floating_point or getattr(o_proj, "packed", None) is not None \
                or w.shape[1] != attn.num_heads * attn.head_dim:     # (MLA's o_proj reads v_head_dim a head)
            continue
        if w.dtype.itemsize == 1:       # fp8 weights (quantization "fp8") keep their codes: R stays in attention
            continue
        r = attn.kv_rotation.to(torch.float64)
        heads = attn.num_heads
        w.data.copy_((w.data.to(torch.float64).view(w.shape[0], heads, attn.head_dim) @ r).view(w.shape))
        attn.output_rotated = True
        n += 1
    return n


def _local_kv_heads(model: torch.nn.Module) -> tuple[int, int]:
    for m in model.modules():
        if hasattr(m, "kv_head_start") and hasattr(m, "total_kv_heads"):
            return m.kv_head_start, m.num_kv_heads
    raise ValueError("the model has no QKVParallelLinear: cannot tell which KV heads this rank holds")
