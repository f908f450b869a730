"""picovllm: a compact, readable LLM inference engine with prefill/decode disaggregation."""
from picovllm.entrypoints.beam_search import BeamSearchParams
from picovllm.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, PoolingOutput,
                              PoolingRequestOutput, RequestOutput)
from picovllm.pooling_params import PoolingParams
from picovllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


def __getattr__(name):
    # LLM, Engine and EngineConfig pull in torch; import them lazily so `import picovllm` stays light
    # (and the CLI can set OpenMP's environment before torch loads it).
    if name == "EngineConfig":
        from picovllm.config import EngineConfig
        return EngineConfig
    if name == "LLM":
        from picovllm.entrypoints.llm import LLM
        return LLM
    if name == "Engine":
        from picovllm.engine.llm_engine import Engine
        return Engine
    raise AttributeError(name)


__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind",
           "BeamSearchParams", "RequestOutput", "CompletionOutput", "Logprob", "PoolingParams", "EmbeddingOutput",
           "EmbeddingRequestOutput", "PoolingOutput", "PoolingRequestOutput"]
