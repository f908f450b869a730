"""Where a model comes from: an HF folder, a GGUF file, or the default model's GGUF."""
from picovllm.loader.source import ModelSource, engine_model_source, open_model_source

__all__ = ["ModelSource", "engine_model_source", "open_model_source"]
