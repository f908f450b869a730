"""Gemma 2, Gemma 3 (text), Qwen3-MoE, Mixtral and Qwen2-MoE (a shared expert) from HF folders, and the text models
of image-and-text checkpoints (Gemma 3, Mistral 3, Qwen2.5-VL, Qwen3-VL): greedy tokens and logprobs against HF
transformers on the same tiny random weights (fp32, CPU), and TP=2 against TP=1.

The shapes are the awkward ones: head_dim 80 and 256, one KV head, windows shorter than the prompt (and than a
KV block), alternating sliding and global layers, soft-capped scores and logits, top-1 and top-2 routing over 8
and 64 experts, a dense layer among MoE layers.
"""
import random

import pytest
import torch

from picovllm import LLM, SamplingParams
from test_parity_hf import LOGPROB_ATOL, assert_tp2_matches_tp1, hf_greedy

VOCAB = 384
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
GEMMA2 = dict(head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
CASES = {
    # window 6 on layer 0, global layer 1; scores and logits capped hard enough to matter
    "gemma2": ("Gemma2Config", dict(GEMMA2, sliding_window=6)),
    # head_dim 256, one KV head, a window of 5 over 4 layers (sliding, global, sliding, global)
    "gemma2_hd256_mqa": ("Gemma2Config", dict(GEMMA2, head_dim=256, num_key_value_heads=1, num_attention_heads=2,
                                               sliding_window=5, num_hidden_layers=4)),
    # q/k norms, local rope base on sliding layers, global base with linear scaling; head_dim 80
    "gemma3": ("Gemma3TextConfig", dict(head_dim=80, query_pre_attn_scalar=64, sliding_window=7, num_hidden_layers=3,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 10000.0}})),
    # 8 experts, top-2, weights not renormalised; layer 1 dense
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         mlp_only_layers=[1], norm_topk_prob=False)),
    # 64 experts, top-1, renormalised (each token's one weight is 1)
    "qwen3_moe_64": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=64, num_experts_per_tok=1,
                                            moe_intermediate_size=16, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
    # top-2 of 8 beside a sigmoid-gated shared expert, q/k/v biases; layer 1 dense
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                         norm_topk_prob=False)),
}


def build(path: str, case: str) -> str:
    cls, extra = CASES[case]
    return build_checkpoint(path, case, cls, {**BASE, **extra})


def build_checkpoint(path: str, case: str, cls: str, config: dict, auto: str = "AutoModelForCausalLM") -> str:
    """A random HF checkpoint of transformers' `cls` (a config class name) at path, its weights seeded by the case's
    name and scaled so that every norm, router and soft-cap matters."""
    import transformers

    cfg = getattr(transformers, cls)(**config)
    torch.manual_seed(len(case))
    model = getattr(transformers, auto).from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:        # HF starts norms at 1 (Gemma's at 0, as 1 + w): make each one matter
                p.copy_(("gemma" not in case) + 0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight"):   # routers: decisive top-k choices, not near-ties
                p.copy_(0.5 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:   # scores of a few units: the soft-cap bites
                p.mul_(10)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gemma_moe")
    return {case: build(str(root / case), case) for case in CASES}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 19, 36)]


def generate(llm: LLM, ps, n: int = 12):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    return llm.generate(ps, sp, use_tqdm=False)


# engine kwargs: the C attention kernel with prefill chunks of 5 over cached context; for Gemma's attention, the
# torch reference too
ENGINES = [dict(max_num_batched_tokens=5), dict(attention_backend="torch")]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_logprobs_match_hf(models, case):
    ps = prompts()
    ref, ref_lp = hf_greedy(models[case], ps, 12)
    for kw in ENGINES if case.startswith("gemma") else ENGINES[:1]:
        llm = LLM(models[case], block_size=4, num_kv_blocks=128, device="cpu", **kw)
        outs = generate(llm, ps)
        assert [o.outputs[0].token_ids for o in outs] == ref, kw
        for o, lp in zip(outs, ref_lp):
            ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            assert ours == pytest.approx(lp, abs=LOGPROB_ATOL)
        assert llm.engine.scheduler.block_manager.num_free_blocks == 128


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_tp2_matches_tp1(models, case, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")     # two ranks on two shared cores
    assert_tp2_matches_tp1(models[case], prompts(1))


def test_q8_0_at_load_is_refused_for_experts(models):
    with pytest.raises(ValueError, match="'q8_0' quantizes dense models"):
        LLM(models["qwen2_moe"], device="cpu", quantization="q8_0")


@pytest.mark.parametrize("field,value", [("use_bidirectional_attention", True), ("hidden_activation", "relu"),
                                         ("rope_parameters", {"rope_type": "longrope", "factor": 2.0})])
def test_what_cannot_be_honoured_is_refused(models, tmp_path, field, value):
    import json
    import os
    import shutil

    path = str(tmp_path / "m")
    shutil.copytree(models["gemma2"], path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(cfg, **{field: value}), f)
    with pytest.raises(ValueError, match=field.split("_")[0] if field == "rope_parameters" else field):
        LLM(path, device="cpu")


MULTIMODAL = {
    # Gemma 3 4B-27B's checkpoints: the text model (q/k norms, a sliding layer and a global one) beside SigLIP
    "gemma3_mm": ("Gemma3Config", "Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=7,
                                                          layer_types=["sliding_attention", "full_attention"]),
                  "SiglipVisionConfig", dict(image_size=28, patch_size=14), dict(mm_tokens_per_image=4,
                                                                                  image_token_index=383)),
    # Mistral Small 3.1's: Mistral's text model beside Pixtral
    "mistral3_mm": ("Mistral3Config", "MistralConfig", dict(head_dim=16, sliding_window=None), "PixtralVisionConfig",
                    dict(image_size=28, patch_size=14, head_dim=16), dict(image_token_index=383)),
    # Qwen2.5-VL's: Qwen2's text model (q/k/v biases) under multimodal rope, whose three position streams are equal
    # on text (so it is plain rope there)
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLTextConfig",
                   dict(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}), "Qwen2_5_VLVisionConfig",
                   dict(depth=1, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[0]),
                   dict(image_token_id=380, video_token_id=381, vision_start_token_id=382)),
    # Qwen3-VL's: Qwen3's (q/k norms) under interleaved multimodal rope
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLTextConfig", dict(head_dim=16, rope_scaling={
                     "rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
                 "Qwen3VLVisionConfig", dict(depth=1, num_heads=2, out_hidden_size=64, deepstack_visual_indexes=[0]),
                 dict(image_token_id=380, video_token_id=381, vision_start_token_id=382)),
}


