"""A model given as a Hugging Face Hub repository id (as vLLM takes one): "org/name" or "org/name/file.gguf", found
in the Hub's cache. No network here: the cache is laid out as huggingface_hub lays it out (refs/main naming a
snapshot folder) and the Hub is offline (HF_HUB_OFFLINE), so the lookup is huggingface_hub's own, as on a machine
that fetched the repository before. The oracle: the same model given as its local path."""
import os
import shutil

import pytest

from picovllm import LLM, SamplingParams
from picovllm.loader.source import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hub cache at tmp_path; returns a function that puts a folder's files in it as repo `repo_id`."""
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolve_model.cache_clear()

    def put(repo_id: str, files: dict[str, str], ref: str = "main", commit: str = COMMIT, cache=tmp_path) -> str:
        """cache: the Hub cache folder (another one: a --download-dir)."""
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        for name, src in files.items():
            shutil.copy(src, snap / name)
        return str(snap)
    yield put
    resolve_model.cache_clear()


def test_a_repository_id_runs_the_cached_snapshot(tiny_models, hub_cache):
    src = tiny_models["llama"]
    files = {f: os.path.join(src, f) for f in os.listdir(src)}
    gen = os.path.join(os.path.dirname(src), "generation_config.json")
    with open(gen, "w") as f:
        f.write('{"temperature": 0.3, "top_k": 7}')
    snap = hub_cache("tiny-org/tiny-llama", {**files, "generation_config.json": gen})
    assert resolve_model("tiny-org/tiny-llama") == snap
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [40, 41]]
    hub = LLM("tiny-org/tiny-llama", num_kv_blocks=32, device="cpu")
    local = LLM(src, num_kv_blocks=32, device="cpu")
    assert [o.outputs[0].token_ids for o in hub.generate(prompts, sp, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in local.generate(prompts, sp, use_tqdm=False)]
    defaults = hub.get_default_sampling_params()          # the repository's generation_config.json
    assert (defaults.temperature, defaults.top_k) == (0.3, 7)


def test_a_gguf_file_in_a_repository(tmp_path, hub_cache):
    from test_gguf import write_tiny_gguf
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, "Q8_0")
    hub_cache("tiny-org/tiny-gguf", {"tiny-q8_0.gguf": path})
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    hub = LLM("tiny-org/tiny-gguf/tiny-q8_0.gguf", num_kv_blocks=32, device="cpu")
    local = LLM(path, num_kv_blocks=32, device="cpu")
    assert hub.generate([[1, 2, 3]], sp, use_tqdm=False)[0].outputs[0].token_ids == \
        local.generate([[1, 2, 3]], sp, use_tqdm=False)[0].outputs[0].token_ids


def test_what_cannot_be_found_names_the_model(hub_cache):
    with pytest.raises(ValueError, match="'nobody/nothing' is no local path, and fetching it from the Hugging Face "
                                         "Hub failed"):
        LLM("nobody/nothing", device="cpu")
    with pytest.raises(ValueError, match="'./missing' does not exist"):
        LLM("./missing", device="cpu")
    with pytest.raises(ValueError, match="'a/b/c' does not exist"):       # neither a path nor a repository id
        LLM("a/b/c", device="cpu")


def test_a_vllm_serve_command_line_parses(tiny_models, hub_cache):
    """`vllm serve org/name --trust-remote-code --max-model-len N` as picovllm's serve reads it: the repository id
    positional, vLLM's trust flag accepted (picovllm runs no checkpoint code), the engine built from it."""
    import argparse

    from picovllm.entrypoints.engine_args import engine_config_from_args
    from picovllm.entrypoints.openai import cli_serve
    from picovllm.engine.llm_engine import Engine
    src = tiny_models["qwen3"]
    hub_cache("tiny-org/tiny-qwen3", {f: os.path.join(src, f) for f in os.listdir(src)})
    parser = argparse.ArgumentParser()
    cli_serve.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "tiny-org/tiny-qwen3", "--trust-remote-code", "--max-model-len", "128",
                              "--num-kv-blocks", "16", "--device", "cpu"])
    config = engine_config_from_args(args, model=args.model or args.model_tag)
    assert config.trust_remote_code and config.model == "tiny-org/tiny-qwen3"
    engine = Engine(config)
    assert engine.max_model_len == 128 and engine.model_config.architecture == "Qwen3ForCausalLM"
    engine.shutdown()


def test_a_front_end_fetches_no_weights(tiny_models, hub_cache):
    """The proxy's and the router's model (weights_needed=False): its config and tokenizer, no safetensors asked for;
    a repository that cannot be found stops the generation defaults by name instead of dropping them."""
    from picovllm.generation_config import sampling_defaults
    from picovllm.loader.source import open_model_source
    src = tiny_models["llama"]
    hub_cache("tiny-org/no-weights", {f: os.path.join(src, f) for f in os.listdir(src) if f.endswith(".json")})
    source = open_model_source("tiny-org/no-weights", weights_needed=False)
    assert source.config.vocab_size == 384
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        open_model_source("tiny-org/no-weights")
    with pytest.raises(ValueError, match="'nobody/nothing' is no local path"):
        sampling_defaults("nobody/nothing")



