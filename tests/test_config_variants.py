"""HF config variants real checkpoints use, against HF transformers on the same tiny random weights (fp32, CPU):
attention_bias where HF's o_proj takes it too (Llama, Qwen3, Gemma 2, SmolLM3, Cohere's parallel block) and where
HF's attention ignores it (Mistral, Phi-3), Llama's and SmolLM3's mlp_bias, llama3, YaRN and LongRoPE rope scaling
without an original_max_position_embeddings (HF's fallback: max_position_embeddings), dynamic NTK rope (HF's: the
default rope below max_position_embeddings), Qwen's use_sliding_window and max_window_layers defaults, Qwen3-MoE's
window on every layer, bf16 and sharded checkpoints, and the refusals that name the field."""
import copy
import json
import random

import pytest
import torch

from picovllm import LLM, SamplingParams
from picovllm.config import ModelConfig
from test_parity_hf import LOGPROB_ATOL, assert_tp2_matches_tp1, hf_greedy

BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, initializer_range=0.2)


def build(path: str, cls: str, edit=None, dtype=torch.float32, max_shard_size=None, **fields) -> str:
    """A tiny random model of transformers' config class `cls` saved at path (norms and biases moved off HF's 1 and
    0 so that each one matters); edit(config_dict): a change to its config.json after saving."""
    import transformers
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**BASE, **fields}),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if edit is not None:
        with open(f"{path}/config.json") as f:
            cfg = json.load(f)
        edit(cfg)
        with open(f"{path}/config.json", "w") as f:
            json.dump(cfg, f)
    return path


def assert_matches_hf(path: str, lens=(5, 20, 45), max_tokens: int = 6) -> LLM:
    """Our greedy tokens are HF's, their logprobs within LOGPROB_ATOL; returns the engine."""
    rng = random.Random(4)
    ps = [[rng.randrange(384) for _ in range(n)] for n in lens]
    ref, ref_lp = hf_greedy(path, ps, max_tokens)
    llm = LLM(path, num_kv_blocks=64, device="cpu", dtype="float32")
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert ours == pytest.approx(lp, abs=LOGPROB_ATOL)
    return llm


# attention_bias: HF's o_proj takes it in these families (q/k/v/o biases), and mlp_bias gate/up/down biases in
# Llama's and SmolLM3's; Cohere's parallel block adds its o_proj output before the (TP) reduction
BIASED = {
    "llama_attention_bias": ("LlamaConfig", dict(attention_bias=True)),
    "llama_mlp_bias": ("LlamaConfig", dict(mlp_bias=True)),
    "qwen3_attention_bias": ("Qwen3Config", dict(attention_bias=True, head_dim=16)),
    "gemma2_attention_bias": ("Gemma2Config", dict(attention_bias=True, head_dim=16, query_pre_attn_scalar=24,
                                                   sliding_window=8)),
    "smollm3_both_biases": ("SmolLM3Config", dict(attention_bias=True, mlp_bias=True, no_rope_layer_interval=2)),
    "cohere_attention_bias": ("CohereConfig", dict(attention_bias=True, logit_scale=0.5)),
}


@pytest.mark.parametrize("case", list(BIASED))
def test_biases_match_hf(tmp_path, case):
    cls, fields = BIASED[case]
    assert_matches_hf(build(str(tmp_path / case), cls, **fields))


@pytest.mark.parametrize("cls", ["MistralConfig", "Phi3Config"])
def test_attention_bias_is_ignored_where_hf_ignores_it(tmp_path, cls):
    """Mistral's and Phi-3's HF attention has no biases whatever config.json says: such a config loads and runs as
    HF's (instead of asking the checkpoint for q/k/v biases it does not hold)."""
    path = build(str(tmp_path / "m"), cls, edit=lambda c: c.update(attention_bias=True), sliding_window=None)
    assert_matches_hf(path, lens=(5, 20))


def test_row_parallel_bias_enters_once_when_the_caller_reduces():
    """RowParallelLinear(reduce=False) with a bias (Cohere's o_proj with attention_bias): the ranks' partial sums add
    up to the full layer, the bias counted once."""
    from picovllm.distributed import TPGroup
    from picovllm.layers.linear import RowParallelLinear
    torch.manual_seed(0)
    w, b, x = torch.randn(6, 8), torch.randn(6), torch.randn(3, 8)
    total = 0
    for rank in range(2):
        lin = RowParallelLinear(8, 6, bias=True, tp=TPGroup(rank=rank, size=2), reduce=False)
        lin.load(lin.weight, w)
        lin.load(lin.bias, b)
        total = total + lin(x[:, rank * 4:(rank + 1) * 4])
    torch.testing.assert_close(total, x @ w.T + b)


