"""The executor seam and the attention-backend registry (ModelRunner's parts), on the CPU."""
import pytest
import torch

from picovllm import SamplingParams
from picovllm.config import EngineConfig
from picovllm.engine.attention_backends import ATTENTION_BACKENDS, make_attention_backend
from picovllm.engine.executor import Executor, InProcessExecutor, make_executor
from picovllm.engine.llm_engine import Engine
from picovllm.engine.model_runner import ModelRunner
from picovllm.loader import open_model_source

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def tokens_of(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    out = {}
    for p in prompts:
        eng.add_request(p, GREEDY, request_id=str(len(out)))
        out[str(len(out))] = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return list(out.values())


def test_executor_is_abstract():
    with pytest.raises(TypeError):
        Executor()


def test_engine_makes_an_in_process_executor_and_takes_an_injected_runner(tiny_models):
    config = EngineConfig(tiny_models["llama"], num_kv_blocks=32, block_size=8)
    prompts = [[1, 2, 3, 4, 5], list(range(7, 30))]
    made = Engine(config)
    assert isinstance(made.executor, InProcessExecutor) and made.runner is made.executor.runner
    assert made.executor.model_config is made.runner.model_config and made.executor.kv_cache.shape[2] == 32
    runner = ModelRunner(config, open_model_source(config.model, config.disk_cache))
    injected = Engine(config, executor=runner)         # a ModelRunner is wrapped, callers need not know
    assert isinstance(injected.executor, InProcessExecutor) and injected.runner is runner
    assert tokens_of(injected, prompts) == tokens_of(made, prompts)


def test_make_executor_in_process_for_tp1(tiny_models):
    config = EngineConfig(tiny_models["llama"], num_kv_blocks=8)
    ex = make_executor(config, open_model_source(config.model, config.disk_cache))
    assert isinstance(ex, InProcessExecutor) and ex.supports_overlap and ex.tp.size == 1
    ex.shutdown()


def test_attention_backend_registry(tiny_models):
    config = EngineConfig(tiny_models["qwen3"], num_kv_blocks=8, block_size=8)
    runner = ModelRunner(config, open_model_source(config.model, config.disk_cache))
    auto = make_attention_backend(config, runner.model)
    want = "cpu" if ATTENTION_BACKENDS["cpu"].available(config, runner.model) else "torch"
    assert type(auto).__name__ == {"cpu": "CpuAttentionBackend", "torch": "TorchAttentionBackend"}[want]
    named = EngineConfig(tiny_models["qwen3"], num_kv_blocks=8, attention_backend="torch")
    assert type(make_attention_backend(named, runner.model)).__name__ == "TorchAttentionBackend"
    bf16 = EngineConfig(tiny_models["qwen3"], num_kv_blocks=8, attention_backend="cpu", dtype="bfloat16")
    assert not ATTENTION_BACKENDS["cpu"].available(bf16, runner.model)
    with pytest.raises(ValueError, match="attention_backend 'cpu' needs float32"):
        make_attention_backend(bf16, runner.model)
    assert runner.kv_bytes_per_block() == 2 * 2 * 8 * runner.model.attention_layers()[0].num_kv_heads \
        * runner.model.attention_layers()[0].head_dim * torch.float32.itemsize
