"""Embedding models (EngineConfig.runner "pooling", engine/pooling.py): LLM.embed and POST /v1/embeddings.

Oracles: HF transformers on the same weights in float64: Qwen3's base model (AutoModel) and Llama's causal LM's last
hidden state (output_hidden_states), last-token or mean pooled, cut and normalized there. The served embeddings are
checked against LLM.embed on the same weights, through the official openai client."""
import base64
import functools
import json
import random
import signal
import struct

import httpx
import openai
import pytest
import torch

from picovllm import LLM, EngineConfig, PoolingParams
from picovllm.config import PoolerConfig
from picovllm.engine.pooling import engine_pooler
from picovllm.engine.scheduler import Scheduler
from serving_fixtures import ServerProcess, build_tiny_chat_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 384
# prompts around the chunk (16) and block (16) sizes, mixed in one batch: chunks of one prompt combine
LENGTHS = [1, 5, 16, 17, 40, 71]
ENGINE = dict(runner="pooling", block_size=16, num_kv_blocks=64, max_num_batched_tokens=16)


def prompts_of(lengths, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


@functools.lru_cache(maxsize=None)
def _hf_model(path: str, causal: bool):
    from transformers import AutoModel, AutoModelForCausalLM
    return (AutoModelForCausalLM if causal else AutoModel).from_pretrained(path, dtype=torch.float64).eval()


def hf_embeddings(path: str, prompts, mean=False, normalize=True, dims=None, causal=False) -> list[torch.Tensor]:
    """Each prompt alone through HF in float64: the final norm's output, pooled, cut to dims, normalized."""
    model, out = _hf_model(path, causal), []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            h = model(x, output_hidden_states=True).hidden_states[-1][0] if causal else model(x).last_hidden_state[0]
            v = h.mean(0) if mean else h[-1]
            v = v[:dims] if dims else v
            out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return out


def assert_close(outs, refs, atol=2e-5):
    assert len(outs) == len(refs)
    for o, ref in zip(outs, refs):
        got = torch.tensor(o.outputs.embedding if hasattr(o, "outputs") else o, dtype=torch.float64)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() < atol * max(1.0, ref.abs().max().item())


@pytest.fixture(scope="module")
def bare_qwen3(tiny_models, tmp_path_factory) -> str:
    """The tiny Qwen3 saved as its bare model (Qwen3Model: tensors without "model.", no lm_head), as
    sentence-transformers saves Qwen3-Embedding."""
    from safetensors import safe_open
    from transformers import AutoModel
    path = str(tmp_path_factory.mktemp("bare") / "qwen3")
    AutoModel.from_pretrained(tiny_models["qwen3"], dtype=torch.float32).save_pretrained(path)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = list(f.keys())
    assert not any(n.startswith(("model.", "lm_head")) for n in names), names
    with open(f"{path}/config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3Model"]
    return path


# -- offline: LLM.embed against HF ------------------------------------------------------------------------------
def test_last_token_pooling_matches_hf_across_chunks_and_overlap(tiny_models):
    """Qwen3 (last token, the default): a batch mixing lengths, prompts longer than the 16-token chunk; overlapped
    scheduling too (a request waits out its last chunk's step before it finishes)."""
    path, prompts = tiny_models["qwen3"], prompts_of(LENGTHS)
    refs = hf_embeddings(path, prompts)
    llm = LLM(path, **ENGINE)
    outs = llm.embed(prompts, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert_close(outs, refs)
    assert_close(LLM(path, async_scheduling=True, task="embed", **{k: v for k, v in ENGINE.items() if k != "runner"}
                     ).embed(prompts, use_tqdm=False), refs)
    # the prefix cache: a repeated prompt takes its full blocks from the cache and gives the same vector
    hits = llm.engine.block_manager.hit_tokens
    again = llm.embed([prompts[-1], prompts[-2]], use_tqdm=False)
    assert llm.engine.block_manager.hit_tokens - hits == 64 + 32
    assert_close(again, [refs[-1], refs[-2]])


def test_mean_pooling_matches_hf_under_preemption(tiny_models, monkeypatch):
    """Llama, mean pooling: every chunk's rows summed; a KV cache too small for the batch preempts requests (under
    overlapped scheduling a finished prompt's blocks go a step later), which start again from their first token; a
    repeated prompt is computed whole (no prefix-cache hit), to the same vector."""
    path, prompts = tiny_models["llama"], prompts_of([40, 60, 3, 50, 33], seed=1)
    refs = hf_embeddings(path, prompts, mean=True, causal=True)
    preempted = []
    real = Scheduler.preempt
    monkeypatch.setattr(Scheduler, "preempt", lambda self, req: (preempted.append(req), real(self, req)))
    llm = LLM(path, pooler_config={"pooling_type": "mean"}, runner="pooling", block_size=16, num_kv_blocks=5,
              max_num_batched_tokens=32, async_scheduling=True)
    assert_close(llm.embed(prompts, use_tqdm=False), refs)
    assert preempted
    hits = llm.engine.block_manager.hit_tokens
    assert_close(llm.embed([prompts[0]], use_tqdm=False), refs[:1])
    assert llm.engine.block_manager.hit_tokens == hits


def test_bare_model_checkpoint_loads_for_pooling_only(bare_qwen3, tiny_models):
    prompts = prompts_of([9, 33], seed=2)
    llm = LLM(bare_qwen3, **ENGINE)
    assert llm.engine.runner.model.lm_head is None
    refs = hf_embeddings(tiny_models["qwen3"], prompts)      # the same weights as the causal LM's
    assert_close(llm.embed(prompts, use_tqdm=False), refs)
    raw = llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    assert_close(raw, hf_embeddings(bare_qwen3, prompts, normalize=False))
    with pytest.raises(ValueError, match="bare model.*runner 'pooling'"):
        LLM(bare_qwen3, num_kv_blocks=8)
    # Qwen3-Embedding's own layout: the causal LM's architecture named, the bare model's tensors, no lm_head
    causal = {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": False}
    assert_close(LLM(bare_qwen3, hf_overrides=causal, **ENGINE).embed(prompts, use_tqdm=False), refs)
    with pytest.raises(ValueError, match="missing weights: lm_head.weight"):
        LLM(bare_qwen3, hf_overrides=causal, num_kv_blocks=8)


@pytest.mark.usefixtures("one_thread_in_children")
def test_tensor_parallel_pools_rank_0s_hidden_states(bare_qwen3, tiny_models):
    """TP=2, a bare checkpoint, mean pooling: the final hidden state is the same on every rank; rank 0 pools it."""
    prompts = prompts_of([9, 40, 3], seed=4)
    with LLM(bare_qwen3, tensor_parallel_size=2, pooler_config={"pooling_type": "MEAN"}, **ENGINE) as llm:
        assert_close(llm.embed(prompts, use_tqdm=False), hf_embeddings(tiny_models["qwen3"], prompts, mean=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,atol", [("float32", 2e-4), ("bfloat16", 3e-2)])
def test_gpu_pooling_matches_hf(tiny_models, dtype, atol):
    """On the GPU (the Triton prefill kernels, eager steps): last-token and mean pooling over chunked prompts against
    HF in float64; fp32 within CUDA's summation orders, bf16 within its rounding."""
    path, prompts = tiny_models["qwen3"], prompts_of(LENGTHS, seed=5)
    for pooling, mean in [("LAST", False), ("MEAN", True)]:
        llm = LLM(path, device="cuda", dtype=dtype, pooler_config={"pooling_type": pooling}, **ENGINE)
        assert_close(llm.embed(prompts, use_tqdm=False), hf_embeddings(path, prompts, mean=mean), atol=atol)


def test_matryoshka_dimensions_cut_then_normalize(tiny_models):
    path, prompts = tiny_models["qwen3"], prompts_of([12, 30], seed=3)
    llm = LLM(path, hf_overrides={"matryoshka_dimensions": [16, 32]}, **ENGINE)
    assert_close(llm.embed(prompts, PoolingParams(dimensions=16), use_tqdm=False),
                 hf_embeddings(path, prompts, dims=16))
    with pytest.raises(ValueError, match=r"PoolingParams.dimensions 8: .*\[16, 32\] only"):
        llm.embed(prompts, PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="PoolingParams.dimensions 4: the model is not Matryoshka-trained"):
        LLM(tiny_models["llama"], **ENGINE).embed(prompts, PoolingParams(dimensions=4), use_tqdm=False)


def test_refusals_name_the_field(tiny_models):
    path = tiny_models["llama"]
    with pytest.raises(ValueError, match="LLM.embed needs a pooling model"):
        LLM(path, num_kv_blocks=8).embed(["x"])
    pooling = LLM(path, **ENGINE)
    with pytest.raises(ValueError, match="this engine pools"):
        pooling.generate([[1, 2, 3]], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is 513 tokens, longer than max_model_len 512"):
        pooling.embed([[1] * 513], use_tqdm=False)
    assert len(pooling.embed([[1] * 512], use_tqdm=False)[0].outputs.embedding) == 64    # a prompt may fill it
    with pytest.raises(ValueError, match="^pooling_params has 2 entries for 1 prompts"):
        pooling.embed([[1, 2]], [PoolingParams(), PoolingParams()], use_tqdm=False)
    for kw, field in [(dict(role="p"), "EngineConfig.role"), (dict(prefill_cuda_graphs=True), "prefill_cuda_graphs"),
                      (dict(warmup=True), "EngineConfig.warmup"),
                      (dict(pooler_config={"pooling_type": "CLS"}), "pooler_config.pooling_type"),
                      (dict(pooler_config='{"softmax": true}'), "pooler_config.softmax"),
                      (dict(runner="reward"), "EngineConfig.runner")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(model=path, **{"runner": "pooling", **kw})
    with pytest.raises(ValueError, match="pooler_config applies to a pooling engine"):
        EngineConfig(model=path, pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="task 'classify' is not supported"):
        LLM(path, task="classify")
    with pytest.raises(ValueError, match="PoolingParams.dimensions must be an int >= 1"):
        PoolingParams(dimensions=0)


def test_sentence_transformers_config_sets_the_pooler(tmp_path):
    """vLLM's reading of a sentence-transformers folder: the Pooling module's mode, a Normalize module or not."""
    def folder(mode: str, normalize: bool) -> str:
        d = tmp_path / f"{mode}{normalize}"
        (d / "1_Pooling").mkdir(parents=True, exist_ok=True)
        modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        modules += [{"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}] * normalize
        (d / "modules.json").write_text(json.dumps(modules))
        (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, mode: True}))
        return str(d)
    assert engine_pooler(None, folder("pooling_mode_mean_tokens", False)) == PoolerConfig("MEAN", False)
    assert engine_pooler(None, folder("pooling_mode_lasttoken", True)) == PoolerConfig("LAST", True)
    assert engine_pooler(PoolerConfig(normalize=False), str(tmp_path)) == PoolerConfig("LAST", False)
    with pytest.raises(ValueError, match="pooling CLS; picovllm pools LAST or MEAN only"):
        engine_pooler(None, folder("pooling_mode_cls_token", True))
    assert engine_pooler(PoolerConfig("MEAN"), folder("pooling_mode_cls_token", True)) == PoolerConfig("MEAN", True)


# -- served: POST /v1/embeddings -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_path(tmp_path_factory) -> str:
    """The servers' tiny Llama with a trained tokenizer (serving_fixtures)."""
    return build_tiny_chat_model(str(tmp_path_factory.mktemp("tinychat") / "model"))


@pytest.fixture(scope="module")
def pooling_server(chat_path, tmp_path_factory):
    srv = ServerProcess(None, str(tmp_path_factory.mktemp("log") / "server.log"), "--runner", "pooling",
                        "--max-model-len", "64", "--num-kv-blocks", "64", "--max-num-batched-tokens", "16",
                        command=("serve", chat_path))
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.log()


def unpacked(b64: str) -> list[float]:
    """OpenAI's base64 embedding: little-endian float32."""
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def test_served_embeddings_match_llm_embed(pooling_server, chat_path):
    client = openai.OpenAI(base_url=pooling_server.url + "/v1", api_key="unused", max_retries=0)
    texts = ["Hello, how are you today?", "The quick brown fox jumps over the lazy dog. " * 3, "A"]
    ids = [[5, 6, 7], list(range(10, 40))]
    llm = LLM(chat_path, runner="pooling", max_model_len=64, num_kv_blocks=64, max_num_batched_tokens=16)
    ref = [o.outputs.embedding for o in llm.embed(texts + ids, use_tqdm=False)]
    for fmt in ("float", "base64", openai.NOT_GIVEN):   # not given: the client asks for base64 and decodes it
        got = client.embeddings.create(model=chat_path, input=texts, encoding_format=fmt)
        assert [d.index for d in got.data] == [0, 1, 2]
        vectors = [unpacked(d.embedding) if fmt == "base64" else d.embedding for d in got.data]
        assert_close(vectors, [torch.tensor(r, dtype=torch.float64) for r in ref[:3]], 1e-6)
        assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(llm.engine.tokenize(t)) for t in texts)
    for one, r in [(ids[0], ref[3]), (ids, ref[3:]), (texts[0], ref[:1])]:
        got = client.embeddings.create(model=chat_path, input=one)
        assert_close([d.embedding for d in got.data], [torch.tensor(x, dtype=torch.float64)
                                                      for x in (r if isinstance(r[0], list) else [r])], 1e-6)
    body = httpx.post(pooling_server.url + "/v1/embeddings",
                      json={"input": ids[1], "encoding_format": "base64", "user": "u"}).json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    assert_close([unpacked(body["data"][0]["embedding"])], [torch.tensor(ref[4], dtype=torch.float64)], 1e-6)
    assert httpx.get(pooling_server.url + "/v1/models").json()["data"][0]["runner"] == "pooling"


def test_served_refusals_name_the_field(pooling_server, chat_path):
    url = pooling_server.url

    def error(path: str, body: dict) -> dict:
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        return r.json()["error"]
    assert error("/v1/embeddings", {"input": [1] * 65})["param"] == "input"
    assert error("/v1/embeddings", {"input": ["a", ""]})["param"] == "input"
    assert error("/v1/embeddings", {"input": []})["param"] == "input"
    assert error("/v1/embeddings", {"input": "a", "dimensions": 8})["param"] == "dimensions"
    assert error("/v1/embeddings", {"input": "a", "encoding_format": "int8"})["param"] == "encoding_format"
    assert error("/v1/embeddings", {"input": "a", "cache_salt": "s" * 129})["param"] == "cache_salt"   # was a 500
    # vLLM's chat embeddings: refused by name (without input it had been "input: Field required"; with input,
    # the messages were dropped)
    chat = [{"role": "user", "content": "hi"}]
    assert error("/v1/embeddings", {"messages": chat})["param"] == "messages"
    assert error("/v1/embeddings", {"input": "a", "messages": chat})["param"] == "messages"
    lone = httpx.post(url + "/v1/embeddings", content=b'{"input": ["a", "\\ud800"]}', timeout=30,   # a lone surrogate
                      headers={"content-type": "application/json"})
    assert lone.status_code == 400 and lone.json()["error"]["param"] == "input[1]", lone.text   # had named "prompt"
    unknown = httpx.post(url + "/v1/embeddings", json={"input": "a", "model": "other"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"     # OpenAI's
    cut = httpx.post(url + "/v1/embeddings", json={"input": [1] * 65, "truncate_prompt_tokens": -1}).json()
    assert cut["usage"]["prompt_tokens"] == 64
    assert error("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 65})["param"] == "truncate_prompt_tokens"
    assert "this engine pools" in error("/v1/completions", {"prompt": "hi"})["message"]
    assert "this engine pools" in error("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
                                        )["message"]
    # a generating server's /v1/embeddings (the app in this process, over a generating engine)
    from fastapi.testclient import TestClient

    from picovllm.engine.llm_engine import Engine
    from picovllm.entrypoints.openai.api_server import ServerSettings, build_app
    from picovllm.entrypoints.openai.async_engine import AsyncEngine
    from picovllm.entrypoints.openai.metrics import ServerMetrics
    from picovllm.entrypoints.openai.serving import ServingContext
    from picovllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
    engine = Engine(EngineConfig(model=chat_path, num_kv_blocks=16))
    ctx = ServingContext(AsyncEngine(engine), TokenizerWorker(engine.tokenizer), ServerMetrics("m"), "m")
    with TestClient(build_app(ctx, ServerSettings())) as http:
        r = http.post("/v1/embeddings", json={"input": "hi"})
        assert r.status_code == 400 and "needs a pooling model" in r.json()["error"]["message"]