def test_cohere_attention_bias_under_tp2_matches_tp1(tmp_path, monkeypatch):
    """Cohere's parallel block reduces attention and the MLP together: o_proj's bias still enters once under TP=2."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")     # two ranks on two shared cores
    cls, fields = BIASED["cohere_attention_bias"]
    assert_tp2_matches_tp1(build(str(tmp_path / "m"), cls, **fields), [[5, 7, 9, 11, 200], list(range(40))])


def test_llama3_rope_without_original_context_falls_back_as_hf(tmp_path):
    """llama3 scaling whose config.json names no original_max_position_embeddings: HF takes max_position_embeddings
    (64 here) as the original context, not Llama 3.1's 8192."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "rope_theta": 500000.0}
    path = build(str(tmp_path / "m"), "LlamaConfig", max_position_embeddings=64, rope_parameters=rope,
                 edit=lambda c: c["rope_parameters"].pop("original_max_position_embeddings", None))
    llm = assert_matches_hf(path, lens=(5, 20, 45))
    assert llm.engine.model_config.rope_scaling["original_max_position_embeddings"] == 64


def test_llama3_rope_original_context_at_the_top_level_wins(tmp_path):
    """HF reads a top-level original_max_position_embeddings over the rope parameters' one (Phi-3's place)."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "rope_theta": 500000.0, "original_max_position_embeddings": 8192}
    path = build(str(tmp_path / "m"), "LlamaConfig", max_position_embeddings=64, rope_parameters=rope,
                 edit=lambda c: c.update(original_max_position_embeddings=32))
    llm = assert_matches_hf(path, lens=(5, 45))
    assert llm.engine.model_config.rope_scaling["original_max_position_embeddings"] == 32


# YaRN and LongRoPE whose config.json names no original_max_position_embeddings (neither at the top level nor in the
# rope parameters), on max_position_embeddings 64; the context each allows (vLLM's rule on the config transformers
# standardizes: YaRN's original context, there max_position_embeddings, times the factor; LongRoPE's unscaled)
SHORT, LONG = [1.0 + 0.3 * i for i in range(8)], [3.0 + 1.1 * i for i in range(8)]
ROPE_WITHOUT_ORIGINAL = {
    "yarn": ({"rope_type": "yarn", "factor": 4.0}, 256),
    "yarn_mscale": ({"rope_type": "yarn", "factor": 4.0, "mscale": 2.0, "mscale_all_dim": 1.0, "beta_fast": 16,
                     "beta_slow": 2, "truncate": False}, 256),
    "yarn_attention_factor": ({"rope_type": "yarn", "factor": 3.0, "attention_factor": 1.3}, 192),
    "yarn_factor_null": ({"rope_type": "yarn", "factor": None}, 64),
    "longrope": ({"rope_type": "longrope", "factor": 8.0, "short_factor": SHORT, "long_factor": LONG}, 64),
    "longrope_without_factor": ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}, 64),
}


@pytest.mark.parametrize("case", list(ROPE_WITHOUT_ORIGINAL))
def test_rope_without_original_context_is_hf_s(case):
    """HF takes max_position_embeddings as the original context, and a factor left out (or null) as 1: our cos and
    sin table, at every position the model takes, and the attention factor are HF's rotary embedding's on the same
    config; so is the original context. LongRoPE's second half (the long factors, for a request that may pass the
    original context) is HF's on a sequence one position longer."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from picovllm.layers.rotary import RotaryEmbedding, attention_factor
    rope, context = ROPE_WITHOUT_ORIGINAL[case]
    fields = {**BASE, "max_position_embeddings": 64, "rope_parameters": {**rope, "rope_theta": 10000.0}}
    ours = ModelConfig.from_hf_dict({**copy.deepcopy(fields), "architectures": ["LlamaForCausalLM"]})
    hf_cfg = transformers.LlamaConfig(**copy.deepcopy(fields))      # which fills in its rope parameters
    hf = LlamaRotaryEmbedding(config=hf_cfg)
    assert ours.rope_scaling["original_max_position_embeddings"] == \
        hf_cfg.rope_parameters["original_max_position_embeddings"] == 64
    assert ours.max_position_embeddings == context
    assert attention_factor(ours.rope_scaling) == pytest.approx(hf.attention_scaling, rel=1e-12)
    table = RotaryEmbedding(ours.head_dim, ours.max_position_embeddings, ours.rope_theta, ours.rope_scaling).cos_sin
    longrope = rope["rope_type"] == "longrope"
    assert len(table) == context * (2 if longrope else 1)

    def assert_rows_are_hf_s(rows: torch.Tensor, length: int) -> None:    # HF's first `context` of `length`
        cos, sin = hf(torch.zeros(1, 1, ours.head_dim), torch.arange(length)[None])
        half = ours.head_dim // 2
        torch.testing.assert_close(rows[:, :half], cos[0, :context, :half], atol=1e-4, rtol=0)
        torch.testing.assert_close(rows[:, half:], sin[0, :context, :half], atol=1e-4, rtol=0)
    assert_rows_are_hf_s(table[:context], context)
    if longrope:
        assert_rows_are_hf_s(table[context:], context + 1)


