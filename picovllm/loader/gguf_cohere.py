"""llama.cpp's `command-r` (Command R, Command R+ 04-2024, Aya 23, Aya Expanse) and `cohere2` (Command R7B,
Command A) GGUF architectures as CohereForCausalLM and Cohere2ForCausalLM: the metadata -> ModelConfig (the tensor
names are the shared ones of gguf_archs; models/cohere.py reads them as it reads an HF folder).

What llama.cpp's converter (CommandR2Model, Cohere2Model) wrote, read back:
- q/k rows as the checkpoint has them: llama.cpp's rope for both is the interleaved kind (pairs 2i, 2i + 1), Cohere's
  own; the rows are put in layers/rotary.head_order at load, as an HF folder's. rope.dimension_count is the whole
  head (a partial one refused: HF's Cohere rotates every dim).
- The parallel block's one norm as attn_norm, a LayerNorm without bias whose epsilon is
  attention.layer_norm_epsilon (required, as llama.cpp requires it); logit_scale (required) multiplies the logits
  (ModelConfig.logits_scaling is its inverse); no output.weight: the LM head is the embedding (tied, Cohere's).
- cohere2: attention.sliding_window (required) on three layers of four (llama.cpp's fixed pattern; a file's
  attention.sliding_window_pattern, where one has it, is read instead), the global layers NoPE.
Command R+ 08-2024's q/k LayerNorms (attn_q_norm, attn_k_norm) are refused, as for HF folders (use_qk_norm).
"""
from __future__ import annotations

from picovllm.config import ModelConfig
from picovllm.loader.gguf_archs import required, shared_fields, sliding_pattern

HF = {"command-r": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM"}


def model_config(meta: dict, tensors: dict, path: str) -> ModelConfig:
    """The ModelConfig of a command-r or cohere2 file (tensors: {name: object with .shape, GGUF order})."""
    name = meta["general.architecture"]
    p = name + "."
    fields = shared_fields(meta, tensors, p, path, interleaved_qk=True)    # a partial rotary refused
    if fields["qk_norm"]:
        raise ValueError(f"GGUF {path!r}: tensor 'blk.0.attn_q_norm.weight': Cohere's q/k LayerNorms (Command R+ "
                         "08-2024's use_qk_norm) are unsupported")
    fields["rms_norm_eps"] = float(required(meta, p + "attention.layer_norm_epsilon", path))
    scale = float(required(meta, p + "logit_scale", path))
    if scale <= 0:
        raise ValueError(f"GGUF {path!r}: {p}logit_scale={scale}: must be > 0")
    family = dict(rotary_interleaved=True, logits_scaling=1.0 / scale)
    if name == "cohere2":
        required(meta, p + "attention.sliding_window", path)
        window, sliding = sliding_pattern(meta, p, name, fields["num_hidden_layers"], path)
        # only the sliding layers rotate (hf_config.py's _rope_layers, as HF's Cohere 2)
        family.update(sliding_window=window, sliding_layers=sliding,
                      rope_layers=None if sliding is None or all(sliding) else list(sliding))
    return ModelConfig(architecture=HF[name], intermediate_size=int(required(meta, p + "feed_forward_length", path)),
                       **fields, **family)
