"""Mistral, Phi-3 (partial rotary too, as Phi-4-mini's), YaRN rope scaling, Granite, SmolLM3, OLMo 2, Cohere and Cohere 2 from HF
folders: greedy tokens and logprobs against HF transformers on the same
tiny random weights (fp32, CPU), with and without a sliding window shorter than the longer prompts, and TP=2 against
TP=1.

Phi-3 checkpoints store q/k/v and gate/up fused (loader/weights.py splits them for the shard loaders).
"""
import os
import random

import pytest
import torch

from picovllm import LLM, SamplingParams
from test_parity_hf import LOGPROB_ATOL, assert_tp2_matches_tp1, hf_greedy

BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
CASES = {
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral_window": ("MistralConfig", {"sliding_window": 20}),
    "phi3": ("Phi3Config", {"sliding_window": None}),
    "phi3_window": ("Phi3Config", {"sliding_window": 20, "num_key_value_heads": 6}),
    # every scaling away from 1 (and the scores' from head_dim ** -0.5)
    "granite": ("GraniteConfig", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "initializer_range": 0.2,
                                  "attention_multiplier": 0.6, "logits_scaling": 2.5}),
    # NoPE on every other layer (SmolLM3-3B: every fourth)
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2, "initializer_range": 0.2}),
    # norms after attention and the MLP, q and k normed over the whole projection; one KV head (under TP=2 it is
    # replicated, and its norm's sum must count it once)
    "olmo2": ("Olmo2Config", {"initializer_range": 0.2}),
    "olmo2_mqa": ("Olmo2Config", {"initializer_range": 0.2, "num_key_value_heads": 1}),
    # a parallel block (one LayerNorm, attention + MLP), interleaved rotary pairs, a logit scale; Cohere 2 slides 3
    # layers of 4 (window 6, under the longer prompts) and rotates only those
    "cohere": ("CohereConfig", {"initializer_range": 0.2, "logit_scale": 0.5}),
    "cohere2": ("Cohere2Config", {"initializer_range": 0.2, "logit_scale": 0.5, "num_hidden_layers": 4,
                                  "sliding_window": 6}),
    # partial rotary: 12 of head_dim 16 rotate (Phi-4-mini: 96 of 128)
    "phi3_partial": ("Phi3Config", {"sliding_window": None, "num_attention_heads": 4, "partial_rotary_factor": 0.75,
                                    "initializer_range": 0.2}),
}
# LongRoPE as Phi-3-mini-128k has it, on a 32-token original context (head_dim 64 / 6 heads: 5 frequencies)
LONGROPE = {"sliding_window": None, "original_max_position_embeddings": 32, "num_attention_heads": 4,
            "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(8)],
                             "long_factor": [3.0 + 1.1 * i for i in range(8)]}}


# Phi-4-mini's rope: LongRoPE over a partial rotary (6 factors for the 12 rotated dims of 16)
PARTIAL_LONGROPE = {**LONGROPE, "partial_rotary_factor": 0.75, "initializer_range": 0.2,
                    "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(6)],
                                     "long_factor": [3.0 + 1.1 * i for i in range(6)]}}
LONGROPE_CASES = {"phi3_longrope": LONGROPE, "phi4_longrope_partial": PARTIAL_LONGROPE}


def build(path: str, case: str) -> str:
    import transformers

    cls, extra = CASES[case] if case in CASES else ("Phi3Config", LONGROPE_CASES[case])
    cfg = getattr(transformers, cls)(**{**BASE, **extra})
    torch.manual_seed(len(cls))    # one family's cases share their weights (mistral and mistral_window)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():     # HF starts norms at 1: make each one matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {case: build(str(root / case), case) for case in CASES}


def edited(src: str, dst: str, drop: tuple[str, ...] = (), **fields) -> str:
    """A copy of the model folder src at dst, its config.json with `fields` set and `drop` removed."""
    import json
    import shutil
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
    return [[rng.randrange(384) for _ in range(n)] for n in (1, 7, 16, 33)]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_logprobs_match_hf(models, case):
    ps = prompts()
    ref, ref_lp = hf_greedy(models[case], ps, 12)
    llm = LLM(models[case], block_size=16, num_kv_blocks=64, device="cpu")
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        ours = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert ours == pytest.approx(lp, abs=LOGPROB_ATOL)