@pytest.mark.parametrize("rope, lens", [({"rope_type": "yarn", "factor": 4.0}, (5, 45, 90)),
                                        ({"rope_type": "longrope", "factor": 8.0, "short_factor": SHORT,
                                          "long_factor": LONG}, (5, 45))])
def test_rope_without_original_context_matches_hf(tmp_path, rope, lens):
    """A tiny random Llama whose YaRN or LongRoPE has no original_max_position_embeddings in its config.json: HF's
    greedy tokens and logprobs (YaRN: prompts past max_position_embeddings too, within its factor times that)."""
    def edit(c):
        c["rope_parameters"].pop("original_max_position_embeddings", None)
        c.pop("original_max_position_embeddings", None)
    path = build(str(tmp_path / "m"), "LlamaConfig", max_position_embeddings=64, initializer_range=0.2,
                 rope_parameters={**rope, "rope_theta": 10000.0}, edit=edit)
    llm = assert_matches_hf(path, lens=lens)
    assert llm.engine.model_config.rope_scaling["original_max_position_embeddings"] == 64


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_dynamic_rope_is_the_default_rope_within_the_context(tmp_path, key):
    """HF's dynamic NTK rope only changes its base once a sequence passes max_position_embeddings, where the model's
    context ends here: every position of every request is HF's (the legacy `type` key too)."""
    path = build(str(tmp_path / "m"), "LlamaConfig", max_position_embeddings=64,
                 edit=lambda c: (c.pop("rope_parameters", None),
                                 c.update(rope_theta=10000.0, rope_scaling={key: "dynamic", "factor": 4.0})))
    llm = assert_matches_hf(path, lens=(5, 50), max_tokens=12)    # up to position 61 of 64
    assert llm.engine.max_model_len == 64


def _qwen(**fields) -> dict:
    import transformers
    cfg = transformers.Qwen2Config(**{**BASE, "num_hidden_layers": 30, **fields}).to_dict()
    return {**cfg, "architectures": ["Qwen2ForCausalLM"]}


def test_qwen_sliding_window_defaults_are_hf_s():
    """use_sliding_window left out is off (transformers' default), and max_window_layers left out is 28: the layers
    from the 29th slide, as HF's config class reads such a config.json."""
    import transformers
    cfg = {k: v for k, v in _qwen(sliding_window=8, max_window_layers=1).items() if k != "use_sliding_window"}
    assert ModelConfig.from_hf_dict(cfg).sliding_window is None
    cfg = {k: v for k, v in _qwen(sliding_window=8, use_sliding_window=True).items()
           if k not in ("max_window_layers", "layer_types")}
    hf = transformers.Qwen2Config(**cfg).layer_types
    ours = ModelConfig.from_hf_dict(cfg)
    assert [ours.layer_window(i) is not None for i in range(30)] == [t == "sliding_attention" for t in hf]
    assert ours.layer_window(28) == 8 and ours.layer_window(27) is None


def test_qwen2_without_use_sliding_window_matches_hf(tmp_path):
    path = build(str(tmp_path / "m"), "Qwen2Config", use_sliding_window=True, sliding_window=8, max_window_layers=1,
                 edit=lambda c: (c.pop("use_sliding_window"), c.pop("layer_types", None)))
    assert_matches_hf(path, lens=(5, 20))


def test_qwen3_moe_window_slides_every_layer_as_hf(tmp_path):
    """Qwen3-MoE's HF attention takes sliding_window on every layer once use_sliding_window is set (its config has no
    max_window_layers rule)."""
    path = build(str(tmp_path / "m"), "Qwen3MoeConfig", head_dim=16, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, use_sliding_window=True, sliding_window=8,
                 edit=lambda c: c.update(max_window_layers=2))
    llm = assert_matches_hf(path, lens=(5, 20))
    assert [llm.engine.model_config.layer_window(i) for i in range(2)] == [8, 8]


