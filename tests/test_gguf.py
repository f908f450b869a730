"""GGUF loading: every supported tensor type against a float64 reimplementation of its block format,
greedy parity with HF transformers on the same weights (the float32 path, quantization="none"), the quantized
path's weights (quantization="auto") equal to the same reference, and errors that name the problem.

The tiny GGUF files are written here with gguf.GGUFWriter, q/k rows permuted as llama.cpp's converter
does. Types the gguf package can quantize are quantized with it; Q4_K and Q6_K blocks are built
byte by byte. The reference weights HF gets are this file's float64 decode of those bytes, un-permuted
by this file's own inverse of the permutation.
"""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from conftest import hf_from_gguf
from picovllm import LLM, SamplingParams
from picovllm.loader.gguf_file import open_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 384, 256, 512, 2, 4, 2, 64
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
REQUANTIZED = ["Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"]     # the CPU runs them in its 8-bit form
PROMPTS = [[1, 17, 250, 3, 99], [5], list(range(40, 73))]


# -- a float64 decoder for each block format (ggml's block layouts) -------------------------------
def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").astype(np.float64)[:, 0]


def decode_q8_0(b):   # 34 bytes: f16 d, 32 x int8
    return _f16(b[:, :2])[:, None] * b[:, 2:].view(np.int8)


def _nibbles(qs):     # byte j holds element j (low nibble) and element j + 16 (high nibble)
    return np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float64)


def decode_q4_0(b):   # 18 bytes: f16 d, 16 bytes of nibbles; x = d * (q - 8)
    return _f16(b[:, :2])[:, None] * (_nibbles(b[:, 2:]) - 8)