def test_the_window_slides(models):
    """Same weights, window or not: the outputs differ (so the parity above tests the window), and a request far
    longer than the window runs."""
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    ps = prompts()[3:]
    windowed = LLM(models["mistral_window"], num_kv_blocks=64, device="cpu")
    full = LLM(models["mistral"], num_kv_blocks=64, device="cpu")
    assert windowed.engine.max_model_len == 512
    lp = [[o.outputs[0].logprobs for o in llm.generate(ps, sp, use_tqdm=False)] for llm in (windowed, full)]
    assert lp[0] != lp[1]
    out = windowed.generate([list(range(300))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("case", list(LONGROPE_CASES))
def test_longrope_matches_hf_within_and_past_the_original_context(tmp_path, case):
    """Phi-3's LongRoPE on a 32-token original context: a request that stays within it uses the short factors, one
    whose prompt is longer the long ones at every position (as HF, which rotates a sequence past the original length
    with the long factors throughout); cos and sin scaled by sqrt(1 + ln(512 / 32) / ln(32)). Also over a partial
    rotary, as Phi-4-mini's (the passed dims not scaled)."""
    path = build(str(tmp_path / "longrope"), case)
    rng = random.Random(3)
    llm = LLM(path, block_size=16, num_kv_blocks=64, device="cpu")
    assert llm.engine.model_config.rope_scaling["rope_type"] == "longrope"
    for lens, new in [((1, 9, 20), 12), ((33, 40), 6)]:     # totals 13, 21, 32 (within); prompts past it
        ps = [[rng.randrange(384) for _ in range(n)] for n in lens]
        ref, ref_lp = hf_greedy(path, ps, new)
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        for o, lp in zip(outs, ref_lp):
            assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
                pytest.approx(lp, abs=LOGPROB_ATOL)
    # the same tokens as a long request and as a short one: their keys differ, so the prefix cache keeps them apart
    p = [rng.randrange(384) for _ in range(20)]
    short = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0), use_tqdm=False)
    long = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0), use_tqdm=False)
    again = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert long[0].num_cached_tokens == 0 and again[0].num_cached_tokens == 16      # short hits short's blocks
    assert short[0].outputs[0].logprobs != long[0].outputs[0].logprobs[:4]


def test_phi3_yarn_is_longrope_as_hf_reads_it(tmp_path):
    """A Phi-3 config.json whose rope_scaling says "yarn" (an older Phi-3 name) with short and long factors: HF's
    Phi3Config reads it as LongRoPE; so does the engine (it was YaRN, other rotary tables, other tokens)."""
    import json
    import transformers
    path = build(str(tmp_path / "longrope"), "phi3_longrope")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    rope_field = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    cfg[rope_field]["rope_type"] = "yarn"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert transformers.AutoConfig.from_pretrained(path).rope_parameters["rope_type"] == "longrope"
    llm = LLM(path, block_size=16, num_kv_blocks=64, device="cpu")
    assert llm.engine.model_config.rope_scaling["rope_type"] == "longrope"
    rng = random.Random(5)
    ps = [[rng.randrange(384) for _ in range(n)] for n in (9, 40)]    # within the 32-token original context, past it
    ref, _ = hf_greedy(path, ps, 8)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_longrope_prompt_logprobs_of_a_long_request_match_hf(tmp_path):
    """A request past LongRoPE's original context rotates its keys at offset positions (the long factors' table):
    its prompt logprobs are still matched to prompt tokens by index, not by the rotary's position."""
    from test_prompt_logprobs import TOPK, check, hf_prompt_logprobs
    path = build(str(tmp_path / "longrope"), "phi3_longrope")
    rng = random.Random(4)
    ps = [[rng.randrange(384) for _ in range(n)] for n in (33, 40)]     # past the original 32 (HF: long factors)
    llm = LLM(path, block_size=8, max_num_batched_tokens=16, num_kv_blocks=64, device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOPK)
    check(llm.generate(ps, sp, use_tqdm=False), hf_prompt_logprobs(path, ps))