def test_bf16_sharded_checkpoint_matches_hf_in_fp32(tmp_path):
    """A bf16 checkpoint in several safetensors files (model.safetensors.index.json) loads on the CPU in float32, as
    HF loads it with dtype=float32."""
    import os
    path = build(str(tmp_path / "m"), "LlamaConfig", dtype=torch.bfloat16, max_shard_size="100KB")
    assert os.path.exists(f"{path}/model.safetensors.index.json")
    assert_matches_hf(path, lens=(5, 20))


@pytest.mark.parametrize("fields, match", [
    (dict(rope_scaling={"rope_type": "mrope_x", "factor": 2.0}), "rope_type='mrope_x'"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0] * 8}), "long_factor"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_unsupported_values_are_refused_by_name(fields, match):
    import transformers
    cfg = {**transformers.LlamaConfig(**BASE).to_dict(), "architectures": ["LlamaForCausalLM"]}
    cfg.pop("rope_parameters", None)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**cfg, **fields})


def test_deepseek_v2_mlp_bias_is_refused():
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf_dict(dict(BASE, architectures=["DeepseekV2ForCausalLM"], mlp_bias=True, q_lora_rank=None,
                                      n_routed_experts=0))


def test_gemma3_attention_soft_cap_in_config_is_ignored_as_hf(tmp_path):
    """Gemma 3's HF attention never caps its scores, whatever attn_logit_softcapping says (its final logits cap does
    apply): a config.json that sets both runs as HF's."""
    path = build(str(tmp_path / "m"), "Gemma3TextConfig", head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                 attn_logit_softcapping=20.0, final_logit_softcapping=7.0)
    llm = assert_matches_hf(path, lens=(5, 20))
    assert llm.engine.model_config.attn_logit_softcapping is None


