"""GPT-OSS from an HF folder: greedy tokens and logprobs against HF transformers on the same tiny random weights
(fp32, CPU; HF's eager attention, which spells the sinks out), with its parts made to matter: attention sinks
large enough to take much of each head's weight, biases everywhere, a sliding window (6) under the longer prompts
on alternating layers, YaRN rope without truncation, 8 experts top-2 whose clamped SwiGLU clamps; TP=2 against TP=1;
and the sinks taken away (zeroed in the checkpoint: then they still add exp(0) to every softmax; removed from the
math: another answer) to show the parity rests on them."""
import json
import os
import random

import pytest
import torch

from picovllm import LLM, SamplingParams
from test_more_families import edited
from test_parity_hf import LOGPROB_ATOL, hf_greedy

def hf_swiglu_limit() -> float:
    """1.5 (the clamp bites in a tiny model) where HF's experts read config.swiglu_limit; 7.0 (every released
    model's) where they hard-code it (transformers 5.17, the GPU machine's), so HF stays an oracle in both."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    cfg = transformers.GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=2, swiglu_limit=1.5)
    return 1.5 if GptOssExperts(cfg).limit == 1.5 else 7.0


CONFIG = dict(vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
              layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0},
              bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)


def build(path: str, sinks_scale: float = 2.0, init: float = 0.2) -> str:
    """init: the weights' scale (0.2: activations of a few units, where every part shows in the logits)."""
    import transformers
    cfg = transformers.GptOssConfig(**{**CONFIG, "initializer_range": init}, swiglu_limit=hf_swiglu_limit())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(sinks_scale * torch.randn_like(p))
            elif "bias" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif "router.weight" in name:
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build(str(tmp_path_factory.mktemp("gpt_oss") / "m"))


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 7, 16, 33)]


def run(path: str, ps, new: int = 10, **kw):
    llm = LLM(path, block_size=4, num_kv_blocks=128, device="cpu", max_num_batched_tokens=16, **kw)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], \
        [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]


def assert_matches_hf(hf_path: str, path: str, ps, new: int = 10, **kw) -> None:
    """Ours on `path` gives HF's greedy tokens and logprobs on `hf_path` (the same folder, or its dense form)."""
    ref, ref_lp = hf_greedy(hf_path, ps, new)
    toks, lps = run(path, ps, new, **kw)
    assert toks == ref
    for lp, want in zip(lps, ref_lp):
        assert lp == pytest.approx(want, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_and_logprobs_match_hf(model_path, backend):
    """The C kernel's sinks (auto on the CPU: CpuAttentionBackend) and the torch reference's."""
    assert_matches_hf(model_path, model_path, prompts(), attention_backend=backend)


def test_tensor_parallel_matches_one_rank(model_path):
    """Heads, sinks, experts and their biases sharded over two ranks (the down bias added once)."""
    ps = prompts(1)
    one = run(model_path, ps)
    two = run(model_path, ps, tensor_parallel_size=2)
    assert one[0] == two[0]
    for a, b in zip(one[1], two[1]):
        assert a == pytest.approx(b, abs=LOGPROB_ATOL)


def test_the_sinks_matter(model_path, tmp_path):
    """The same weights with the sinks' logits moved (all -30: almost no weight) answer otherwise."""
    import shutil

    from safetensors.torch import load_file, save_file
    other = str(tmp_path / "no_sinks")
    shutil.copytree(model_path, other)
    sd = load_file(os.path.join(other, "model.safetensors"))
    for name in sd:
        if name.endswith("sinks"):
            sd[name] = torch.full_like(sd[name], -30.0)
    save_file(sd, os.path.join(other, "model.safetensors"), metadata={"format": "pt"})
    ps = prompts()
    assert run(model_path, ps)[1] != run(other, ps)[1]


def test_the_checkpoint_layout_is_read(model_path):
    """What the parity rests on, where a wrong reading could pass by chance: the experts' interleaved gate/up
    columns are de-interleaved into [gate rows; up rows], down transposed, the router's bias kept."""
    from safetensors.torch import load_file
    sd = load_file(os.path.join(model_path, "model.safetensors"))
    llm = LLM(model_path, num_kv_blocks=32, device="cpu", quantization="none")
    moe = llm.engine.runner.model.layers[1].mlp
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]          # [E, H, 2I], gate at even columns
    assert torch.equal(moe.experts.gate_up_proj[3, :32], gate_up[3, :, 0::2].T)
    assert torch.equal(moe.experts.gate_up_proj[3, 32:], gate_up[3, :, 1::2].T)
    assert torch.equal(moe.experts.down_proj[5], sd["model.layers.1.mlp.experts.down_proj"][5].T)
    assert torch.equal(moe.gate.bias, sd["model.layers.1.mlp.router.bias"])
    assert torch.equal(llm.engine.runner.model.layers[2].self_attn.attn.sinks,
                       sd["model.layers.2.self_attn.sinks"])
    cfg = llm.engine.model_config
    assert cfg.layer_window(0) == 6 and cfg.layer_window(1) is None and cfg.swiglu_limit == hf_swiglu_limit()


