"""OLMo 3, OLMoE, Seed-OSS, EXAONE 4.0 and ERNIE 4.5 (dense) from HF folders: greedy tokens and logprobs against HF
transformers on the same tiny random weights (fp32, CPU) through the C and torch attention backends, with chunked
prefill and the prefix cache; TP=2 against TP=1; the GPU path (marked gpu); what their configs set and the code does
not do, refused naming the field.

The shapes are the awkward ones: windows of 6 under 36-token prompts and blocks of 4 (blocks slide out), OLMo 3's
and EXAONE 4's three sliding layers of four (EXAONE's fourth NoPE), OLMo 3's linear rope scaling on its full layer
only, 64 experts top-8 (OLMoE), biases on q/k/v and o (Seed-OSS; OLMo 3 with attention_bias), ERNIE's interleaved
rotary pairs, head_dim 16 under 4 heads of hidden 64.
"""
import json
import random
import shutil

import pytest
import torch

from picovllm import LLM, SamplingParams
from picovllm.config import ModelConfig
from test_parity_hf import LOGPROB_ATOL, assert_gpu_fp32_matches_hf, assert_tp2_matches_tp1, hf_greedy

VOCAB = 384
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, initializer_range=0.1)
SLIDING4 = ["sliding_attention"] * 3 + ["full_attention"]
CASES = {
    # 3 sliding layers of 4 (window 6) on their own default rope, the full one with linear scaling; q/k/v/o biases
    "olmo3": ("Olmo3Config", dict(num_hidden_layers=4, sliding_window=6, layer_types=SLIDING4, attention_bias=True,
                                  rope_parameters={
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                         "rope_theta": 10000.0}})),
    # OLMo 2 with attention_bias: the o_proj bias it shares with OLMo 3 (HF's o_proj takes attention_bias too)
    "olmo2_bias": ("Olmo2Config", dict(attention_bias=True)),
    # 64 experts, top-8, weights not renormalised (OLMoE-1B-7B's routing); q/k normed over the whole projection
    "olmoe": ("OlmoeConfig", dict(num_experts=64, num_experts_per_tok=8, intermediate_size=32, norm_topk_prob=False)),
    # q/k/v biases (its default) and an o_proj bias
    "seed_oss": ("SeedOssConfig", dict(head_dim=16, attention_out_bias=True)),
    # post-norms, per-head q/k norms, 3 sliding layers of 4 (window 6), the global one NoPE
    "exaone4": ("Exaone4Config", dict(num_hidden_layers=4, sliding_window=6, sliding_window_pattern=4,
                                      num_key_value_heads=2)),
    # no sliding_window: every layer global, every layer rotates
    "exaone4_global": ("Exaone4Config", dict(sliding_window=None, layer_types=["full_attention"] * 2,
                                             num_key_value_heads=2)),
    # interleaved rotary pairs, tied embeddings (its default)
    "ernie4_5": ("Ernie4_5Config", dict(head_dim=16)),
}
TP_CASES = ["olmo3", "olmoe", "seed_oss", "exaone4", "ernie4_5"]


def build(path: str, case: str) -> str:
    """A random checkpoint of the case, its weights scaled so that every norm, bias and routing choice matters."""
    import transformers

    cls, extra = CASES[case]
    torch.manual_seed(len(case))
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**BASE, **extra}),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:                     # HF starts norms at 1
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("gate.weight"):     # the router: decisive choices, not near-ties
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("bias"):            # HF starts biases at 0
                p.copy_(0.3 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:   # peaked attention: windows and rotations show
                p.mul_(4)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families_2026")
    return {case: build(str(root / case), case) for case in CASES}


def edited(src: str, dst: str, drop: tuple[str, ...] = (), **fields) -> str:
    """A copy of the model folder src at dst, its config.json with `fields` set and `drop` removed."""
    shutil.copytree(src, dst)
    with open(f"{dst}/config.json") as f:
        cfg = json.load(f)
    for key in drop:
        cfg.pop(key, None)
    with open(f"{dst}/config.json", "w") as f:
        json.dump({**cfg, **fields}, f)
    return dst


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 7, 19, 36)]


def generate(llm: LLM, ps, n: int = 12):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    return llm.generate(ps, sp, use_tqdm=False)


