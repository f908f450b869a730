"""FP8 HF checkpoints dequantized at load (loader/fp8.py): quant_method "fp8" (transformers' FineGrainedFP8, as
Qwen3-*-FP8 and DeepSeek's write it; AutoFP8's per-tensor form) and "compressed-tensors" float-quantized (RedHatAI's
FP8-dynamic and static ones). A tiny random model's linear weights are quantized here by hand, in blocks that do not
divide the matrices too; the loaded weights equal a float64 dequantization of the same tensors (and transformers' own
dequantizing loader where its reading is right: blocks that divide the weights), and the engine's greedy tokens and
logprobs on the FP8 folder are HF's on the dense weights. Other quantizations and fields are refused by name."""
import json
import os
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import build_tiny_checkpoint
from picovllm import LLM, SamplingParams
from picovllm.config import ModelConfig
from picovllm.loader.hf_folder import open_folder
from test_parity_hf import LOGPROB_ATOL, hf_greedy

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
LEFT_DENSE = "model.layers.1.mlp.down_proj"      # listed in modules_to_not_convert / ignore, stored unquantized
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max

# Qwen3-*-FP8's config, and the blocks' shape here: 48 x 40 divides none of the tiny model's 64 / 128
QWEN3_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [48, 40],
             "modules_to_not_convert": [LEFT_DENSE]}


def ct_config(weights: dict, fmt: str = "float-quantized", activations: dict | None = None) -> dict:
    """A compressed-tensors quantization_config as llm-compressor writes it, one group over every Linear."""
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                                "group_size": None, "block_structure": None, **weights},
             "input_activations": activations, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head", LEFT_DENSE], "kv_cache_scheme": None, "quantization_status": "compressed",
            "sparsity_config": {}}


DYNAMIC_TOKENS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
STATIC_TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}

# name -> (quantization_config, (rows, cols) a scale covers (None: the whole dim), scale name, scale storage,
# the static activation scale's name (a tensor dropped at load) or None)
FORMATS = {
    "fp8_blocks": (QWEN3_FP8, (48, 40), "weight_scale_inv", "float32", None),
    "fp8_ue8m0": ({**QWEN3_FP8, "weight_block_size": [32, 48], "scale_fmt": "ue8m0"}, (32, 48), "weight_scale_inv",
                  "e8m0", None),
    "fp8_ue8m0_bytes": ({**QWEN3_FP8, "scale_fmt": "ue8m0"}, (48, 40), "weight_scale_inv", "e8m0_bytes", None),
    "fp8_per_tensor_static": ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None},
                              (None, None), "weight_scale_inv", "float32", "activation_scale"),
    "autofp8_static": ({"quant_method": "fp8", "activation_scheme": "static"}, (None, None), "weight_scale",
                       "float32", "input_scale"),
    "ct_channel_dynamic": (ct_config({"strategy": "channel"}, activations=DYNAMIC_TOKENS), (1, None), "weight_scale",
                           "bfloat16", None),
    "ct_tensor_static": (ct_config({"strategy": "tensor"}, "naive-quantized", STATIC_TENSOR), (None, None),
                         "weight_scale", "float32", "input_scale"),
    "ct_block": (ct_config({"strategy": "block", "block_structure": [48, 40]}), (48, 40), "weight_scale", "float32",
                 None),
}


def quantize(w: torch.Tensor, rows: int | None, cols: int | None, storage: str):
    """w [N, K] -> (float8_e4m3fn [N, K], the scales [ceil(N / rows), ceil(K / cols)] as stored, their values in
    float64): each block's largest magnitude at FP8's largest value (e8m0: the next power of two up)."""
    n, k = w.shape
    rows, cols = rows or n, cols or k
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-n // rows), -(-k // cols), dtype=torch.float64)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].double()
            s = block.abs().max() / FP8_MAX
            if storage.startswith("e8m0"):
                s = torch.exp2(torch.ceil(torch.log2(s)))
            else:                               # as stored
                s = s.to(getattr(torch, storage)).double()
            scales[i, j] = s
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (block / s).clamp(-FP8_MAX, FP8_MAX).to(q.dtype)
    stored = {"float32": scales.float(), "bfloat16": scales.to(torch.bfloat16),
              "e8m0": scales.float().to(torch.float8_e8m0fnu),
              "e8m0_bytes": (torch.log2(scales) + 127).round().to(torch.uint8)}[storage]
    return q, stored, scales