def test_fields_left_to_transformers_defaults(model_path, tmp_path):
    """A config.json without layer_types, the rope parameters, attention_bias or rms_norm_eps reads as HF's
    GptOssConfig fills them in (alternating windows, YaRN x32 over 4096 positions at base 150000, biases, 1e-5):
    HF's greedy tokens and logprobs on it."""
    bare = edited(model_path, str(tmp_path / "bare"),
                  drop=("layer_types", "rope_parameters", "rope_scaling", "attention_bias", "rms_norm_eps"))
    llm = LLM(bare, num_kv_blocks=32, device="cpu")
    mc = llm.engine.model_config
    assert (mc.layer_window(0), mc.layer_window(1), mc.rope_theta) == (6, None, 150000.0)
    assert mc.rope_scaling["factor"] == 32.0 and mc.rope_scaling["original_max_position_embeddings"] == 4096
    assert_matches_hf(bare, bare, prompts(6), 8)


def test_mxfp4_elsewhere_is_refused(model_path, tmp_path):
    """mxfp4 is read for GPT-OSS's experts only; another architecture's mxfp4 config is refused by name."""
    from picovllm.config import ModelConfig
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    llama = dict(cfg, architectures=["LlamaForCausalLM"], quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match="quant_method='mxfp4'"):
        ModelConfig.from_hf_dict(llama)


def test_attention_without_biases_is_refused(model_path, tmp_path):
    bad = edited(model_path, str(tmp_path / "bad"), attention_bias=False)
    with pytest.raises(ValueError, match="attention_bias"):
        LLM(bad, device="cpu")


def test_mxfp4_dequantized_as_hf_does():
    """The format's decoder against transformers' own (integrations.mxfp4.convert_moe_packed_tensors, which also
    swaps the last two dims as the checkpoint's dense layout has them) on random blocks and scales."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from picovllm.loader.mxfp4 import dequantize, dequantized
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (3, 10, 4), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)          # [3, 128, 10]
    assert torch.equal(dequantize(blocks, scales).transpose(1, 2), want)
    assert torch.equal(dequantize(blocks[1], scales[1]).T, want[1])                  # one expert's alone
    x = "model.layers.0.mlp.experts.x"
    (name, got), = list(dequantized(iter([(x + "_scales", scales), (x + "_blocks", blocks)]), torch.float32))
    assert name == x and torch.equal(got, want)
    with pytest.raises(ValueError, match=f"'{x}_blocks' has no '{x}_scales'"):
        list(dequantized(iter([(x + "_blocks", blocks)])))
    with pytest.raises(ValueError, match="MXFP4 weights are read for GPT-OSS's experts only"):
        list(dequantized(iter([("model.layers.0.self_attn.q_proj_blocks", blocks)])))


def test_an_mxfp4_checkpoint_runs_as_its_dense_form(model_path, tmp_path):
    """gpt-oss-20b's layout: the experts' projections as MXFP4 _blocks/_scales pairs (quantization_config mxfp4).
    The model's experts here are MXFP4 values to begin with, so the dense checkpoint of the same values is the
    oracle: the same greedy tokens and logprobs as HF on it."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    dense = str(tmp_path / "dense")
    shutil.copytree(model_path, dense)
    packed = edited(model_path, str(tmp_path / "mxfp4"), quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})
    sd = load_file(os.path.join(model_path, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    dense_sd, packed_sd = dict(sd), {k: v for k, v in sd.items() if not k.endswith(("gate_up_proj", "down_proj"))}
    for name, t in sd.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):     # [E, in, out]
            e, n_in, n_out = t.shape
            blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
            scales = torch.randint(122, 126, (e, n_out, n_in // 32), dtype=torch.uint8, generator=g)
            dense_sd[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            packed_sd[name + "_blocks"], packed_sd[name + "_scales"] = blocks, scales
    save_file(dense_sd, os.path.join(dense, "model.safetensors"), metadata={"format": "pt"})
    save_file(packed_sd, os.path.join(packed, "model.safetensors"), metadata={"format": "pt"})
    assert_matches_hf(dense, packed, prompts(2), 8)
    fp8 = edited(packed, str(tmp_path / "fp8"), quantization_config={"quant_method": "fp8"})   # another method
    with pytest.raises(ValueError, match="quant_method='fp8'"):
        LLM(fp8, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp32_matches_hf(model_path):
    """CUDA graphs for decode, the Triton attention kernels with sinks and windows, the grouped GEMMs with biases."""
    from test_parity_hf import assert_gpu_fp32_matches_hf
    assert_gpu_fp32_matches_hf(model_path, prompts(4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_near_hf(tmp_path):
    """On weights of HF's usual scale (0.02): the test model's 0.2 makes bf16 flip routing choices (on this CPU, torch
    in bf16: 0.14 nats on average against HF fp32 with HF 5.17's SwiGLU limit; 0.002 at 0.02)."""
    from test_parity_hf import assert_gpu_bf16_near_hf
    assert_gpu_bf16_near_hf(build(str(tmp_path / "soft"), sinks_scale=1.0, init=0.02), prompts(5))
