"""GLM-4 (Glm4ForCausalLM: GLM-4-9B-0414, GLM-Z1) and GLM-4.5 (Glm4MoeForCausalLM: GLM-4.5, -Air, GLM-4.6) from HF
folders: greedy tokens and logprobs against HF transformers on the same tiny random weights (fp32, CPU), TP=2 against
TP=1, and the GPU path (marked gpu).

The shapes are the awkward ones: a quarter of each head rotating (head_dim 16, partial_rotary_factor 0.5 -> 8 dims;
GLM-4's pairs interleaved, GLM-4.5's rotate-half), one KV head (replicated under TP=2), q/k/v biases, GLM-4's
post-norms; GLM-4.5: sigmoid routing over 8 experts in 4 groups of which each token keeps 2 (topk_group < n_group),
top-3, a correction bias that moves the choice, routed_scaling_factor 2.5, a dense first layer, a shared expert, q/k
norms and a multi-token-prediction layer in the checkpoint (not read).
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
            num_key_value_heads=1, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, initializer_range=0.1)
CASES = {
    "glm4": ("Glm4Config", dict(partial_rotary_factor=0.5)),
    "glm4_moe": ("Glm4MoeConfig", dict(partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                                       n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                       routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                                       n_shared_experts=1, moe_intermediate_size=32, num_nextn_predict_layers=1)),
}


def build(path: str, case: str) -> str:
    """A random checkpoint of the case, its weights scaled so that every norm, bias and routing choice matters; the
    GLM-4.5 one with an MTP layer's tensors (model.layers.2.*, as GLM-4.5's model.layers.92.*) in its file."""
    import transformers
    from safetensors.torch import load_file, save_file

    cls, extra = CASES[case]
    torch.manual_seed(len(case))
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
            elif "q_proj" in name or "k_proj" in name:   # peaked attention: the rotation's pairing shows
                p.mul_(4)
    model.save_pretrained(path)
    if case == "glm4_moe":
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        mtp = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in tensors.items()
               if k.startswith("model.layers.1.")}
        mtp.update({"model.layers.2.eh_proj.weight": torch.randn(64, 128), "model.layers.2.enorm.weight":
                    torch.ones(64), "model.layers.2.hnorm.weight": torch.ones(64),
                    "model.layers.2.shared_head.norm.weight": torch.ones(64),
                    "model.layers.2.shared_head.head.weight": torch.randn(VOCAB, 64),
                    "model.layers.2.embed_tokens.weight": torch.randn(VOCAB, 64)})
        save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("glm")
    return {case: build(str(root / case), case) for case in CASES}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 19, 36)]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_logprobs_match_hf(models, case):
    """Prefill chunks of 5 over cached context, then decode steps (GLM-4's through the CPU's one-call decode stack,
    GLM-4.5's layer by layer)."""
    ps = prompts()
    ref, ref_lp = hf_greedy(models[case], ps, 10)
    llm = LLM(models[case], block_size=4, num_kv_blocks=128, max_num_batched_tokens=5, device="cpu")
    assert (llm.engine.runner.cpu_decode is not None) == (case == "glm4")
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert ours == pytest.approx(lp, abs=LOGPROB_ATOL)
    assert llm.engine.scheduler.block_manager.num_free_blocks == 128


def test_config_reads_glm_fields(models, tmp_path):
    """What the parity rests on: the rotary part, its interleaved pairs (GLM-4 only), the routing fields, the dense
    first layer, the ungated shared expert; the MTP layer's tensors are not read, and without
    num_nextn_predict_layers they are refused as any stray tensor is."""
    from picovllm.config import ModelConfig
    from picovllm.layers.rotary import head_order

    glm4 = ModelConfig.from_hf_dict(json.load(open(os.path.join(models["glm4"], "config.json"))))
    assert (glm4.rotary_dim, glm4.rotary_interleaved, glm4.attention_bias) == (8, True, True)
    # pairs (0,1), (2,3), (4,5), (6,7) rotate -> positions (i, i + 8); dims 8..15 pass, two by two
    assert head_order(glm4) == [0, 2, 4, 6, 8, 9, 10, 11, 1, 3, 5, 7, 12, 13, 14, 15]
    moe = ModelConfig.from_hf_dict(json.load(open(os.path.join(models["glm4_moe"], "config.json"))))
    assert (moe.rotary_dim, moe.rotary_interleaved, moe.qk_norm, moe.num_experts, moe.moe_layers) == \
        (8, False, True, 8, [False, True])
    assert (moe.scoring_func, moe.n_group, moe.topk_group, moe.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    assert (moe.shared_expert_intermediate_size, moe.shared_expert_gated, moe.norm_topk_prob) == (32, False, True)
    raw = json.load(open(os.path.join(models["glm4_moe"], "config.json")))
    for field, value in [("n_group", 3), ("topk_group", 5), ("topk_group", 1)]:     # 8 % 3; > n_group; 2 < top-3
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_hf_dict(dict(raw, **{field: value}))
    stray = str(tmp_path / "stray")
    shutil.copytree(models["glm4_moe"], stray)
    json.dump(dict(raw, num_nextn_predict_layers=0), open(os.path.join(stray, "config.json"), "w"))
    with pytest.raises(ValueError, match="model.layers.2.*matches no parameter"):
        LLM(stray, device="cpu")


def test_sigmoid_routing_matches_hf_router():
    """layers/moe.route_sigmoid against HF's Glm4MoeTopkRouter on the same logits: the same experts and weights,
    with groups kept (topk_group < n_group) or not; the group limit and the bias change the choice."""
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from picovllm.layers.moe import Routing, route_sigmoid
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    for groups, keep, k in [(4, 2, 3), (8, 3, 4), (1, 1, 6)]:
        cfg = transformers.Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=k, n_group=groups,
                                         topk_group=keep, routed_scaling_factor=1.7, norm_topk_prob=True)
        router = Glm4MoeTopkRouter(cfg)
        with torch.no_grad():
            router.weight.copy_(torch.randn(16, 32, generator=g))
            router.e_score_correction_bias.copy_(torch.randn(16, generator=g))
        logits, want_w, want_ids = router(x)
        routing = Routing("sigmoid", groups, keep, 1.7)
        got_w, got_ids = route_sigmoid(logits, router.e_score_correction_bias, k, True, routing)
        order_got, order_want = got_ids.argsort(-1), want_ids.argsort(-1)
        assert torch.equal(got_ids.gather(1, order_got), want_ids.gather(1, order_want))
        assert torch.equal(got_w.gather(1, order_got), want_w.gather(1, order_want))
        if keep < groups:
            free, _ = route_sigmoid(logits, router.e_score_correction_bias, k, True, Routing("sigmoid", 1, 1, 1.7))
            assert not torch.equal(free, got_w)
        unbiased, _ = route_sigmoid(logits, torch.zeros(16), k, True, routing)
        assert not torch.equal(unbiased, got_w)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_tp1(models, case, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")     # two ranks on two shared cores
    assert_tp2_matches_tp1(models[case], prompts(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_fp32_matches_hf(models, case):
    """On the GPU (Triton rotary over the reordered q/k, CUDA graphs; GLM-4.5's routing in torch ops, then the
    grouped GEMMs): HF's greedy tokens, logprobs within 5e-3."""
    assert_gpu_fp32_matches_hf(models[case], prompts())