def decode_q4_1(b):   # 20 bytes: f16 d, f16 m, 16 bytes of nibbles; x = d * q + m
    return _f16(b[:, :2])[:, None] * _nibbles(b[:, 4:]) + _f16(b[:, 2:4])[:, None]


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins."""
    s = s.astype(np.int64)
    sc, mn = np.empty((len(s), 8)), np.empty((len(s), 8))
    for j in range(8):
        if j < 4:
            sc[:, j], mn[:, j] = s[:, j] & 63, s[:, j + 4] & 63
        else:
            sc[:, j] = (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4)
            mn[:, j] = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
    return sc, mn


def decode_q4_k(b):   # 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    return _decode_k(b[:, :16], b[:, 16:], None)


def decode_q5_k(b):   # 176 bytes: as Q4_K with 32 bytes of 5th bits before the nibbles
    return _decode_k(b[:, :16], b[:, 48:], b[:, 16:48].astype(np.int64))


def _decode_k(head, qs, qh):
    d, dmin = _f16(head[:, :2]), _f16(head[:, 2:4])
    sc, mn = _k4_scales(head[:, 4:16])
    out = np.empty((len(qs), 256))
    for i in range(4):            # 64 values per chunk: 32 low nibbles, then 32 high nibbles
        q = qs[:, 32 * i:32 * i + 32]
        for half, vals in enumerate([q & 0xF, q >> 4]):
            j = 2 * i + half      # sub-block j; its 5th bits: bit j of qh[l]
            vals = vals.astype(np.float64) + (0 if qh is None else 16 * ((qh >> j) & 1))
            out[:, 64 * i + 32 * half:64 * i + 32 * half + 32] = \
                (d * sc[:, j])[:, None] * vals - (dmin * mn[:, j])[:, None]
    return out


def decode_q6_k(b):   # 210 bytes: 128 low-nibble bytes, 64 bytes of 2-bit highs, 16 int8 scales, f16 d
    ql, qh, sc, d = b[:, :128].astype(np.int64), b[:, 128:192].astype(np.int64), b[:, 192:208].view(np.int8), _f16(b[:, 208:])
    out = np.empty((len(b), 256))
    l = np.arange(32)
    for h in range(2):            # two halves of 128 values
        lo, hi, s = ql[:, 64 * h:64 * h + 64], qh[:, 32 * h:32 * h + 32], sc[:, 8 * h:8 * h + 8].astype(np.float64)
        quads = [(lo[:, l] & 0xF) | ((hi & 3) << 4), (lo[:, l + 32] & 0xF) | (((hi >> 2) & 3) << 4),
                 (lo[:, l] >> 4) | (((hi >> 4) & 3) << 4), (lo[:, l + 32] >> 4) | (((hi >> 6) & 3) << 4)]
        for k, q in enumerate(quads):
            out[:, 128 * h + 32 * k + l] = d[:, None] * s[:, l // 16 + 2 * k] * (q - 32)
    return out


def _fifth_bits(qh: np.ndarray) -> np.ndarray:   # 4 bytes: bit j is element j's 5th bit
    return ((qh.astype(np.uint64) << (8 * np.arange(4, dtype=np.uint64))).sum(1)[:, None] >> np.arange(32, dtype=np.uint64)) & 1


def decode_q5_0(b):   # 22 bytes: f16 d, 4 bytes of 5th bits, 16 bytes of nibbles; x = d * (q - 16)
    return _f16(b[:, :2])[:, None] * (_nibbles(b[:, 6:]) + 16 * _fifth_bits(b[:, 2:6]) - 16)


def decode_q5_1(b):   # 24 bytes: f16 d, f16 m, 4 bytes of 5th bits, 16 bytes of nibbles; x = d * q + m
    return _f16(b[:, :2])[:, None] * (_nibbles(b[:, 8:]) + 16 * _fifth_bits(b[:, 4:8])) + _f16(b[:, 2:4])[:, None]


def decode_q3_k(b):   # 110 bytes: 32 bytes of 3rd bits (set: +0, clear: -4), 64 of 2-bit codes, 12 of scales, f16 d
    hm, qs, s, d = b[:, :32].astype(np.int64), b[:, 32:96].astype(np.int64), b[:, 96:108].astype(np.int64), _f16(b[:, 108:])
    i = np.arange(16)     # 6-bit scales: low nibble from byte i % 8 (high half for i >= 8), 2 high bits from byte 8 + i % 4
    sc = (((s[:, i % 8] >> (4 * (i // 8))) & 0xF) | (((s[:, 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)) - 32
    out = np.empty((len(b), 256))
    for n in range(2):            # two halves of 128 values, 32 code bytes each
        for j in range(4):        # 2-bit field j of those bytes: 32 values, 16 per scale
            for half in range(2):
                at = 32 * n + 16 * half + np.arange(16)
                q = ((qs[:, at] >> (2 * j)) & 3) - 4 * (((hm[:, at - 32 * n] >> (4 * n + j)) & 1) == 0)
                out[:, 128 * n + 32 * j + 16 * half + np.arange(16)] = (d * sc[:, 8 * n + 2 * j + half])[:, None] * q
    return out


def decode_q2_k(b):   # 84 bytes: 16 bytes of (scale, min) nibbles, 64 of 2-bit codes, f16 d, f16 dmin
    s, qs, d, dmin = b[:, :16].astype(np.int64), b[:, 16:80].astype(np.int64), _f16(b[:, 80:82]), _f16(b[:, 82:84])
    out = np.empty((len(b), 256))
    for n in range(2):
        for j in range(4):
            for half in range(2):
                k = 8 * n + 2 * j + half
                q = (qs[:, 32 * n + 16 * half + np.arange(16)] >> (2 * j)) & 3
                out[:, 128 * n + 32 * j + 16 * half + np.arange(16)] = \
                    (d * (s[:, k] & 0xF))[:, None] * q - (dmin * (s[:, k] >> 4))[:, None]
    return out


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float64)


def decode_iq4_nl(b):  # 18 bytes: f16 d, 16 bytes of nibbles (as Q4_0's) indexing a fixed table; x = d * table[q]
    return _f16(b[:, :2])[:, None] * IQ4_VALUES[_nibbles(b[:, 2:]).astype(np.int64)]


def decode_iq4_xs(b):  # 136 bytes: f16 d, u16 of 2-bit scale highs, 4 bytes of 4-bit scale lows, 8 x 16 bytes as IQ4_NL's
    d, hi, lo = _f16(b[:, :2]), b[:, 2:4].copy().view("<u2").astype(np.int64), b[:, 4:8].astype(np.int64)
    out = np.empty((len(b), 256))
    for j in range(8):         # sub-block j of 32: a 6-bit scale (minus 32)
        scale = ((lo[:, j // 2] >> (4 * (j % 2))) & 0xF) | (((hi[:, 0] >> (2 * j)) & 3) << 4)
        q = _nibbles(b[:, 8 + 16 * j:24 + 16 * j]).astype(np.int64)
        out[:, 32 * j:32 * j + 32] = (d * (scale - 32))[:, None] * IQ4_VALUES[q]
    return out


BLOCK = {"Q8_0": (32, 34, decode_q8_0), "Q4_0": (32, 18, decode_q4_0), "Q4_1": (32, 20, decode_q4_1),
         "Q4_K": (256, 144, decode_q4_k), "Q6_K": (256, 210, decode_q6_k), "Q5_0": (32, 22, decode_q5_0),
         "Q5_1": (32, 24, decode_q5_1), "Q5_K": (256, 176, decode_q5_k), "Q3_K": (256, 110, decode_q3_k),
         "Q2_K": (256, 84, decode_q2_k), "IQ4_NL": (32, 18, decode_iq4_nl), "IQ4_XS": (256, 136, decode_iq4_xs)}


def decode(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> np.ndarray:
    """Bytes (or floats) as written to the file -> float64 matrix."""
    if kind == "F32":
        return raw.astype(np.float64)
    if kind == "F16":
        return raw.astype(np.float64)
    if kind == "BF16":
        bits = np.ascontiguousarray(raw).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64).reshape(shape)
    n, size, fn = BLOCK[kind]
    return fn(np.ascontiguousarray(raw).reshape(-1, size)).reshape(shape)


# -- building the blocks ------------------------------------------------------------------------
def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def raw_q4_k(rng, rows, cols):
    n = rows * cols // 256
    d = rng.uniform(0.5, 1.5, n) * 2e-4
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(d * 7.5),        # dmin ~ 7.5 d keeps the mean near 0
                             rng.integers(0, 256, (n, 140), dtype=np.uint8)], axis=1)
    return blocks.reshape(rows, -1)


def raw_q6_k(rng, rows, cols):
    n = rows * cols // 256
    scales = (rng.integers(1, 17, (n, 16)) * rng.choice([-1, 1], (n, 16))).astype(np.int8).view(np.uint8)
    blocks = np.concatenate([rng.integers(0, 256, (n, 192), dtype=np.uint8), scales,
                             _f16_bytes(rng.uniform(0.5, 1.5, n) * 1e-3)], axis=1)
    return blocks.reshape(rows, -1)


# K-quants the gguf package cannot quantize: random bytes, float16 fields (byte offset -> multiple of a random d
# around the given size) chosen so the weights stay near zero (dmin offsets the mean of d * scale * code)
_RAW_K = {"Q5_K": (176, 1e-4, {0: 1.0, 2: 15.5}), "Q3_K": (110, 2e-3, {108: 1.0}),
          "Q2_K": (84, 5e-3, {80: 1.0, 82: 1.5}), "IQ4_XS": (136, 5e-5, {0: 1.0})}


def raw_k(rng, kind, rows, cols):
    size, scale, fields = _RAW_K[kind]
    n = rows * cols // 256
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, n) * scale
    for at, times in fields.items():
        blocks[:, at:at + 2] = _f16_bytes(d * times)
    return blocks.reshape(rows, -1)


def encode(rng, kind: str, rows: int, cols: int) -> np.ndarray:
    """Random data for one tensor, as the array add_tensor() writes."""
    if kind == "Q4_K":
        return raw_q4_k(rng, rows, cols)
    if kind == "Q6_K":
        return raw_q6_k(rng, rows, cols)
    if kind in _RAW_K:
        return raw_k(rng, kind, rows, cols)
    if kind in ("IQ4_NL", "TQ2_0"):            # random bytes, the float16 d first in each block
        per, size = gguf.GGML_QUANT_SIZES[Q[kind]]
        blocks = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
        blocks[:, -2 if kind == "TQ2_0" else 0:][:, :2] = _f16_bytes(rng.uniform(0.5, 1.5, len(blocks)) * 1e-3)
        return blocks.reshape(rows, -1)
    x = (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)
    if kind == "F32":
        return x
    if kind == "F16":
        return x.astype(np.float16)
    return gguf.quants.quantize(x, Q[kind])


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's reordering of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    src = llama_cpp_permute(np.arange(w.shape[0]), n_head)   # stored row i is HF row src[i]
    out = np.empty_like(w)
    out[src] = w
    return out


def tensor_plan():
    """(gguf name, HF name, shape, heads to un-permute or None)."""
    plan = [("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN), None),
            ("output.weight", "lm_head.weight", (VOCAB, HIDDEN), None),
            ("output_norm.weight", "model.norm.weight", (HIDDEN,), None)]
    for i in range(LAYERS):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        plan += [(b + "attn_q.weight", h + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN), HEADS),
                 (b + "attn_k.weight", h + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), KV_HEADS),
                 (b + "attn_v.weight", h + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), None),
                 (b + "attn_output.weight", h + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM), None),
                 (b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (INTER, HIDDEN), None),
                 (b + "ffn_up.weight", h + "mlp.up_proj.weight", (INTER, HIDDEN), None),
                 (b + "ffn_down.weight", h + "mlp.down_proj.weight", (HIDDEN, INTER), None),
                 (b + "attn_norm.weight", h + "input_layernorm.weight", (HIDDEN,), None),
                 (b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (HIDDEN,), None)]
    return plan


def write_tiny_gguf(path: str, kind: str, arch: str = "llama", skip: tuple[str, ...] = (),
                    override: dict | None = None) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF with every matrix of type `kind` (norms F32); return the float64
    weights HF should see, by HF name. `override` maps a GGUF name to a type for that tensor."""
    rng = np.random.default_rng((TYPES + REQUANTIZED).index(kind) if kind in TYPES + REQUANTIZED else 0)
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    ref = {}
    for gname, hname, shape, heads in tensor_plan():
        if gname in skip:
            continue
        if len(shape) == 1:
            data = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            w.add_tensor(gname, data)
            ref[hname] = data.astype(np.float64)
            continue
        t = (override or {}).get(gname, kind)
        data = encode(rng, t, *shape)
        if t in ("F32", "F16"):
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=Q[t])
        if t in TYPES + REQUANTIZED:
            full = decode(data, t, shape)
            ref[hname] = unpermute(full, heads) if heads else full
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {k: (str(root / f"tiny-{k}.gguf"), write_tiny_gguf(str(root / f"tiny-{k}.gguf"), k))
            for k in TYPES + REQUANTIZED}


