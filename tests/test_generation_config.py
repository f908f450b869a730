"""The model's generation_config.json as sampling defaults (vLLM's --generation-config / --override-generation-config).

Oracles: the defaults by hand from the file written here; a request's or LLM.generate's outputs against LLM.generate
with the same fields given explicitly (seeded sampling: equal tokens only if every field took the same value)."""
import json
import shutil
import signal

import httpx
import pytest

from picovllm import LLM, SamplingParams
from picovllm.config import EngineConfig
from picovllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from picovllm.generation_config import sampling_defaults
from serving_fixtures import ServerProcess, chat_model  # noqa: F401 - a fixture

GEN = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9,
       "repetition_penalty": 1.3, "max_new_tokens": 9, "transformers_version": "5.0"}
DEFAULTS = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.3, "max_tokens": 9}


def folder_with(tmp_path, model, gen: dict | None) -> str:
    """A copy of model's folder whose generation_config.json is gen (none if None)."""
    path = tmp_path / "model"
    shutil.copytree(model, path)
    (path / "generation_config.json").unlink(missing_ok=True)
    if gen is not None:
        (path / "generation_config.json").write_text(json.dumps(gen))
    return str(path)


def test_defaults_by_hand(tmp_path, tiny_models):
    model = folder_with(tmp_path, tiny_models["llama"], GEN)
    assert sampling_defaults(model) == DEFAULTS                            # "auto": only the sampling keys
    assert sampling_defaults(model, "vllm") == {}
    assert sampling_defaults(model, "vllm", {"temperature": 0.5}) == {"temperature": 0.5}
    assert sampling_defaults(model, "auto", {"temperature": 0.5, "min_p": 0.1}) == \
        {**DEFAULTS, "temperature": 0.5, "min_p": 0.1}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "do_sample": False}))
    assert sampling_defaults(model, str(other)) == {"top_p": 0.5}          # a folder given by path instead
    assert sampling_defaults(None) == {} and sampling_defaults(str(tmp_path / "x.gguf")) == {}
    assert sampling_defaults(tiny_models["llama"]) == {}                   # save_pretrained's file: no sampling keys


@pytest.mark.parametrize("mode, override, gen, match", [
    ("auto", {"temprature": 0.5}, None, "'temprature' is not one of"),
    ("auto", {"top_p": 2}, None, "top_p must be in"),
    ("auto", None, {"temperature": -1}, "temperature must be a finite number >= 0"),
    ("auto", None, {"max_new_tokens": 0}, "max_tokens must be an int >= 1"),
    ("{folder}/nowhere", None, None, "has no generation_config.json"),
])
def test_a_bad_generation_config_is_refused_by_name(tmp_path, tiny_models, mode, override, gen, match):
    model = folder_with(tmp_path, tiny_models["llama"], gen)
    with pytest.raises(ValueError, match=match):
        sampling_defaults(model, mode.format(folder=tmp_path), override)


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", 3])
def test_a_bad_override_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="override_generation_config"):
        EngineConfig(override_generation_config=bad)


def test_a_request_takes_the_defaults_for_what_it_leaves_unset():
    p = CompletionRequest(prompt="x").sampling_params(16, None, DEFAULTS)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.min_p, p.max_tokens) == (0.7, 20, 0.9, 1.3, 0, 9)
    p = CompletionRequest(prompt="x", temperature=0, top_k=-1, top_p=1, repetition_penalty=1,
                          max_tokens=4).sampling_params(4, None, DEFAULTS)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.max_tokens) == (0, 0, 1, 1, 4)   # its own
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.sampling_params(None, None, DEFAULTS).max_tokens == 9          # unset: the config's cap
    assert chat.sampling_params(None, None, {}).max_tokens is None              # up to max_model_len
    assert chat.sampling_params(None, None).temperature == 1.0


def test_llm_generate_without_params_uses_the_models_defaults(tmp_path, tiny_models):
    """Greedy with a repetition penalty, so the tokens are comparable across engines without a seed."""
    gen = dict(GEN, temperature=0, max_new_tokens=40)
    defaults = dict(DEFAULTS, temperature=0, max_tokens=40)
    model = folder_with(tmp_path, tiny_models["llama"], gen)
    kw = dict(block_size=4, num_kv_blocks=64)
    prompts = [[5, 6, 7, 8], [40, 41]]
    llm = LLM(model, **kw)
    assert llm.get_default_sampling_params() == SamplingParams(**defaults)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]
    ref_llm = LLM(model, generation_config="vllm", **kw)
    assert ref_llm.get_default_sampling_params() == SamplingParams()
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, SamplingParams(**defaults), use_tqdm=False)]
    assert got == ref and all(len(t) == 40 or t[-1] == 2 for t in got)
    plain = ref_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != got      # the penalty changed what is sampled


def test_a_server_applies_the_models_generation_config(tmp_path, chat_model):
    """One server: the folder's generation_config.json with an override on top; requests that leave the fields unset
    sample with them, a request's own values win. Oracle: LLM.generate with the fields explicit, same seed."""
    model = folder_with(tmp_path, chat_model, GEN)
    engine = ["--block-size", "16", "--num-kv-blocks", "128", "--max-model-len", "256"]
    srv = ServerProcess(model, str(tmp_path / "server.log"), *engine,
                        "--override-generation-config", '{"top_p": 0.8}')
    try:
        llm = LLM(model, block_size=16, num_kv_blocks=128, max_model_len=256, generation_config="vllm")
        body = {"model": model, "prompt": "The capital of France is", "seed": 11}
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        ref = llm.generate(body["prompt"], SamplingParams(**dict(DEFAULTS, top_p=0.8, seed=11)),
                           use_tqdm=False)[0].outputs[0]
        assert got == ref.text and len(ref.token_ids) <= 9
        for asked, runs in ((6, 6), (12, 9)):     # a request's own max_tokens, capped by max_new_tokens (vLLM's)
            own = dict(body, temperature=0, max_tokens=asked, top_p=1, top_k=0, repetition_penalty=1, ignore_eos=True)
            got = httpx.post(srv.url + "/v1/completions", json=own, timeout=60).json()
            ref = llm.generate(body["prompt"], SamplingParams(temperature=0, max_tokens=runs, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
            assert got["choices"][0]["text"] == ref.text and got["usage"]["completion_tokens"] == runs
        assert "default sampling parameters from the model's generation config" in srv.log()
        pre = httpx.options(srv.url + "/v1/completions", headers={"origin": "http://app.example",
                                                                   "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in pre.headers       # no CORS unless --allowed-origins
    finally:
        assert srv.stop(signal.SIGTERM) == 0
