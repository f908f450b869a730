"""Model registry: HF architecture name -> model class."""
from picovllm.models.cohere import CohereForCausalLM
from picovllm.models.deepseek import DeepseekForCausalLM
from picovllm.models.exaone4 import Exaone4ForCausalLM
from picovllm.models.gemma import GemmaForCausalLM
from picovllm.models.glm4 import Glm4ForCausalLM, Glm4MoeForCausalLM
from picovllm.models.gpt_oss import GptOssForCausalLM
from picovllm.models.granite import GraniteForCausalLM
from picovllm.models.llama import LlamaForCausalLM
from picovllm.models.mixtral import MixtralForCausalLM
from picovllm.models.olmo2 import Olmo2ForCausalLM, OlmoeForCausalLM

# Most families are the shared decoder with a flag or two of ModelConfig: Qwen2 (q/k/v bias), Qwen3 (q/k norm),
# Mistral (sliding window), Phi-3 (q/k/v and gate/up fused in the checkpoint), Qwen3-MoE (q/k norm, experts),
# SmolLM3 (NoPE layers), Qwen2-MoE (q/k/v bias, experts and a shared expert), Seed-OSS (q/k/v and o biases),
# ERNIE 4.5 (interleaved rotary pairs); OLMo 3 is OLMo 2's model with sliding layers.
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": CohereForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "Olmo3ForCausalLM": Olmo2ForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "SeedOssForCausalLM": LlamaForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "Ernie4_5ForCausalLM": LlamaForCausalLM,
}