def reference(q: torch.Tensor, scales: torch.Tensor, rows: int | None, cols: int | None) -> torch.Tensor:
    """The oracle: each weight times its block's scale in float64 (exact), as float32."""
    n, k = q.shape
    r, c = torch.arange(n) // (rows or n), torch.arange(k) // (cols or k)
    return (q.double() * scales[r][:, c]).float()


def fp8_folders(src: str, root: str, fmt: str, spec: tuple | None = None) -> tuple[str, str, dict]:
    """(the FP8 folder, the dense folder of its reference dequantization, that folder's tensors) from the model
    folder src, its linear weights quantized as spec (FORMATS[fmt] by default) says, all but LEFT_DENSE."""
    qc, (rows, cols), scale_name, storage, act_scale = spec or FORMATS[fmt]
    sd = load_file(os.path.join(src, "model.safetensors"))
    fp8_sd, dense_sd = {}, {}
    for name, t in sd.items():
        module = name[:-len(".weight")]
        if not (name.endswith(".weight") and module.endswith(LINEARS)) or module == LEFT_DENSE:
            fp8_sd[name] = dense_sd[name] = t
            continue
        q, stored, scales = quantize(t, rows, cols, storage)
        if (rows, cols) == (None, None):     # transformers' and AutoFP8's a scalar, compressed-tensors' [1]
            stored = stored.reshape(() if qc["quant_method"] == "fp8" else 1)
        fp8_sd[name], fp8_sd[f"{module}.{scale_name}"] = q, stored
        if act_scale is not None:
            fp8_sd[f"{module}.{act_scale}"] = torch.tensor([0.05])
        dense_sd[name] = reference(q, scales, rows, cols)
    fp8_path, dense_path = os.path.join(root, fmt), os.path.join(root, fmt + "_dense")
    for path, tensors in ((fp8_path, fp8_sd), (dense_path, dense_sd)):
        shutil.copytree(src, path)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8_path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(fp8_path, "config.json"), "w") as f:
        json.dump(dict(cfg, quantization_config=qc), f)
    return fp8_path, dense_path, dense_sd


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 9, 33)]


def assert_matches_hf(dense_path: str, fp8_path: str, new: int = 8, **engine) -> LLM:
    """Ours on the FP8 folder gives HF's greedy tokens and logprobs on the dense one (engine: more LLM arguments);
    returns the engine, shut down."""
    ps = prompts()
    ref, ref_lp = hf_greedy(dense_path, ps, new)
    llm = LLM(fp8_path, block_size=4, num_kv_blocks=64, device="cpu", max_num_batched_tokens=16, **engine)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, want in zip(outs, ref_lp):
        got = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert got == pytest.approx(want, abs=LOGPROB_ATOL)
    return llm


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("fp8") / "qwen3"), "qwen3")


def loaded(path: str) -> dict[str, torch.Tensor]:
    return dict(open_folder(path).weights())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_loads_as_its_dequantization(qwen3, tmp_path, fmt):
    """Every tensor the loader yields equals the float64 dequantization (scales and activation scales gone, the
    unquantized ones as stored); the engine on the FP8 folder gives HF's tokens and logprobs on the dense one."""
    fp8_path, dense_path, dense_sd = fp8_folders(qwen3, str(tmp_path), fmt)
    got = loaded(fp8_path)
    assert sorted(got) == sorted(dense_sd)
    for name, want in dense_sd.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name
    assert_matches_hf(dense_path, fp8_path)