def hf_llama(ref: dict[str, np.ndarray], **config):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, **config)
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict({k: torch.tensor(v, dtype=torch.float32) for k, v in ref.items()}, strict=True)
    return model


# -- tests ---------------------------------------------------------------------------------------
def test_reference_decoders_round_trip():
    """The float64 decoders above invert the gguf package's quantizers within each format's step size."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 256)) * 0.1).astype(np.float32)
    blocks = x.reshape(-1, 32).astype(np.float64)
    amax = np.abs(blocks).max(1, keepdims=True)
    span = blocks.max(1, keepdims=True) - blocks.min(1, keepdims=True)
    bounds = {"Q8_0": amax / 127, "Q4_0": amax / 8, "Q4_1": span / 15}    # one quantization step per block
    for kind, bound in bounds.items():
        got = decode(gguf.quants.quantize(x, Q[kind]), kind, x.shape).reshape(-1, 32)
        assert (np.abs(got - blocks) <= bound * 1.01).all(), kind
    got = decode(gguf.quants.quantize(x, Q.BF16), "BF16", x.shape)
    assert np.abs(got - x).max() <= np.abs(x).max() * 2 ** -8


@pytest.mark.parametrize("kind", REQUANTIZED)
def test_reference_decoders_equal_the_gguf_package(kind):
    """The float64 decoders of the requantized types (written here from ggml's block layouts) against the gguf
    package's own, on random blocks: two readings of the format that must agree."""
    rng = np.random.default_rng(5)
    raw = encode(rng, kind, 6, 512)
    want = gguf.quants.dequantize(raw, Q[kind]).astype(np.float64)
    got = decode(raw, kind, (6, 512))
    assert np.abs(want).max() > 0 and np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


@pytest.mark.parametrize("kind", TYPES + REQUANTIZED)
def test_loaded_weights_match_reference_decode(gguf_files, kind):
    path, ref = gguf_files[kind]
    src = open_gguf(path)
    cfg = src.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (VOCAB, HIDDEN, INTER, LAYERS)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert not cfg.tie_word_embeddings and src.load_tokenizer is None
    got = dict(src.weights())
    assert set(got) == set(ref)
    for name, want in ref.items():
        w = got[name].double().numpy()
        assert w.shape == want.shape, name
        err = np.abs(w - want).max()
        assert err <= 1e-6 * np.abs(want).max() + 1e-9, f"{name}: max error {err}"


@pytest.mark.parametrize("kind", TYPES + REQUANTIZED)
def test_tiny_gguf_greedy_matches_hf(gguf_files, kind):
    path, ref = gguf_files[kind]
    hf = hf_llama(ref)
    want = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                            do_sample=False, pad_token_id=0, eos_token_id=None)
        want.append(g[0, len(p):].tolist())
    llm = LLM(path, num_kv_blocks=32, quantization="none")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def _fused_reference(ref: dict, model) -> dict[str, np.ndarray]:
    """Our module name -> the float64 weight it stands for (q/k/v and gate/up stacked)."""
    out = {"embed_tokens": ref["model.embed_tokens.weight"], "lm_head": ref["lm_head.weight"]}
    for i in range(LAYERS):
        h = f"model.layers.{i}."
        out[f"layers.{i}.self_attn.qkv_proj"] = np.concatenate([ref[h + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        out[f"layers.{i}.self_attn.o_proj"] = ref[h + "self_attn.o_proj.weight"]
        out[f"layers.{i}.mlp.gate_up_proj"] = np.concatenate([ref[h + "mlp.gate_proj.weight"],
                                                              ref[h + "mlp.up_proj.weight"]])
        out[f"layers.{i}.mlp.down_proj"] = ref[h + "mlp.down_proj.weight"]
    return out


@pytest.mark.parametrize("kind", QUANTIZED + ["mixed"])
def test_quantized_layers_hold_the_files_weights(tmp_path, gguf_files, kind):
    """quantization="auto" (the default): every matrix stored quantized runs quantized, holding exactly the
    file's weight (float64 reference decode), its float32 parameter on the meta device; "mixed": q/k Q4_K, v Q6_K
    (two segments of one layer), gate F16 (its layer runs float32), down Q8_0."""
    from picovllm.kernels.cpu.quant_gemm import QuantizedWeight
    if kind == "mixed":
        path = str(tmp_path / "mixed.gguf")
        override = {f"blk.{i}.{t}.weight": q for i in range(LAYERS)
                    for t, q in [("attn_v", "Q6_K"), ("ffn_gate", "F16"), ("ffn_down", "Q8_0")]}
        ref = write_tiny_gguf(path, "Q4_K", override=override)
    else:
        path, ref = gguf_files[kind]
    model = LLM(path, num_kv_blocks=32).engine.runner.model
    for name, want in _fused_reference(ref, model).items():
        module = model.get_submodule(name)
        qw = module.quantized if name == "embed_tokens" else module.packed
        if kind == "mixed" and "gate_up" in name:
            assert not isinstance(qw, QuantizedWeight) and module.weight.device.type == "cpu"
            assert np.abs(module.weight.double().numpy() - want).max() <= 1e-6 * np.abs(want).max()
            continue
        assert isinstance(qw, QuantizedWeight), name
        assert module.weight.device.type == "meta" and tuple(module.weight.shape) == want.shape
        err = np.abs(qw.dequantize().double().numpy() - want).max()
        assert err <= 1e-6 * np.abs(want).max(), (name, err)
    qkv = model.get_submodule("layers.0.self_attn.qkv_proj").packed
    assert [s.kind for s in qkv.segments] == (["q4", "q8"] if kind == "mixed" else [qkv.segments[0].kind])


@pytest.mark.parametrize("kind", REQUANTIZED)
def test_requantized_layers_within_half_a_step(gguf_files, kind):
    """A type the CPU kernels do not run (quantization="auto"): every matrix runs in the kernels' 8-bit form, each
    weight within half a step (its 16 weights' largest magnitude / 254) of the file's (float64 reference decode)."""
    from picovllm.kernels.cpu.quant_gemm import QuantizedWeight
    path, ref = gguf_files[kind]
    model = LLM(path, num_kv_blocks=32).engine.runner.model
    for name, want in _fused_reference(ref, model).items():
        module = model.get_submodule(name)
        qw = module.quantized if name == "embed_tokens" else module.packed
        assert isinstance(qw, QuantizedWeight) and [s.kind for s in qw.segments] == ["q8"], name
        got = qw.dequantize().double().numpy()
        half_step = np.abs(want).reshape(want.shape[0], -1, 16).max(-1, keepdims=True) / 254
        assert (np.abs(got - want).reshape(half_step.shape[0], -1, 16) <= half_step * 1.001 + 1e-12).all(), name


def test_default_model_greedy_matches_hf_on_the_same_gguf(default_model_path):
    """HF transformers dequantizes the same Q4_1/Q8_0 file with its own GGUF loader (our float32 path)."""
    from transformers import AutoModelForCausalLM
    hf = hf_from_gguf(AutoModelForCausalLM, default_model_path, dtype=torch.float32).eval()
    llm = LLM(quantization="none", num_kv_blocks=64)
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = tok(p).input_ids
        assert o.prompt_token_ids == ids
        t = torch.tensor([ids])
        with torch.no_grad():
            g = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                            pad_token_id=0, eos_token_id=None)
        assert o.outputs[0].token_ids == g[0, len(ids):].tolist(), p


# -- errors --------------------------------------------------------------------------------------
def test_unknown_architecture_is_named(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    write_tiny_gguf(path, "F32", arch="gpt2")
    with pytest.raises(ValueError, match="general.architecture='gpt2'"):
        LLM(path)


def test_unsupported_quant_type_is_named(tmp_path):
    path = str(tmp_path / "tq2.gguf")
    write_tiny_gguf(path, "F32", override={"blk.1.ffn_up.weight": "TQ2_0"})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*TQ2_0"):
        LLM(path)


def test_rows_not_whole_blocks_are_named(tmp_path):
    """A Q4_K tensor whose rows (384 values) are not whole 256-value blocks is refused when the file is opened,
    naming the tensor and its type (the gguf package's error named neither, at weight load)."""
    from gguf.constants import GGML_QUANT_SIZES

    from picovllm.loader.gguf_format import GGUFFile
    path = str(tmp_path / "rows.gguf")
    per, size = GGML_QUANT_SIZES[Q.Q4_K]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros(2 * 384 * size // per, np.uint8), raw_dtype=Q.Q4_K)
    w.tensors[-1]["blk.0.attn_q.weight"].shape = [2, 384]      # the element shape, whatever the bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_q\.weight' of type Q4_K has rows of 384 values"):
        GGUFFile(path)


@pytest.mark.parametrize("missing,named", [("blk.1.ffn_down.weight", "layers.1.mlp.down_proj.weight"),
                                           ("token_embd.weight", "token_embd.weight")])
def test_missing_tensor_is_named(tmp_path, missing, named):
    path = str(tmp_path / "missing.gguf")
    write_tiny_gguf(path, "F32", skip=(missing,))
    with pytest.raises(ValueError, match=named):
        LLM(path)


def test_missing_metadata_key_is_named(tmp_path):
    path = str(tmp_path / "bare.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="llama.attention.head_count"):
        LLM(path)



def _write_with_keys(path: str, monkeypatch, keys: dict, **kwargs) -> dict[str, np.ndarray]:
    """write_tiny_gguf(path, "F32", **kwargs) with the metadata `keys` added, or put in place of the writer's: a list
    as an array, a float as float32, an int as uint32."""
    write_header = gguf.GGUFWriter.write_header_to_file

    def with_keys(w, *args, **kw):
        for key, value in keys.items():
            for kv in w.kv_data:
                kv.pop(key, None)
            if isinstance(value, list):
                w.add_array(key, value)
            else:
                w.add_float32(key, value) if isinstance(value, float) else w.add_uint32(key, value)
        return write_header(w, *args, **kw)
    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "write_header_to_file", with_keys)
        return write_tiny_gguf(path, "F32", **kwargs)


def _hf_greedy(hf, prompts: list[list[int]], new: int = 8) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=0, eos_token_id=None)
        out.append(g[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("key", ["llama.rope.scaling.factor", "llama.rope.scale_linear"])
def test_rope_factor_without_a_type_is_linear(tmp_path, monkeypatch, key):
    """A factor without rope.scaling.type (older converters' files; rope.scale_linear the oldest key): llama.cpp
    scales the positions linearly by it (its default type is linear). It was ignored: the unscaled rotation.
    Oracle: HF's Llama with linear rope scaling on the same weights (which the unscaled one does not match)."""
    path = str(tmp_path / "linear.gguf")
    ref = _write_with_keys(path, monkeypatch, {key: 4.0})
    scaled = _hf_greedy(hf_llama(ref, rope_scaling={"rope_type": "linear", "factor": 4.0}), PROMPTS)
    assert scaled != _hf_greedy(hf_llama(ref), PROMPTS)
    llm = LLM(path, num_kv_blocks=32, quantization="none")
    assert llm.engine.model_config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == scaled


def test_split_file_is_refused_naming_the_key(tmp_path, monkeypatch):
    """The first part of a gguf-split model (split.count 2) holds only some of its tensors: here all but
    output.weight, which read alone made a model with a tied LM head, silently. It is refused, naming the key."""
    path = str(tmp_path / "tiny-00001-of-00002.gguf")
    _write_with_keys(path, monkeypatch, {"split.no": 0, "split.count": 2, "split.tensors.count": len(tensor_plan())},
                     skip=("output.weight",))
    with pytest.raises(ValueError, match=r"split\.count=2"):
        LLM(path, num_kv_blocks=32)


def test_per_layer_arrays_of_one_value_read_as_that_value(tmp_path, monkeypatch):
    """llama.cpp reads the head counts and the FFN width as one value or an array of one per layer. Arrays whose
    layers agree describe the model the scalars do (HF on the same weights); arrays whose layers differ, or a
    sliding-window pattern without a value per layer, are refused naming the key (they raised TypeError and
    IndexError)."""
    per_layer = {"llama.attention.head_count": [HEADS] * LAYERS, "llama.attention.head_count_kv": [KV_HEADS] * LAYERS,
                 "llama.feed_forward_length": [INTER] * LAYERS}
    path = str(tmp_path / "arrays.gguf")
    want = _hf_greedy(hf_llama(_write_with_keys(path, monkeypatch, per_layer)), PROMPTS)
    outs = LLM(path, num_kv_blocks=32, quantization="none").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    refused = [("llama.attention.head_count_kv", [KV_HEADS, HEADS]), ("llama.feed_forward_length", [INTER]),
               ("llama.attention.sliding_window_pattern", [True])]
    for key, value in refused:
        extra = {"llama.attention.sliding_window": 8} if "sliding" in key else {}
        _write_with_keys(path, monkeypatch, {key: value, **extra})
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            LLM(path, num_kv_blocks=32)


def test_a_sliding_pattern_period_of_one_is_every_layer_dense(tmp_path, monkeypatch):
    """attention.sliding_window_pattern as a period n (every n-th layer global), read as llama.cpp's set_swa_pattern:
    1 makes every layer global (the model HF's Llama is on the same weights; it had made every layer slide), 0 every
    layer sliding."""
    path = str(tmp_path / "period.gguf")
    ref = _write_with_keys(path, monkeypatch, {"llama.attention.sliding_window": 4,
                                               "llama.attention.sliding_window_pattern": 1})
    llm = LLM(path, num_kv_blocks=32, quantization="none")
    assert llm.engine.model_config.sliding_window is None
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(hf_llama(ref), PROMPTS)
    _write_with_keys(path, monkeypatch, {"llama.attention.sliding_window": 4,
                                         "llama.attention.sliding_window_pattern": 0})
    cfg = LLM(path, num_kv_blocks=32, quantization="none").engine.model_config
    assert cfg.sliding_window == 4 and cfg.sliding_layers in (None, [True] * LAYERS)