def assert_matches(outs, ref, ref_lp) -> None:
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert ours == pytest.approx(lp, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_logprobs_match_hf(models, case):
    """HF's tokens and logprobs through the C attention kernel (prefill chunks of 5 over cached context, blocks of
    4), then again from the prefix cache, and through the torch backend."""
    ps = prompts()
    ref, ref_lp = hf_greedy(models[case], ps, 12)
    llm = LLM(models[case], block_size=4, num_kv_blocks=128, max_num_batched_tokens=5, device="cpu")
    assert_matches(generate(llm, ps), ref, ref_lp)
    again = generate(llm, ps)                      # the prompts' full blocks now cached
    assert_matches(again, ref, ref_lp)
    assert again[3].num_cached_tokens >= 32
    torch_llm = LLM(models[case], block_size=16, num_kv_blocks=64, device="cpu", attention_backend="torch")
    assert_matches(generate(torch_llm, ps), ref, ref_lp)


def test_configs_read_as_hf_does(models):
    """What the parity above rests on: the windows, NoPE layers, rope bases and biases each family's config says."""
    def cfg(case):
        return LLM(models[case], num_kv_blocks=16, device="cpu").engine.model_config
    olmo3 = cfg("olmo3")
    assert olmo3.sliding_layers == [True, True, True, False] and olmo3.sliding_window == 6
    assert olmo3.rope_scaling["rope_type"] == "linear" and olmo3.rope_local_theta == 10000.0
    assert olmo3.o_proj_bias and olmo3.attention_bias and olmo3.rope_layers is None
    olmoe = cfg("olmoe")
    assert (olmoe.num_experts, olmoe.num_experts_per_tok, olmoe.norm_topk_prob) == (64, 8, False)
    assert olmoe.moe_intermediate_size == 32 and not olmoe.o_proj_bias
    seed = cfg("seed_oss")
    assert seed.attention_bias and seed.o_proj_bias
    exaone = cfg("exaone4")
    assert exaone.qk_norm and exaone.sliding_layers == [True, True, True, False]
    assert exaone.rope_layers == [True, True, True, False]
    assert cfg("exaone4_global").rope_layers is None and cfg("exaone4_global").sliding_window is None
    ernie = cfg("ernie4_5")
    assert ernie.rotary_interleaved and ernie.tie_word_embeddings


def test_olmo3_config_as_released(models, tmp_path):
    """An OLMo 3 config.json as transformers 4.x wrote it (rope_theta and rope_scaling at the top, no layer_types):
    every 4th layer full and scaled, the others sliding on the plain rope of the same base, as HF reads it (tokens
    and logprobs against HF on the edited config). The base is the released models' 500000: transformers 5 gives a
    top-level rope_theta to the full layers only (the sliding ones keep its default, 500000)."""
    path = edited(models["olmo3"], str(tmp_path / "olmo3"), drop=("rope_parameters", "layer_types"),
                  rope_theta=500000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    cfg = ModelConfig.from_hf_dict(json.load(open(f"{path}/config.json")))
    assert cfg.sliding_layers == [True, True, True, False] and cfg.rope_scaling["factor"] == 2.0
    assert cfg.rope_theta == cfg.rope_local_theta == 500000.0
    ps = prompts(2)
    ref, ref_lp = hf_greedy(path, ps, 8)
    llm = LLM(path, block_size=4, num_kv_blocks=128, device="cpu")
    assert_matches(generate(llm, ps, 8), ref, ref_lp)


def test_exaone4_nope_and_window_matter(models, tmp_path):
    """EXAONE 4's global layer is NoPE and its sliding layers slide: the same weights with every layer global (no
    sliding_window) give other logprobs, so the parity above tests both."""
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def logprobs(path):
        out = LLM(path, num_kv_blocks=64, device="cpu").generate([prompts()[3]], sp, use_tqdm=False)[0]
        return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    glob = edited(models["exaone4"], str(tmp_path / "global"), sliding_window=None, layer_types=["full_attention"] * 4)
    assert logprobs(glob) != pytest.approx(logprobs(models["exaone4"]), abs=1e-3)


def _hf_dict(case: str, **fields) -> dict:
    import transformers
    cls, extra = CASES[case]
    cfg = getattr(transformers, cls)(**{**BASE, **extra}).to_dict()
    cfg["architectures"] = [cls.replace("Config", "ForCausalLM")]
    return {**cfg, **fields}


@pytest.mark.parametrize("case, fields, match", [
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
    ("olmoe", dict(head_dim=32), "head_dim"),
    ("seed_oss", dict(mlp_bias=True), "mlp_bias"),
    ("ernie4_5", dict(use_bias=True), "use_bias"),
    ("exaone4", dict(layer_types=None, sliding_window_pattern="LLLG"), "sliding_window_pattern"),
    ("olmo3", dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "sliding_attention"),
])
def test_unsupported_fields_are_refused(case, fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(_hf_dict(case, **fields))


def test_defaults_of_fields_left_out():
    """A config.json that leaves fields at transformers' defaults (save_pretrained writes only the others) reads
    them as HF does: Seed-OSS's q/k/v biases, ERNIE's tied embeddings and rope base, OLMo 3's window and base."""
    seed = ModelConfig.from_hf_dict({k: v for k, v in _hf_dict("seed_oss").items() if k != "attention_bias"})
    assert seed.attention_bias
    ernie = {k: v for k, v in _hf_dict("ernie4_5").items() if k not in ("tie_word_embeddings", "rope_parameters")}
    ernie = ModelConfig.from_hf_dict(ernie)
    assert ernie.tie_word_embeddings and ernie.rope_theta == 500000.0
    olmo3 = {k: v for k, v in _hf_dict("olmo3").items() if k not in ("sliding_window", "rope_parameters",
                                                                      "layer_types")}
    olmo3 = ModelConfig.from_hf_dict(olmo3)
    assert olmo3.sliding_window == 4096 and olmo3.rope_theta == 500000.0 == olmo3.rope_local_theta
    assert olmo3.sliding_layers == [True, True, True, False]


@pytest.mark.parametrize("case", TP_CASES)
def test_tp2_matches_tp1(models, case, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")     # two ranks on two shared cores
    assert_tp2_matches_tp1(models[case], prompts(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_fp32_matches_hf(models, case):
    """On the GPU (Triton rotary and attention with per-layer windows and NoPE tables, OLMo's projection norms in
    torch before it, the o_proj bias after the skinny GEMM, OLMoE's grouped GEMMs, CUDA graphs): HF's greedy tokens,
    logprobs within 5e-3."""
    assert_gpu_fp32_matches_hf(models[case], prompts())
