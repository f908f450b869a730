"""Model registry: HF architecture name -> model class."""
from picovllm.models.llama import LlamaForCausalLM

# Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) are Llama with a flag each, see ModelConfig.
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,   # Llama's layers; its sliding window caps the context (config.py)
    "Phi3ForCausalLM": LlamaForCausalLM,      # Llama's layers, q/k/v and gate/up fused in the checkpoint
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