def build_multimodal(path: str, case: str, **extra) -> str:
    """A tiny random image-and-text checkpoint (a one-layer vision tower), saved as transformers saves one; extra:
    fields set both in its text config and at its top level."""
    import transformers

    cls, text_cls, text, vision_cls, vision, top = MULTIMODAL[case]
    top = {**top, **extra}
    text_cfg = getattr(transformers, text_cls)(**{**BASE, **text, **extra})
    vision_cfg = getattr(transformers, vision_cls)(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                   num_attention_heads=2, **vision)
    return build_checkpoint(path, case, cls, dict(text_config=text_cfg, vision_config=vision_cfg, **top),
                            "AutoModelForImageTextToText")


@pytest.mark.parametrize("case", list(MULTIMODAL))
def test_the_text_model_of_a_multimodal_checkpoint_matches_hf(tmp_path, case):
    """Gemma3ForConditionalGeneration and Mistral3ForConditionalGeneration served as their text models: the vision
    tower and projector are left out, the text model's tensors renamed; on text prompts, HF's whole model's greedy
    tokens and logprobs."""
    path = build_multimodal(str(tmp_path / case), case)
    ps = prompts()
    ref, ref_lp = hf_greedy(path, ps, 10, "AutoModelForImageTextToText")
    llm = LLM(path, block_size=4, num_kv_blocks=128, device="cpu")
    assert llm.engine.model_config.architecture == {
        "gemma3_mm": "Gemma3ForCausalLM", "mistral3_mm": "MistralForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM",
        "qwen3_vl": "Qwen3ForCausalLM"}[case]
    outs = generate(llm, ps, 10)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert ours == pytest.approx(lp, abs=LOGPROB_ATOL)


def test_a_released_gemma3_config_takes_transformers_defaults(tmp_path):
    """Gemma 3 4B's config.json as released names six text_config fields; the rest are Gemma3TextConfig's defaults
    (the oracle: transformers' own config class on the same six), and HF's image-and-text model does not soft-cap."""
    import json

    import transformers

    from picovllm.config import ModelConfig
    from picovllm.loader.hf_folder import _text_config
    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
           "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": [1, 106], "mm_tokens_per_image": 256,
           "image_token_index": 262144}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    got = ModelConfig.from_hf_dict(_text_config(str(tmp_path), raw))
    want = transformers.Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    assert (got.vocab_size, got.num_attention_heads, got.num_key_value_heads, got.head_dim, got.hidden_act) == \
        (want.vocab_size, want.num_attention_heads, want.num_key_value_heads, want.head_dim, want.hidden_activation)
    assert (got.max_position_embeddings, got.query_pre_attn_scalar, got.sliding_window) == \
        (want.max_position_embeddings, want.query_pre_attn_scalar, 1024)
    assert got.rope_theta == want.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert (got.rope_scaling["rope_type"], got.rope_scaling["factor"], got.rope_local_theta) == ("linear", 8.0, 10000.0)
    assert got.sliding_layers == [(i + 1) % 6 != 0 for i in range(34)] and got.eos_token_ids == [1, 106]
    assert got.final_logit_softcapping is None
    quantized = dict(raw, quantization_config={"quant_method": "awq"})   # the checkpoint's, at the top level
    with pytest.raises(ValueError, match="quant_method='awq'"):
        ModelConfig.from_hf_dict(_text_config(str(tmp_path), quantized))
    raw["text_config"] = dict(text, model_type="gemma2")          # another text model: refused by name
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="text_config.model_type='gemma2'"):
        _text_config(str(tmp_path), raw)


def test_a_multimodal_lm_head_is_tied_as_hf_ties_it(tmp_path):
    """A Mistral 3 checkpoint with its own LM head whose top-level config still says tie_word_embeddings (transformers
    5 writes Mistral3Config's default): HF keeps the head it was given, and so does picovllm (tokens and logprobs);
    the Mistral-format consolidated.safetensors beside an index is not read."""
    import json
    import os

    from safetensors.torch import save_file
    path = build_multimodal(str(tmp_path / "m"), "mistral3_mm", tie_word_embeddings=False)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["tie_word_embeddings"] = True
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    json.dump({"weight_map": {"x": files[0]}}, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, os.path.join(path, "consolidated.safetensors"))
    ps = prompts()
    ref, ref_lp = hf_greedy(path, ps, 8, "AutoModelForImageTextToText")
    llm = LLM(path, block_size=4, num_kv_blocks=128, device="cpu")
    assert not llm.engine.model_config.tie_word_embeddings
    outs = generate(llm, ps, 8)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            pytest.approx(lp, abs=LOGPROB_ATOL)