# YaRN on a 32-token original context, factor 4: Qwen3's form (the context grows to 128 past the config's 64, as
# vLLM stretches it), DeepSeek's (mscale over mscale_all_dim; its own betas, no truncation) and a given factor
YARN = {
    "qwen3_yarn": ("Qwen3Config", {"max_position_embeddings": 64, "head_dim": 32, "num_attention_heads": 4,
                                   "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                       "original_max_position_embeddings": 32}}),
    "llama_yarn_mscale": ("LlamaConfig", {"num_attention_heads": 4, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 500.0,
        "mscale": 2.0, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False}}),
    "llama_yarn_attention_factor": ("LlamaConfig", {"num_attention_heads": 4, "rope_parameters": {
        "rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
        "attention_factor": 1.3}}),
}


@pytest.mark.parametrize("case", list(YARN))
def test_yarn_matches_hf_within_and_past_the_original_context(tmp_path, case):
    """Greedy tokens and logprobs against HF, prompts within the 32-token original context and past it (to 102
    positions); the same weights without the scaling answer otherwise, so the parity is YaRN's."""
    import transformers
    cls, extra = YARN[case]
    cfg = getattr(transformers, cls)(**{**BASE, "initializer_range": 0.2, **extra})
    torch.manual_seed(11)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(tmp_path / "yarn"))
    path = str(tmp_path / "yarn")
    llm = LLM(path, block_size=16, num_kv_blocks=64, device="cpu")
    assert llm.engine.max_model_len == (128 if case == "qwen3_yarn" else 512)
    rng = random.Random(4)
    ps = [[rng.randrange(384) for _ in range(n)] for n in (5, 20, 45, 90)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    ref, ref_lp = hf_greedy(path, ps, 12)
    outs = llm.generate(ps, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            pytest.approx(lp, abs=LOGPROB_ATOL)
    plain = LLM(edited(path, str(tmp_path / "plain"), drop=("rope_parameters", "rope_scaling"),
                       max_position_embeddings=512), num_kv_blocks=64, device="cpu")
    assert [o.outputs[0].logprobs for o in plain.generate(ps, sp, use_tqdm=False)] != \
        [o.outputs[0].logprobs for o in outs]


def test_hf_overrides_set_config_fields(tmp_path):
    """vLLM's --hf-overrides: YaRN switched on for a model whose config.json lacks it (Qwen's long-context recipe)
    runs as the model whose config.json has it (the oracle: that folder, itself checked against HF above); the flag
    parses from the command line; bad JSON, a non-object and a GGUF file are refused naming the field."""
    import argparse
    import json

    from picovllm.entrypoints.engine_args import engine_config_from_args
    from picovllm.entrypoints.openai import cli_serve
    import transformers
    cls, extra = YARN["qwen3_yarn"]
    cfg = getattr(transformers, cls)(**{**BASE, "initializer_range": 0.2, **extra})
    torch.manual_seed(11)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(tmp_path / "yarn"))
    rope = json.load(open(tmp_path / "yarn" / "config.json"))["rope_parameters"]
    plain = edited(str(tmp_path / "yarn"), str(tmp_path / "plain"), drop=("rope_parameters", "rope_scaling"))
    parser = argparse.ArgumentParser()
    cli_serve.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", plain, "--hf-overrides", json.dumps({"rope_parameters": rope}),
                              "--device", "cpu", "--num-kv-blocks", "64"])
    config = engine_config_from_args(args, model=args.model or args.model_tag)
    assert config.hf_overrides == {"rope_parameters": rope}
    rng = random.Random(9)
    ps = [[rng.randrange(384) for _ in range(n)] for n in (20, 90)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    got = LLM(plain, num_kv_blocks=64, device="cpu", hf_overrides=json.dumps({"rope_parameters": rope}))
    want = LLM(str(tmp_path / "yarn"), num_kv_blocks=64, device="cpu")
    assert got.engine.max_model_len == want.engine.max_model_len == 128
    assert [o.outputs[0].logprobs for o in got.generate(ps, sp, use_tqdm=False)] == \
        [o.outputs[0].logprobs for o in want.generate(ps, sp, use_tqdm=False)]
    # the README's form, rope_scaling, on a config.json as transformers 5 writes it (rope_parameters, "default"):
    # the same YaRN, as transformers applies it (AutoConfig with the same override the oracle)
    v5 = edited(plain, str(tmp_path / "v5"), rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    hf = transformers.AutoConfig.from_pretrained(v5, rope_scaling=dict(scaling)).rope_parameters    # it edits it
    assert (hf["rope_type"], hf["factor"]) == (rope["rope_type"], rope["factor"])
    got = LLM(v5, num_kv_blocks=64, device="cpu", hf_overrides={"rope_scaling": scaling})
    assert got.engine.max_model_len == 128
    assert [o.outputs[0].logprobs for o in got.generate(ps, sp, use_tqdm=False)] == \
        [o.outputs[0].logprobs for o in want.generate(ps, sp, use_tqdm=False)]
    with pytest.raises(ValueError, match="EngineConfig.hf_overrides is not valid JSON"):
        LLM(plain, device="cpu", hf_overrides="{rope")
    with pytest.raises(ValueError, match="EngineConfig.hf_overrides must be a JSON object"):
        LLM(plain, device="cpu", hf_overrides="[1]")
    with pytest.raises(ValueError, match="hf_overrides: they set config.json fields of an HF folder"):
        LLM("random:tiny-qwen3", device="cpu", hf_overrides={"rope_theta": 5.0})
    # the JSON text as a command's flag leaves it (generate's disaggregated path opens the model from its flags)
    from picovllm.loader.source import open_model_source
    src = open_model_source(plain, hf_overrides=json.dumps({"rope_parameters": rope}), weights_needed=False)
    assert src.config.rope_scaling["rope_type"] == "yarn"


def test_blocks_behind_the_window_are_given_back(models):
    """Every layer slides (window 20): blocks wholly behind the window go back to the pool as the request goes, so
    a 300-token prompt and 40 more tokens run in 16 blocks of 4 (85 without), token for token HF's."""
    from picovllm.engine.block_manager import SLID_OUT
    rng = random.Random(5)
    p = [rng.randrange(384) for _ in range(300)]
    ref, _ = hf_greedy(models["mistral_window"], [p], 40)
    llm = LLM(models["mistral_window"], block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, device="cpu")
    eng, peak = llm.engine, []
    stack, runs = eng.runner.cpu_decode, []         # decode steps go through the one-call C stack, window and all
    assert stack is not None
    real_run = stack.run
    stack.run = lambda *a: (runs.append(1), real_run(*a))[1]
    real = eng.block_manager.free_slid_out

    def watch(req, window):
        out = real(req, window)
        peak.append(eng.block_manager.num_blocks - eng.block_manager.num_free_blocks)
        assert req.block_table[:req.num_slid_out_blocks] == [SLID_OUT] * req.num_slid_out_blocks
        return out
    eng.block_manager.free_slid_out = watch
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[0]
    assert max(peak) <= 16 and len(peak) > 20 and len(runs) >= 39
    full = LLM(models["mistral"], block_size=4, num_kv_blocks=16, device="cpu")   # no window: refused, as before
    with pytest.raises(ValueError, match="exceed the KV cache"):
        full.generate([p], SamplingParams(max_tokens=40), use_tqdm=False)


def test_partial_rotary_in_rotary_order_and_odd_ones_refused(models, tmp_path):
    """Partial rotary runs as a full rotation of reordered q and k: the table turns 6 of the 8 pairs and leaves 2 (cos
    1, sin 0); q's rows are the checkpoint's in rotary_order within each head. A rotary part of odd width is refused
    naming the field."""
    import os

    from safetensors.torch import load_file

    from picovllm.layers.rotary import rotary_order
    llm = LLM(models["phi3_partial"], num_kv_blocks=64, device="cpu", quantization="none")
    assert llm.engine.model_config.rotary_dim == 12
    attn = llm.engine.runner.model.layers[0].self_attn
    cos, sin = attn.rotary.cos_sin[5].chunk(2)
    assert (cos[6:] == 1).all() and (sin[6:] == 0).all() and (sin[:6] != 0).all()
    assert rotary_order(16, 12) == [0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15]
    fused = load_file(os.path.join(models["phi3_partial"], "model.safetensors"))["model.layers.0.self_attn.qkv_proj.weight"]
    q = attn.qkv_proj.weight[:64]
    assert torch.equal(q.view(4, 16, -1), fused[:64].view(4, 16, -1)[:, rotary_order(16, 12)])
    odd = edited(models["phi3_partial"], str(tmp_path / "odd"), partial_rotary_factor=0.5625)    # 9 of 16
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        LLM(odd, device="cpu")
    # another family's config with the field: HF rotates every dim there, so it is refused, not half-honoured
    mistral = edited(models["mistral"], str(tmp_path / "mistral"), partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="only Phi-3's"):
        LLM(mistral, device="cpu")


def test_nope_layers_and_granite_scalings_matter(models, tmp_path):
    """What the parity above rests on: SmolLM3's second layer has no rotation (the first has one), Granite's four
    scalings are read, and each changes the output: the same weights with the field at its neutral value give other
    prompt logprobs."""
    smol = LLM(models["smollm3"], num_kv_blocks=64, device="cpu")
    assert smol.engine.model_config.rope_layers == [True, False]
    cos_sin = [layer.self_attn.rotary.cos_sin for layer in smol.engine.runner.model.layers]
    assert (cos_sin[1][:, :5] == 1).all() and (cos_sin[1][:, 5:] == 0).all() and not (cos_sin[0][1:, :5] == 1).all()
    assert cos_sin[1].shape == cos_sin[0].shape and cos_sin[1].dtype == torch.float32   # as long as the other table
    cfg = LLM(models["granite"], num_kv_blocks=64, device="cpu").engine.model_config
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) == \
        (3.0, 0.5, 0.6, 2.5)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def logprobs(path):
        out = LLM(path, num_kv_blocks=64, device="cpu").generate([prompts()[2]], sp, use_tqdm=False)[0]
        return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    # no layer_types to say which layers slide: refused
    windowed = edited(models["smollm3"], str(tmp_path / "smollm3-window"), drop=("layer_types",),
                      use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="use_sliding_window without layer_types"):
        LLM(windowed, device="cpu")
    for case, field, neutral in [("smollm3", "no_rope_layers", [1, 1]), ("granite", "embedding_multiplier", 1.0),
                                 ("granite", "residual_multiplier", 1.0), ("granite", "attention_multiplier", 10 ** -0.5),
                                 ("granite", "logits_scaling", 1.0)]:
        other = edited(models[case], str(tmp_path / f"{case}-{field}"), **{field: neutral})
        assert logprobs(other) != pytest.approx(logprobs(models[case]), abs=1e-3), field


def test_cohere2_without_layer_types_takes_its_pattern(models, tmp_path):
    """A Cohere 2 config as released before layer_types (sliding_window_pattern 4, transformers' default): every 4th
    layer global and NoPE, as HF reads it (tokens and logprobs against HF on the edited config)."""
    path = edited(models["cohere2"], str(tmp_path / "cohere2"), drop=("layer_types",), sliding_window_pattern=4)
    llm = LLM(path, block_size=16, num_kv_blocks=64, device="cpu")
    assert llm.engine.model_config.rope_layers == [True, True, True, False]
    assert llm.engine.model_config.sliding_layers == [True, True, True, False]
    ps = prompts()
    ref, ref_lp = hf_greedy(path, ps, 8)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o, lp in zip(outs, ref_lp):
        assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            pytest.approx(lp, abs=LOGPROB_ATOL)


@pytest.mark.parametrize("case", ["mistral", "phi3", "granite", "smollm3", "phi3_partial", "olmo2", "olmo2_mqa",
                                  "cohere2"])
def test_tp2_matches_tp1(models, case, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")     # two ranks on two shared cores
    assert_tp2_matches_tp1(models[case], prompts(1), 10)


def test_fields_a_config_leaves_out_take_the_architectures_defaults():
    """A config.json with only the shape: each supported architecture reads rope_theta, rms_norm_eps,
    tie_word_embeddings and the activation as its transformers config class defaults them (the oracle: that class,
    as vLLM and HF read config.json through it), not generic ones (Mixtral's theta 1e6, Gemma's GeGLU, ...)."""
    import transformers
    from picovllm.config import ModelConfig
    from picovllm.hf_config import SUPPORTED_ARCHITECTURES
    from picovllm.loader.hf_folder import _with_class_defaults
    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
                 num_experts_per_tok=2)
    wrong = {}
    for arch in SUPPORTED_ARCHITECTURES:
        name = arch.replace("ForCausalLM", "")
        hf = (getattr(transformers, name + "TextConfig", None) or getattr(transformers, name + "Config"))(**shape)
        hf = hf.to_dict()
        rope = hf.get("rope_parameters") or {}
        rope = rope.get("full_attention", rope)
        want = dict(rope_theta=rope.get("rope_theta", hf.get("rope_theta")),
                    rms_norm_eps=hf.get("rms_norm_eps", hf.get("layer_norm_eps")),
                    tie_word_embeddings=hf.get("tie_word_embeddings"),
                    hidden_act=hf.get("hidden_activation") or hf.get("hidden_act"))
        got = ModelConfig.from_hf_dict(_with_class_defaults({"architectures": [arch], **shape}))
        wrong.update({(arch, k): (getattr(got, k), v) for k, v in want.items()
                      if v is not None and getattr(got, k) != v})
    assert not wrong
