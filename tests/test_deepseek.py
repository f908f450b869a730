"""DeepSeek-V2 (DeepseekV2ForCausalLM: V2, V2-Lite) and DeepSeek-V3 (DeepseekV3ForCausalLM: V3, R1, Kimi-K2,
Moonlight) from HF folders: greedy tokens and logprobs against HF transformers on the same tiny random weights (fp32,
CPU), through chunked prefill and the prefix cache, TP=2 against TP=1, and the GPU path (marked gpu).

The shapes are the awkward ones: MLA with qk_nope_head_dim 32 + qk_rope_head_dim 16 = 48 K dims a head beside
v_head_dim 24 (V padded to 48 in the cache; V2) or 56 (q and K padded to 56; V3), kv_lora_rank 32, interleaved rope
pairs (V2's always; V3's rope_interleave) reordered at load. V2: q straight from q_proj (q_lora_rank None, as V2-Lite),
softmax routing with group_limited_greedy (8 experts in 4 groups, 2 kept, top-3), routed_scaling_factor 1.5, two
shared experts, a dense first layer. V3: q through q_a_proj -> q_a_layernorm -> q_b_proj, YaRN with mscale and
mscale_all_dim (cos/sin and the scores' scale both change), sigmoid routing with a correction bias, groups, scale 2.5,
a dense first layer, a shared expert, biases on q_a_proj, kv_a_proj_with_mqa and o_proj (attention_bias) and a multi-token-prediction layer
in the checkpoint (not read).
"""
import json
import os
import random
import shutil

import pytest
import torch

from picovllm import LLM, SamplingParams
from test_parity_hf import LOGPROB_ATOL, assert_gpu_fp32_matches_hf, assert_tp2_matches_tp1, hf_greedy

VOCAB = 384
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.1, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, n_routed_experts=8,
            num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=32, first_k_dense_replace=1)
CASES = {
    "v2": ("DeepseekV2Config", dict(q_lora_rank=None, v_head_dim=24, topk_method="group_limited_greedy",
                                    routed_scaling_factor=1.5, n_shared_experts=2)),
    "v3": ("DeepseekV3Config", dict(q_lora_rank=48, v_head_dim=56, attention_bias=True, routed_scaling_factor=2.5, norm_topk_prob=True,
                                    n_shared_experts=1, rope_interleave=True, num_nextn_predict_layers=1,
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 64, "mscale": 0.8,
                                                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
}


def build(path: str, case: str) -> str:
    """A random checkpoint of the case, its weights scaled so that every norm, routing choice and the rope's pairing
    matter; the V3 one with an MTP layer's tensors (model.layers.2.*, as V3's model.layers.61.*) in its file."""
    import transformers
    from safetensors.torch import load_file, save_file

    cls, extra = CASES[case]
    torch.manual_seed(len(case) + 7 * (case == "v3"))
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**BASE, **extra),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:                     # HF starts norms at 1
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight"):     # the router: decisive choices, not near-ties
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(("e_score_correction_bias", "bias")):   # HF starts both at 0
                p.copy_(0.3 * torch.randn_like(p))
            elif "q_proj" in name or "q_b_proj" in name or "kv_a_proj" in name:   # peaked attention
                p.mul_(4)
    model.save_pretrained(path)
    if case == "v3":
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        mtp = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in tensors.items()
               if k.startswith("model.layers.1.")}
        mtp.update({"model.layers.2.eh_proj.weight": torch.randn(64, 128), "model.layers.2.enorm.weight":
                    torch.ones(64), "model.layers.2.hnorm.weight": torch.ones(64),
                    "model.layers.2.shared_head.norm.weight": torch.ones(64),
                    "model.layers.2.shared_head.head.weight": torch.randn(VOCAB, 64)})
        save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek")
    return {case: build(str(root / case), case) for case in CASES}


@pytest.fixture(scope="module")
def references(models) -> dict[str, tuple]:
    """HF's greedy tokens and logprobs for prompts(), per case, computed at first use."""
    refs = {}

    def get(case: str) -> tuple:
        if case not in refs:
            refs[case] = hf_greedy(models[case], prompts(), 10)
        return refs[case]
    return get


def prompts(seed: int = 0) -> list[list[int]]:
    """Four prompts; the last two share their first 20 tokens."""
    rng = random.Random(seed)
    ps = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 19, 36)]
    ps[3][:20] = ps[2][:20] = [rng.randrange(3, VOCAB) for _ in range(20)]
    return ps


def config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


