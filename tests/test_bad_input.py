"""Bad input: a ValueError whose message names the field or file, and nothing else changes: requests
already in flight in the same engine finish exactly as they would have without it."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from picovllm import LLM, BeamSearchParams, EngineConfig, SamplingParams
from test_parity_hf import make_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),     # was read as greedy
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=4, max_tokens=2), "min_tokens"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop=5), "stop"),                       # not iterable: named, not "'int' object is not iterable"
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(bad_words=3), "bad_words"),
    (dict(bad_words=["ok", "x\ud800"]), "bad_words"),
    (dict(stop=["ok", "\udfff"]), "stop"),           # a lone surrogate, which no output holds: it never matched    # a lone surrogate: the tokenizer's TypeError named nothing
    (dict(allowed_token_ids=7), "allowed_token_ids"),
    (dict(logprobs=-2), "logprobs"),              # -1 is vLLM's whole vocabulary
    (dict(n=0), "n"),
    (dict(n=True), "n"),
    (dict(seed=1.5), "seed"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias=[(5, 1.0)]), "logit_bias"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=0), "block_size"), (dict(dtype="int8"), "dtype"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"), (dict(max_model_len=0), "max_model_len"),
    (dict(num_kv_blocks=0), "num_kv_blocks"), (dict(attention_backend="cuda"), "attention_backend"),
])
def test_bad_engine_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"EngineConfig\.{field} "):
        EngineConfig(**kwargs)


# -- models that cannot load ---------------------------------------------------------------------
def broken_copy(src: str, dst: str, edit_config=None, edit_weights=None) -> str:
    shutil.copytree(src, dst)
    if edit_config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        edit_config(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    if edit_weights is not None:
        file = os.path.join(dst, "model.safetensors")
        weights = load_file(file)
        edit_weights(weights)
        save_file(weights, file)
    return dst


def _set(d, k, v):
    d[k] = v


BROKEN = {  # name -> (edit_config, edit_weights, message pattern)
    "unknown_arch": (lambda c: _set(c, "architectures", ["GPT2LMHeadModel"]), None,
                     r"architectures=\['GPT2LMHeadModel'\]: unsupported architecture"),
    "wrong_shape_q": (None, lambda w: _set(w, "model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 32)),
                      r"model\.layers\.0\.self_attn\.q_proj\.weight: shape mismatch"),
    "wrong_shape_norm": (None, lambda w: _set(w, "model.layers.1.input_layernorm.weight", torch.ones(65)),
                         r"model\.layers\.1\.input_layernorm\.weight: shape mismatch"),
    "wrong_shape_embed": (None, lambda w: _set(w, "model.embed_tokens.weight", torch.zeros(384, 63)),
                          r"model\.embed_tokens\.weight: shape mismatch"),
    "wrong_shape_down": (None, lambda w: _set(w, "model.layers.1.mlp.down_proj.weight", torch.zeros(64, 127)),
                         r"model\.layers\.1\.mlp\.down_proj\.weight: shape mismatch"),
    "missing_weight": (None, lambda w: w.pop("model.layers.1.mlp.down_proj.weight"),
                       r"missing weights: layers\.1\.mlp\.down_proj\.weight"),
    "missing_k": (None, lambda w: w.pop("model.layers.0.self_attn.k_proj.weight"),
                  r"missing weights: layers\.0\.self_attn\.qkv_proj\.weight#k"),
    "unknown_tensor": (None, lambda w: _set(w, "model.layers.0.mystery.weight", torch.zeros(3)),
                       r"'model\.layers\.0\.mystery\.weight' matches no parameter"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_is_named(tiny_models, tmp_path, case):
    edit_config, edit_weights, pattern = BROKEN[case]
    path = broken_copy(tiny_models["llama"], str(tmp_path / case), edit_config, edit_weights)
    with pytest.raises(ValueError, match=pattern):
        LLM(path, num_kv_blocks=8)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"model path '/no/such/model' does not exist"):
        LLM("/no/such/model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        LLM(str(empty))
    not_model = tmp_path / "notes.txt"
    not_model.write_text("hi")
    with pytest.raises(ValueError, match=r"neither a folder nor a \.gguf file"):
        LLM(str(not_model))


def test_folder_without_weights_is_named(tiny_models, tmp_path):
    path = broken_copy(tiny_models["llama"], str(tmp_path / "noweights"))
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        LLM(path)


# -- bad requests next to good ones --------------------------------------------------------------
def good_requests():
    prompts = make_prompts()[:6]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.2, top_k=20, seed=12, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, seed=13, max_tokens=8, ignore_eos=True)]
    return prompts, params


def summary(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


ENGINE = dict(max_model_len=128, block_size=8, max_num_batched_tokens=24, num_kv_blocks=40, max_num_seqs=4)


def test_bad_requests_leave_in_flight_requests_untouched(tiny_models):
    path = tiny_models["llama"]
    prompts, params = good_requests()
    clean = summary(LLM(path, **ENGINE).generate(prompts, params, use_tqdm=False))

    llm = LLM(path, **ENGINE)
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    for _ in range(4):                           # some prefilling, some decoding
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.scheduler.running and eng.scheduler.waiting

    mutated = SamplingParams(temperature=0.5)
    mutated.temperature = -1.0                   # validated again when the request is added
    bad = [
        (list(range(128)), SamplingParams(), r"128 tokens, longer than max_model_len"),
        (list(range(200)), SamplingParams(), r"max_model_len"),
        ([], SamplingParams(), r"prompt is empty"),
        ([3, 384], SamplingParams(), r"prompt token ids must be in \[0, 384\)"),
        ([3, -1], SamplingParams(), r"prompt token ids"),
        ("some text", SamplingParams(), r"prompt is text but the model has no tokenizer"),
        ([3.5, 2], SamplingParams(), r"prompt must be a string or a list of int token ids"),
        ([1, 2, 3], {"temperature": 0}, r"sampling_params must be a SamplingParams"),
        ([1, 2, 3], mutated, r"SamplingParams\.temperature"),
        ([1, 2, 3], SamplingParams(logprobs=385), r"SamplingParams\.logprobs .*384"),       # more than the vocab
        ([1, 2, 3], SamplingParams(stop_token_ids=[5, 384], min_tokens=2), r"SamplingParams\.stop_token_ids .*384"),
        ([1, 2, 3], SamplingParams(logit_bias={5: 1.0, 384: 2.0}), r"SamplingParams\.logit_bias .*384"),
        (list(range(100)), SamplingParams(max_tokens=300), None),   # fine: max_tokens is capped by max_model_len
    ]
    running, waiting = list(eng.scheduler.running), list(eng.scheduler.waiting)
    free, tracked = eng.block_manager.num_free_blocks, set(eng.requests)
    for prompt, sp, pattern in bad:
        if pattern is None:
            rid = eng.add_request(prompt, sp)
            assert eng.abort(rid).outputs[0].finish_reason == "abort"
            continue
        with pytest.raises(ValueError, match=pattern):
            eng.add_request(prompt, sp)
            pytest.fail(f"accepted: {str(prompt)[:40]} {sp}")
    with pytest.raises(ValueError, match=r"request_id '0' is already in use"):
        eng.add_request([1, 2], SamplingParams(), request_id=ids[0])
    assert eng.scheduler.running == running and list(eng.scheduler.waiting) == waiting
    assert eng.block_manager.num_free_blocks == free and set(eng.requests) == tracked

    while eng.has_unfinished_requests():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert summary([final[i] for i in ids]) == clean


def test_kv_cache_too_small_for_one_request_is_named(tiny_models):
    llm = LLM(tiny_models["llama"], block_size=8, num_kv_blocks=4)      # 32 tokens
    with pytest.raises(ValueError, match=r"exceed the KV cache \(32 tokens\)"):
        llm.generate([list(range(30))], SamplingParams(max_tokens=5), use_tqdm=False)


def test_bad_prompt_in_a_batch_rejects_the_batch_cleanly(tiny_models):
    path = tiny_models["llama"]
    prompts, params = good_requests()
    llm = LLM(path, **ENGINE)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(prompts[:3] + [[]] + prompts[3:], params[:3] + [SamplingParams()] + params[3:], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    with pytest.raises(ValueError, match=r"sampling_params has 2 entries for 6 prompts"):
        llm.generate(prompts, params[:2], use_tqdm=False)
    assert summary(llm.generate(prompts, params, use_tqdm=False)) == \
        summary(LLM(path, **ENGINE).generate(prompts, params, use_tqdm=False))


def test_prompt_dicts_and_lengths_the_engine_cannot_honour_are_named(tiny_models, caplog):
    """A prompt dict's keys beyond prompt / prompt_token_ids / cache_salt (vLLM's multi_modal_data, prompt_embeds) are
    refused by name, not dropped, and so is a cache_salt that beam search would not use; a max_model_len past the
    model's context is cut with a warning, not silently."""
    llm = LLM(tiny_models["llama"], num_kv_blocks=32)
    sp = SamplingParams(max_tokens=2)
    for prompt, says in (({"prompt": "hi", "multi_modal_data": {"image": None}}, "'multi_modal_data'"),
                         ({"prompt_embeds": [[0.0]]}, "'prompt_embeds'"),
                         ({}, "needs \"prompt\"")):
        with pytest.raises(ValueError, match=f"prompt: .*{says}"):
            llm.generate([[5, 6, 7], prompt], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt: .*'cache_salt'.*beam search"):
        llm.beam_search([{"prompt_token_ids": [1, 2], "cache_salt": "x"}], BeamSearchParams(beam_width=2, max_tokens=2))
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp, use_tqdm=False)
    assert out[0].prompt_token_ids == [5, 6, 7]
    with caplog.at_level("WARNING", logger="picovllm.engine.llm_engine"):
        assert LLM(tiny_models["llama"], num_kv_blocks=32, max_model_len=513).engine.max_model_len == 512
    assert "max_model_len 513 is longer than the model's context, 512" in caplog.text      # cut, and said