def test_a_revision_and_a_download_dir(tiny_models, hub_cache, tmp_path):
    """vLLM's --revision (a branch, tag or commit of the repository) and --download-dir (a Hub cache of its own):
    the repository's main and a tag hold two different models; each revision runs its own, as its local folder
    does (the oracle), in the default cache and in another folder."""
    llama, qwen3 = tiny_models["llama"], tiny_models["qwen3"]
    other = "fedcba9876543210fedcba9876543210fedcba98"
    hub_cache("tiny-org/two", {f: os.path.join(llama, f) for f in os.listdir(llama)})
    tag = hub_cache("tiny-org/two", {f: os.path.join(qwen3, f) for f in os.listdir(qwen3)}, ref="v2", commit=other)
    own = tmp_path / "downloads"
    hub_cache("tiny-org/elsewhere", {f: os.path.join(qwen3, f) for f in os.listdir(qwen3)}, cache=own)
    assert resolve_model("tiny-org/two", revision="v2") == tag
    assert resolve_model("tiny-org/two", revision=other) == tag           # a commit, as the tag names it
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [40, 41]]

    def tokens(model, **kw):
        llm = LLM(model, num_kv_blocks=32, device="cpu", **kw)
        arch = llm.engine.model_config.architecture
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        llm.shutdown()
        return arch, out
    assert tokens("tiny-org/two") == tokens(llama)
    assert tokens("tiny-org/two", revision="v2") == tokens(qwen3)
    assert tokens("tiny-org/two", revision="v2")[0] == "Qwen3ForCausalLM"
    assert tokens("tiny-org/elsewhere", download_dir=str(own)) == tokens(qwen3)
    with pytest.raises(ValueError, match="'tiny-org/elsewhere' is no local path"):     # not in the default cache
        LLM("tiny-org/elsewhere", device="cpu")
    with pytest.raises(ValueError, match="fetching it at revision 'v3' from the Hugging Face Hub failed"):
        LLM("tiny-org/two", revision="v3", device="cpu")
    # where there is no repository, both are refused, not ignored (a local path, a random model, the default one)
    for model, kw in [(llama, {"revision": "v2"}), (llama, {"download_dir": str(own)}),
                      ("random:tiny-qwen3", {"revision": "v2"}), (None, {"download_dir": str(own)})]:
        field = next(iter(kw))
        with pytest.raises(ValueError, match=f"{field} .* applies to a Hugging Face Hub repository id; .* is not one"):
            LLM(model, device="cpu", **kw)


def test_revision_flags_reach_the_engine_and_the_models_card(tiny_models, hub_cache):
    """`serve org/name --revision R --download-dir D` parses as vLLM's; the server's /v1/models card names the
    revision, so a proxy or router in front reads the tokenizer at the same one."""
    import argparse

    from picovllm.entrypoints.engine_args import engine_config_from_args
    from picovllm.entrypoints.openai import cli_serve
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.engine.llm_engine import Engine
    src = tiny_models["qwen3"]
    hub_cache("tiny-org/tagged", {f: os.path.join(src, f) for f in os.listdir(src)}, ref="v1")
    parser = argparse.ArgumentParser()
    cli_serve.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "tiny-org/tagged", "--revision", "v1", "--num-kv-blocks", "16",
                              "--device", "cpu"])
    config = engine_config_from_args(args, model=args.model or args.model_tag)
    assert (config.revision, config.download_dir) == ("v1", None)
    engine = Engine(config)
    try:
        card = AsyncEngine(engine).model_info()
        assert (card["root"], card["revision"]) == ("tiny-org/tagged", "v1")
    finally:
        engine.shutdown()


def test_both_pd_sides_run_one_model():
    """A DisaggLLM's per-side settings may not give P and D another revision, cache or config: D reads the KV P
    computed, which only the same model makes right (the KV handshake compares shapes, not weights)."""
    from picovllm.disagg.driver import _side_configs
    for field, value in (("revision", "v2"), ("hf_overrides", {"rope_theta": 5.0}), ("download_dir", "/tmp/x"),
                         ("model", "other")):
        with pytest.raises(ValueError, match=f"decode\\['{field}'\\]: both sides run one model"):
            _side_configs("m", {}, "cpu", "cpu", {}, {field: value})


def test_a_router_reads_its_model_at_a_revision_in_a_download_dir(tiny_models, hub_cache, tmp_path, monkeypatch):
    """`picovllm router --model org/name --revision R --download-dir D` (no instance yet: the router tokenizes with
    its --model): the tokenizer and generation defaults are read at that revision, from that folder (the repository
    is in no other cache), up to the built app."""
    import argparse

    from picovllm.disagg import router_server
    from picovllm.entrypoints.openai import api_server, cli_router
    import picovllm.loader.source as source
    src, own = tiny_models["qwen3"], tmp_path / "downloads"
    hub_cache("tiny-org/tagged", {f: os.path.join(src, f) for f in os.listdir(src)}, ref="v1", cache=own)
    seen = []
    real = source.open_model_source

    def watch(*a, **kw):
        seen.append(kw)
        return real(*a, **kw)

    class Built(Exception):
        pass

    def stop(app, engine, settings):
        raise Built
    monkeypatch.setattr(source, "open_model_source", watch)
    monkeypatch.setattr(api_server, "run_app", stop)
    monkeypatch.setenv("PICOVLLM_PD_SECRET", "s" * 64)
    parser = argparse.ArgumentParser()
    cli_router.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["router", "--model", "tiny-org/tagged", "--revision", "v1", "--download-dir", str(own)])
    with pytest.raises(Built):
        router_server.main(args)
    assert seen and seen[0]["revision"] == "v1" and seen[0]["download_dir"] == str(own)