def test_attention_and_kv_cache_scales_are_dropped(qwen3, tmp_path):
    """An FP8 checkpoint's KV cache and attention scales (k_scale / v_scale, older files' kv_scale, FP8 attention's
    q_scale and prob_scale) are dropped as activation scales are: the same tensors as without them (the older names
    had failed the load as "matches no parameter")."""
    fp8_path, _, dense_sd = fp8_folders(qwen3, str(tmp_path), "fp8_blocks")
    sd = load_file(os.path.join(fp8_path, "model.safetensors"))
    for i in range(2):
        for name in ("k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale"):
            sd[f"model.layers.{i}.self_attn.{name}"] = torch.tensor(0.02)
    save_file(sd, os.path.join(fp8_path, "model.safetensors"), metadata={"format": "pt"})
    got = loaded(fp8_path)
    assert sorted(got) == sorted(dense_sd)
    assert all(torch.equal(got[name], want) for name, want in dense_sd.items())


# blocks that divide the tiny model's weights (transformers' reading of a scale grid needs them)
EVEN = {"fp8_even_blocks": ({**QWEN3_FP8, "weight_block_size": [32, 64]}, (32, 64), "weight_scale_inv", "float32",
                            None),
        "fp8_even_ue8m0": ({**QWEN3_FP8, "weight_block_size": [64, 32], "scale_fmt": "ue8m0"}, (64, 32),
                           "weight_scale_inv", "e8m0", None),
        "fp8_per_tensor_static": FORMATS["fp8_per_tensor_static"]}