def test_max_model_len_auto_fits_the_kv_cache(tiny_models):
    """max_model_len -1 (vLLM's -1 or auto, the CLI's too): the model's context where the KV cache holds it (512
    tokens, 64 blocks of 16), else what the cache holds (20 blocks: 320), and a longer prompt is refused naming it."""
    from picovllm.entrypoints.engine_args import model_len_arg
    assert model_len_arg("auto") == model_len_arg("-1") == -1 and model_len_arg("2k") == 2000
    assert LLM(tiny_models["llama"], num_kv_blocks=64, max_model_len=-1).engine.max_model_len == 512
    llm = LLM(tiny_models["llama"], num_kv_blocks=20, max_model_len=-1)
    assert llm.engine.max_model_len == 320
    with pytest.raises(ValueError, match="max_model_len - 1 = 319"):
        llm.generate([[5] * 321], SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate([[5] * 300], SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 20 and out.outputs[0].finish_reason == "length"   # stops at 320
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_models["llama"], num_kv_blocks=20, max_model_len=-2)


def test_empty_text_prompt_on_the_default_model(default_llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        default_llm.generate([""], SamplingParams(max_tokens=2), use_tqdm=False)


def test_text_that_is_not_unicode_is_named(default_llm):
    """A lone surrogate (JSON's "\\ud800" escape) is no text a tokenizer encodes: a ValueError naming the prompt (or
    the messages), not the tokenizer's TypeError; a request already running finishes as it would have."""
    engine, params = default_llm.engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = default_llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    rid = engine.add_request("The capital of France is", params)
    for bad, field in ((lambda: default_llm.generate(["hi \ud800"], params, use_tqdm=False), "prompt"),
                       (lambda: default_llm.generate([{"prompt": "\udfff"}], params, use_tqdm=False), "prompt"),
                       (lambda: default_llm.chat([{"role": "user", "content": "hi \ud800"}], params, use_tqdm=False),
                        "messages")):
        with pytest.raises(ValueError, match=rf"^{field}: cannot be tokenized \(it holds a lone surrogate"):
            bad()
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == rid and o.finished), final)
    assert (final.outputs[0].text, final.outputs[0].token_ids) == (alone.text, alone.token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