def test_phi3_original_context_left_out_at_the_top_level_is_phi3_config_s(tmp_path):
    """HF reads Phi-3's original context from the config's top-level field, which Phi3Config defaults to 4096, over
    the rope parameters' own: a config.json that gives it only in rope_parameters (32 here) runs with 4096, so a
    45-token prompt keeps the short factors, as HF's."""
    def edit(c):
        c.pop("rope_scaling", None)
        c.pop("original_max_position_embeddings", None)
        c["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 16.0,
                                "original_max_position_embeddings": 32,
                                "short_factor": [1.0 + 0.3 * i for i in range(8)],
                                "long_factor": [3.0 + 1.1 * i for i in range(8)]}
    llm = assert_matches_hf(build(str(tmp_path / "m"), "Phi3Config", edit=edit, sliding_window=None), lens=(5, 45))
    assert llm.engine.model_config.rope_scaling["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize("case", ["rope_scaling", "rope_theta"])
def test_rope_fields_beside_rope_parameters_are_read_as_hf(tmp_path, case):
    """A config.json as transformers 5 writes it (rope_parameters, rope_theta in them) with an older field added
    beside, as a model card's recipe adds Qwen's YaRN: HF's config class takes rope_scaling over rope_parameters
    whole, and rope_parameters' rope_theta over the top-level one. An hf_overrides rope_theta still sets the base."""
    def edit(c):
        if case == "rope_scaling":
            c["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
        else:
            c["rope_theta"] = 100.0
    path = build(str(tmp_path / "m"), "Qwen3Config", head_dim=16, max_position_embeddings=64, edit=edit,
                 rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    llm = assert_matches_hf(path, lens=(5, 45, 100) if case == "rope_scaling" else (5, 45))
    assert llm.engine.model_config.rope_theta == (10000.0 if case == "rope_scaling" else 5000.0)   # HF's
    overridden = LLM(path, num_kv_blocks=64, device="cpu", dtype="float32", hf_overrides={"rope_theta": 300.0})
    assert overridden.engine.model_config.rope_theta == 300.0


@pytest.mark.parametrize("cls, fields", [("LlamaConfig", {}), ("Olmo2Config", {}), ("Glm4Config", dict(head_dim=16)),
                                         ("Ernie4_5Config", dict(head_dim=16))])
def test_sliding_window_is_ignored_where_hf_attention_has_none(tmp_path, cls, fields):
    """A sliding_window in the config.json of a family whose HF attention has no window (as some Llama conversions of
    Mistral models carry) is not read: every prompt token's logprob and the greedy tokens are HF's model's, run on the
    whole sequence each step (HF's generate would evict keys from its cache, which it sizes by that field alone)."""
    import transformers
    path = build(str(tmp_path / "m"), cls, edit=lambda c: c.update(sliding_window=8), **fields)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(4)
    prompts = [[rng.randrange(384) for _ in range(n)] for n in (5, 30)]
    llm = LLM(path, num_kv_blocks=64, device="cpu", dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logp = model(torch.tensor([p + o.outputs[0].token_ids])).logits[0].log_softmax(-1)
        assert [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])] == \
            pytest.approx([logp[i - 1, p[i]].item() for i in range(1, len(p))], abs=LOGPROB_ATOL)
        assert o.outputs[0].token_ids == logp[len(p) - 1:-1].argmax(-1).tolist()     # each HF's greedy choice
    assert llm.engine.model_config.sliding_window is None


GEMMA2 = dict(head_dim=16, query_pre_attn_scalar=16)


@pytest.mark.parametrize("cls, fields, types, match", [
    ("Gemma2Config", dict(GEMMA2, num_hidden_layers=4), ["sliding_attention", "full_attention"], "2 entries for 4"),
    ("Qwen2Config", dict(use_sliding_window=True), ["full_attention", "sliding_attention"] * 2, "4 entries for 2"),
    ("Gemma2Config", GEMMA2, ["chunked_attention", "sliding_attention"], "'chunked_attention' layers are unsupported"),
])
def test_layer_types_hf_cannot_run_are_refused_by_name(tmp_path, cls, fields, types, match):
    """A layer_types list of another length than num_hidden_layers (a pruned model's config.json, say) or with a type
    these families' attention lacks: HF's config class or model refuses it, and so does picovllm, naming the field (it
    had raised IndexError, or used the first entries)."""
    import transformers
    path = build(str(tmp_path / "m"), cls, sliding_window=8, edit=lambda c: c.update(layer_types=types), **fields)
    with pytest.raises(Exception):
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=f"config.json layer_types: {match}"):
        LLM(path, num_kv_blocks=64, device="cpu")


def test_longrope_factor_lists_of_the_wrong_length_are_refused_by_name(tmp_path):
    """Phi-3's LongRoPE factors, one a rotary frequency (head_dim 16: 8): a list of 7 is refused naming the field
    (a tensor broadcasting error before); HF cannot run it either."""
    import transformers

    def edit(c):
        c.pop("rope_scaling", None)
        c["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 16.0,
                                "original_max_position_embeddings": 32, "short_factor": SHORT[:7],
                                "long_factor": LONG}
    path = build(str(tmp_path / "m"), "Phi3Config", edit=edit, sliding_window=None)
    with pytest.raises(Exception):
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"rope_scaling.short_factor: 7 entries, where the rotary dimension 16 takes 8"):
        LLM(path, num_kv_blocks=64, device="cpu")


def test_cohere_reads_layer_norm_eps_beside_an_rms_norm_eps(tmp_path):
    """HF's Cohere reads layer_norm_eps only: an rms_norm_eps beside it in config.json (0.5 here, large enough to
    move every logit) is not read, as HF does not read it."""
    path = build(str(tmp_path / "m"), "CohereConfig", layer_norm_eps=1e-3, edit=lambda c: c.update(rms_norm_eps=0.5))
    llm = assert_matches_hf(path, lens=(5, 20))
    assert llm.engine.model_config.rms_norm_eps == 1e-3


@pytest.mark.parametrize("cls, fields, top", [
    ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8),
     dict(rope_theta=300.0, rope_local_base_freq=40.0)),
    ("Olmo3Config", dict(num_hidden_layers=4, sliding_window=6, layer_types=["sliding_attention"] * 3 +
                         ["full_attention"]), dict(rope_theta=300.0)),
])
def test_per_layer_type_rope_parameters_without_a_base_take_hf_s(tmp_path, cls, fields, top):
    """rope_parameters per layer type whose entries give no rope_theta: HF takes the full layers' base from the
    top-level rope_theta and the sliding layers' from rope_local_base_freq (Gemma 3) or its default (OLMo 3); the
    sliding layers had run on 10,000 and the full ones on the default whatever the top level said."""
    def edit(c):
        c.pop("rope_local_base_freq", None)
        c.update(top, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0},
                                       "sliding_attention": {"rope_type": "default"}})
    llm = assert_matches_hf(build(str(tmp_path / "m"), cls, edit=edit, **fields), lens=(5, 20))
    assert llm.engine.model_config.rope_theta == 300.0