@pytest.mark.parametrize("fmt", list(EVEN))
def test_fine_grained_fp8_as_transformers_dequantizes(qwen3, tmp_path, fmt):
    """transformers' own loader (FineGrainedFP8Config(dequantize=True), on the CPU) gives the same float32 weights.
    Only on blocks that divide the weights: it takes a block to be the weight's size over the scale grid's (64 // 2
    = 32 columns for blocks of 40; 128 rows in 3 blocks of 48 it refuses), so the float64 oracle is the reference
    for the others."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    fp8_path, _, dense_sd = fp8_folders(qwen3, str(tmp_path), fmt, EVEN[fmt])
    qc = {k: v for k, v in EVEN[fmt][0].items() if k != "quant_method"}
    hf = AutoModelForCausalLM.from_pretrained(fp8_path, dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True, **qc))
    want = hf.state_dict()
    for name, t in loaded(fp8_path).items():
        assert torch.equal(t, want[name]) and torch.equal(t, dense_sd[name]), name


def test_fused_and_reordered_rows_are_dequantized_first(tmp_path):
    """Phi-3 with partial rotary (Phi-4-mini's form): q/k/v and gate/up fused in the checkpoint, q's and k's rows
    reordered at load for the rotary kernels. Blocks of 48 rows straddle q, k and v, so the scales must be applied
    to the rows as stored, before the split and the reorder."""
    from test_more_families import build
    phi3 = build(str(tmp_path / "phi3"), "phi3_partial")
    fp8_path, dense_path, _ = fp8_folders(phi3, str(tmp_path), "fp8_blocks")
    assert "model.layers.0.self_attn.qkv_proj.weight_scale_inv" in load_file(f"{fp8_path}/model.safetensors")
    assert_matches_hf(dense_path, fp8_path)


def llama_config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("qc, field", [
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ({**QWEN3_FP8, "scale_fmt": "e4m3"}, "scale_fmt='e4m3'"),
    ({**QWEN3_FP8, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({**QWEN3_FP8, "expert_dtype": "fp4"}, "expert_dtype='fp4'"),
    ({**QWEN3_FP8, "modules_to_convert": ["model.embed_tokens"]}, "modules_to_convert"),
    ({**QWEN3_FP8, "weight_block_size": [128]}, "weight_block_size=[128]"),
    ({**QWEN3_FP8, "activation_scheme": "per_token"}, "activation_scheme='per_token'"),
    # compressed-tensors' W8A8 int8 and W4A16 (int4 packed): not FP8
    (ct_config({"type": "int", "strategy": "channel"}, "int-quantized"), "config_groups.group_0.weights"),
    (ct_config({"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}, "pack-quantized"),
     "config_groups.group_0.weights"),
    (ct_config({"strategy": "channel"}, "pack-quantized"), "format='pack-quantized'"),
    (ct_config({"strategy": "group", "group_size": 32}), "config_groups.group_0.weights.strategy='group'"),
    (ct_config({"strategy": "block"}), "config_groups.group_0.weights.block_structure=None"),
    (ct_config({"strategy": "channel", "symmetric": False}), "config_groups.group_0.weights.symmetric=False"),
    ({**ct_config({"strategy": "channel"}), "sparsity_config": {"format": "sparse-24-bitmask"}},
     "sparsity_config"),
    ({**ct_config({"strategy": "channel"}), "config_groups": {}}, "config_groups={}"),
])
def test_other_quantizations_are_refused_by_name(qc, field):
    """Methods other than FP8's, and FP8 fields or values not read: the error names the field (and its value)."""
    with pytest.raises(ValueError, match=re.escape(f"config.json quantization_config.{field}")):
        ModelConfig.from_hf_dict(dict(llama_config(), quantization_config=qc))


def test_fp8_gpt_oss_is_refused():
    """GPT-OSS's experts are stacked tensors: read as MXFP4 or dense, not FP8."""
    cfg = dict(llama_config(), architectures=["GptOssForCausalLM"], quantization_config=QWEN3_FP8)
    with pytest.raises(ValueError, match="quant_method='fp8'"):
        ModelConfig.from_hf_dict(cfg)


def test_a_refused_folder_names_the_field(qwen3, tmp_path):
    """Through the engine: the folder's config is refused before any weight is read."""
    from test_more_families import edited
    bad = edited(qwen3, str(tmp_path / "bad"), quantization_config={**QWEN3_FP8, "scale_fmt": "e8m0"})
    with pytest.raises(ValueError, match="quantization_config.scale_fmt='e8m0'"):
        LLM(bad, device="cpu")


def test_tensors_that_do_not_pair_are_named():
    """A float8 weight without its scale, a scale without its weight, scales of the wrong grid or dtype, a float8
    tensor other than a weight: each a ValueError naming the tensor. A pair is taken in either order (a scale may
    come first, from another file)."""
    from picovllm.loader.fp8 import Fp8Scheme, dequantized
    blocks = Fp8Scheme.from_quantization_config(QWEN3_FP8)
    w = torch.randn(100, 70)
    q, s, scales = quantize(w, 48, 40, "float32")
    x = "model.layers.0.mlp.up_proj"
    (name, got), = list(dequantized(iter([(x + ".weight_scale_inv", s), (x + ".weight", q)]), blocks))
    assert name == x + ".weight" and torch.equal(got, reference(q, scales, 48, 40))
    cases = [
        ([(x + ".weight", q)], f"'{x}.weight' is torch.float8_e4m3fn but has no scale \\({x}.weight_scale_inv\\)"),
        ([(x + ".weight_scale_inv", s)], f"'{x}.weight_scale_inv' has no float8 weight"),
        ([(x + ".weight", q), (x + ".weight_scale_inv", s[:, :1])], r"scales \(3, 1\) for a weight of \(100, 70\), "
                                                                   r"expected \(3, 2\)"),
        ([(x + ".weight", q), (x + ".weight_scale_inv", s.to(torch.uint8))], "scale_fmt 'ue8m0'"),
        ([(x + ".weight", q.to(torch.float8_e5m2)), (x + ".weight_scale_inv", s)], "float8_e4m3fn matrices"),
        ([(x + ".bias", q[0])], f"'{x}.bias' is torch.float8_e4m3fn: only weights"),
    ]
    for tensors, match in cases:
        with pytest.raises(ValueError, match=match):
            list(dequantized(iter(tensors), blocks))
    channel = Fp8Scheme.from_quantization_config(ct_config({"strategy": "channel"}))
    with pytest.raises(ValueError, match=r"scales \(1,\) for a weight of \(100, 70\), expected \(100, 1\)"):
        list(dequantized(iter([(x + ".weight", q), (x + ".weight_scale", s[0, :1])]), channel))