# the C attention kernel (the CPU's default) and the torch reference
@pytest.mark.parametrize("case,backend", [("v2", "auto"), ("v3", "auto"), ("v2", "torch"), ("v3", "torch")])
def test_greedy_and_logprobs_match_hf(models, references, case, backend):
    """Prefill chunks of 5 over cached context, then decode steps; the same prompts again, their blocks from the
    prefix cache: the same tokens."""
    ps = prompts()
    ref, ref_lp = references(case)
    llm = LLM(models[case], block_size=4, num_kv_blocks=128, max_num_batched_tokens=5, device="cpu",
              attention_backend=backend)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outs = llm.generate(ps, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert ours == pytest.approx(lp, abs=LOGPROB_ATOL)
    again = llm.generate(ps[2:], sp, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [16, 32]      # whole blocks of the prompts, the last token not
    assert [o.outputs[0].token_ids for o in again] == ref[2:]
    assert llm.engine.scheduler.block_manager.num_free_blocks == 128


def test_config_reads_deepseek_fields(models, tmp_path):
    """What the parity rests on: MLA's shapes, the cache's head dim, the scale, the routing fields, the dense first
    layer, the ungated shared experts; what is not supported is refused naming its field; the MTP layer's tensors are
    not read, and without num_nextn_predict_layers they are refused as any stray tensor is."""
    from picovllm.config import ModelConfig
    from picovllm.layers.rotary import head_order

    v2 = ModelConfig.from_hf_dict(config(models["v2"]))
    assert (v2.q_lora_rank, v2.kv_lora_rank, v2.qk_nope_head_dim, v2.qk_rope_head_dim, v2.v_head_dim) == \
        (None, 32, 32, 16, 24)
    assert (v2.head_dim, v2.num_key_value_heads, v2.rotary_interleaved, head_order(v2)) == (48, 4, True, None)
    assert (v2.scoring_func, v2.n_group, v2.topk_group, v2.routed_scaling_factor, v2.norm_topk_prob) == \
        ("softmax", 4, 2, 1.5, False)
    assert (v2.moe_layers, v2.shared_expert_intermediate_size, v2.shared_expert_gated) == ([False, True], 64, False)
    assert v2.attention_multiplier == pytest.approx(48 ** -0.5)
    v3 = ModelConfig.from_hf_dict(config(models["v3"]))
    assert (v3.q_lora_rank, v3.head_dim, v3.scoring_func, v3.n_group, v3.topk_group, v3.norm_topk_prob) == \
        (48, 56, "sigmoid", 4, 2, True)
    assert (v3.rotary_interleaved, v3.attention_bias, v3.routed_scaling_factor) == (True, True, 2.5)
    assert v3.attention_multiplier == pytest.approx(48 ** -0.5 * (0.1 * 1.0 * torch.log(torch.tensor(4.0)).item()
                                                                   + 1) ** 2)
    raw2, raw3 = config(models["v2"]), config(models["v3"])
    for raw, field, value in [(raw2, "topk_method", "noaux_tc"), (raw2, "scoring_func", "sigmoid"),
                              (raw2, "norm_topk_prob", True), (raw2, "n_group", 3), (raw3, "topk_group", 5),
                              (raw3, "scoring_func", "softmax"), (raw3, "topk_method", "group_limited_greedy"),
                              (raw3, "qk_rope_head_dim", 15), (raw3, "kv_lora_rank", None),
                              (raw3, "quantization_config", {"quant_method": "awq"})]:
        with pytest.raises(ValueError, match=field if field != "quantization_config" else "quant_method"):
            ModelConfig.from_hf_dict(dict(raw, **{field: value}))
    greedy = ModelConfig.from_hf_dict(dict(raw2, topk_method="greedy"))
    assert (greedy.n_group, greedy.topk_group) == (1, 1)
    freq = ModelConfig.from_hf_dict(dict(raw2, num_hidden_layers=5, moe_layer_freq=2))
    assert freq.moe_layers == [False, False, True, False, True]       # DeepSeek's rule: i >= k and i % freq == 0
    stray = str(tmp_path / "stray")
    shutil.copytree(models["v3"], stray)
    json.dump(dict(raw3, num_nextn_predict_layers=0), open(os.path.join(stray, "config.json"), "w"))
    with pytest.raises(ValueError, match="model.layers.2.*matches no parameter"):
        LLM(stray, device="cpu")


def test_grouped_softmax_routing_matches_hf_router():
    """layers/moe.route_grouped against HF's DeepseekV2TopkRouter on the same logits: the same experts and weights,
    greedy and group-limited; the group limit changes the choice."""
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from picovllm.layers.moe import Routing, route_grouped
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    for method, groups, keep, k in [("group_limited_greedy", 4, 2, 3), ("group_limited_greedy", 8, 3, 4),
                                    ("greedy", 1, 1, 6)]:
        cfg = transformers.DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=k,
                                            n_group=groups, topk_group=keep, routed_scaling_factor=1.7,
                                            topk_method=method)
        router = DeepseekV2TopkRouter(cfg)
        with torch.no_grad():
            router.weight.copy_(torch.randn(16, 32, generator=g))
        logits, want_w, want_ids = router(x)
        got_w, got_ids = route_grouped(logits, k, False, Routing("softmax", groups, keep, 1.7))
        order_got, order_want = got_ids.argsort(-1), want_ids.argsort(-1)
        assert torch.equal(got_ids.gather(1, order_got), want_ids.gather(1, order_want))
        assert torch.allclose(got_w.gather(1, order_got), want_w.gather(1, order_want), rtol=1e-6, atol=0)
        if keep < groups:
            free, _ = route_grouped(logits, k, False, Routing("softmax", 1, 1, 1.7))
            assert not torch.equal(free, got_w)


def test_deepseek2_gguf_without_its_metadata_is_refused(tmp_path):
    """deepseek2 GGUF files are read (tests/test_gguf_deepseek.py); one without MLA's metadata is refused, naming
    the key."""
    import gguf

    path = str(tmp_path / "ds.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="metadata key 'deepseek2.attention.head_count' is missing"):
        LLM(path, device="cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_tp1(models, case, monkeypatch):
    """Heads split across the ranks (q's projection, kv_b_proj and o_proj), the latent projections replicated, the
    experts' and shared experts' intermediate dims split. The torch attention (the C kernel's per-shape builds are
    the parity test's)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")     # two ranks on two shared cores
    assert_tp2_matches_tp1(models[case], prompts(1), attention_backend="torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_fp32_matches_hf(models, case):
    """On the GPU (Triton attention over head dims 48 and 56, CUDA graphs; the routing in torch ops, then the grouped
    GEMMs): HF's greedy tokens, logprobs within 5e-3."""
    assert_gpu_fp32_matches_hf(models[case], prompts())
