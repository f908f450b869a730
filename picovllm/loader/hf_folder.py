"""HF-format model folders: config.json, one or sharded *.safetensors, optional tokenizer files."""
from __future__ import annotations

import glob
import json
import os

from safetensors import safe_open

from picovllm.artifact_cache import file_identity
from picovllm.config import ModelConfig
from picovllm.hf_config import checkpoint_quantization
from picovllm.loader.source import Fp8Checkpoint, ModelSource, WeightIterator

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


# An image-and-text checkpoint served as its text model: its architecture -> (the text model's, the text config's
# model_type), and what its tensors' names start with: the text model's prefixes (old and new transformers layouts)
# -> the text model's own, and the parts left out (the vision tower and its projector). Images are never taken
# (non-text content is refused).
TEXT_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text"),
                      "Mistral3ForConditionalGeneration": ("MistralForCausalLM", "mistral"),
                      # multimodal rope (mrope): three position streams, equal on text, so plain rope there
                      "Qwen2_5_VLForConditionalGeneration": ("Qwen2ForCausalLM", "qwen2_5_vl_text"),
                      "Qwen3VLForConditionalGeneration": ("Qwen3ForCausalLM", "qwen3_vl_text")}
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_LEFT_OUT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
             "visual.", "model.visual.")


def _text_config(path: str, raw: dict) -> dict:
    """config.json as the text model's: a multimodal one's text_config with transformers' defaults filled in (the
    released configs leave most fields to them: Gemma 3 4B's names six), what it leaves out taken from the top
    level; any other as it is. ValueError naming a text model this loader does not take."""
    arch = (raw.get("architectures") or [None])[0]
    if arch not in TEXT_OF_MULTIMODAL:
        return raw
    text_arch, text_type = TEXT_OF_MULTIMODAL[arch]
    written = raw.get("text_config") or {}
    if written.get("model_type", text_type) != text_type:
        raise ValueError(f"config.json text_config.model_type={written['model_type']!r}: {arch}'s text model is read "
                         f"as {text_type!r} only")
    from transformers import AutoConfig
    text = AutoConfig.from_pretrained(path).get_text_config().to_dict()
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):    # the file's top level over a text default
        if key not in written and raw.get(key) is not None:
            text[key] = raw[key]
    if raw.get("quantization_config"):      # the whole checkpoint's: read (or refused) as any model's
        text["quantization_config"] = raw["quantization_config"]
    if arch == "Gemma3ForConditionalGeneration":    # HF's image-and-text Gemma 3 does not soft-cap its logits
        text["final_logit_softcapping"] = None
    return dict(text, architectures=[text_arch])


# Architectures whose config.json may leave fields to transformers' config class, where those defaults shape the
# model (GPT-OSS: alternating windows, YaRN x32 over 4096 positions, q/k/v/o biases): read through the class
_CLASS_DEFAULTS = {"GptOssForCausalLM": "GptOssConfig"}


def _with_class_defaults(raw: dict) -> dict:
    arch = (raw.get("architectures") or [None])[0]
    if arch not in _CLASS_DEFAULTS:
        return raw
    import transformers
    return dict(getattr(transformers, _CLASS_DEFAULTS[arch]).from_dict(raw).to_dict(), architectures=[arch])


def _weight_files(path: str) -> list[str]:
    """The checkpoint's safetensors files: those its index names where it has one (a Mistral repository also holds
    consolidated.safetensors, the same weights in Mistral's own names), else every one in the folder."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map (tensor name -> file) in it")
        files = [os.path.join(path, n) for n in sorted(set(weight_map.values()))]
        missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{index} names {', '.join(missing)}, not in the folder")
        return files
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def _text_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text model's, None for a part left out."""
    if name.startswith(_LEFT_OUT):
        return None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _read_json(path: str) -> dict:
    """A checkpoint's JSON file as a dict; one that does not parse is a ValueError naming it."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"cannot read {path}: not a JSON object")
    return data


def _check_readable(files: list[str]) -> None:
    """Each safetensors file's header parses and its data is all there (safetensors checks both on opening): a
    truncated or damaged file is a ValueError naming it, before any weight is read."""
    for file in files:
        try:
            with safe_open(file, framework="pt"):
                pass
        except Exception as e:       # safetensors' SafetensorError derives from Exception only
            raise ValueError(f"cannot read checkpoint file {file}: {e}") from None


def _tensor_names(files: list[str], multimodal: bool) -> set[str]:
    """The names of the checkpoint's tensors, read from the files' headers (a multimodal one's text model's, as
    _text_name names them; the parts left out are not among them)."""
    names = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(n for n in map(_text_name if multimodal else str, f.keys()) if n is not None)
    return names


def _renamed_rope(raw: dict, overrides: dict) -> dict:
    """overrides as vLLM applies them on transformers 5: rope_scaling is another name for rope_parameters, which is
    how config.json now holds them (rope_theta in it), so an override of rope_scaling replaces the file's
    rope_parameters (its rope_theta kept) instead of losing to its "default" entry; one of rope_theta is set in them
    (HF reads their rope_theta over the top-level one)."""
    params = raw.get("rope_parameters")
    if "rope_parameters" in overrides or not isinstance(params, dict) or \
            "full_attention" in params:     # per layer type (Gemma 3): only rope_parameters names them
        return overrides
    if "rope_scaling" in overrides:
        theta = overrides.get("rope_theta", params.get("rope_theta"))
        rope = {**({} if theta is None else {"rope_theta": theta}), **(overrides["rope_scaling"] or {})}
    elif "rope_theta" in overrides:
        rope = dict(raw.get("rope_scaling") or params, rope_theta=overrides["rope_theta"])
    else:
        return overrides
    return {**overrides, "rope_scaling": None, "rope_parameters": rope}


def open_folder(path: str, weights_needed: bool = True, overrides: dict | None = None) -> ModelSource:
    """weights_needed=False: the config and tokenizer only (a front end's), no safetensors files asked for.
    overrides: config.json's (the text model's) top-level fields set or replaced (EngineConfig.hf_overrides)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"model folder {path!r} has no config.json")
    full = _read_json(cfg_path)
    raw = _text_config(path, full)
    multimodal = raw is not full
    files = _weight_files(path)
    if weights_needed:
        _check_readable(files)
    if multimodal:     # tied as HF ties it: where the checkpoint holds no LM head of its own
        names = _tensor_names(files, multimodal)
        raw = dict(raw, tie_word_embeddings="lm_head.weight" not in names) if files else raw
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_path):
        gen_eos = _read_json(gen_path).get("eos_token_id")
        if gen_eos is not None:
            raw = dict(raw, eos_token_id=gen_eos)
    if overrides:
        if multimodal and "text_config" in overrides:
            raise ValueError("hf_overrides: an image-and-text checkpoint is read as its text model; give the text "
                             "model's fields at the top level, not under text_config")
        raw = {**raw, **_renamed_rope(raw, overrides)}
    raw = _with_class_defaults(raw)
    try:
        config = ModelConfig.from_hf_dict(raw)          # its errors first: they name what the model is
    except KeyError as e:
        raise ValueError(f"{cfg_path}: no {e.args[0]!r}, which {raw.get('architectures')} needs") from None
    if not files and weights_needed:
        raise ValueError(f"model folder {path!r} has no *.safetensors files")

    from picovllm.layers.rotary import head_order
    order = head_order(config)

    mtp = _mtp_layers(raw, config.num_hidden_layers)

    def stored() -> WeightIterator:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    text_name = _text_name(name) if multimodal else name
                    if text_name is not None and not _in_layers(text_name, mtp):
                        yield text_name, f.get_tensor(name)

    def weights() -> WeightIterator:
        tensors = _dequantized(stored(), raw)
        if order is None:
            return tensors
        # after dequantization: a block's scale covers rows as the checkpoint stores them
        return ((name, _in_rotary_order(name, t, config, order)) for name, t in tensors)

    has_tok = any(os.path.exists(os.path.join(path, n)) for n in TOKENIZER_FILES)

    def load_tokenizer():
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(path)
        except (ValueError, OSError) as e:      # a tokenizer file that does not parse
            raise ValueError(f"cannot load the tokenizer of {path!r}: {e}") from None

    identity = ("hf", full, overrides or {}, [(os.path.basename(f), file_identity(f, head_bytes=1 << 20))
                                              for f in files])
    fp8 = _fp8_checkpoint(raw, files, multimodal, mtp, reordered=order is not None)
    return ModelSource(path, config, weights, load_tokenizer if has_tok else None, identity, fp8=fp8)


def _mtp_layers(raw: dict, layers: int) -> range:
    """The layer indices of the checkpoint's multi-token-prediction layers (GLM-4.5's num_nextn_predict_layers, after
    the decoder's num_hidden_layers): only speculative decoding reads them, so they are not read (not even from disk),
    as vLLM without it."""
    n = raw.get("num_nextn_predict_layers") or raw.get("num_mtp_layers") or 0
    return range(layers, layers + n)


def _in_layers(name: str, layers: range) -> bool:
    """Whether tensor `name` belongs to one of the decoder layers `layers` (model.layers.N.*)."""
    if not layers or not name.startswith("model.layers."):
        return False
    index = name[len("model.layers."):].split(".", 1)[0]
    return index.isdigit() and int(index) in layers


def _dequantized(tensors: WeightIterator, raw: dict) -> WeightIterator:
    """A quantized checkpoint's tensors dequantized (the quantizations ModelConfig takes): GPT-OSS's MXFP4 experts,
    FP8 weights; any other checkpoint's as they are."""
    quant = checkpoint_quantization(raw)
    if quant == "mxfp4":
        from picovllm.loader.mxfp4 import dequantized
        return dequantized(tensors)
    if quant is not None:
        from picovllm.loader import fp8
        return fp8.dequantized(tensors, fp8.Fp8Scheme.from_quantization_config(raw["quantization_config"]))
    return tensors


def _fp8_checkpoint(raw: dict, files: list[str], multimodal: bool, mtp: range,
                    reordered: bool) -> Fp8Checkpoint | None:
    """ModelSource.fp8 of an FP8 checkpoint (its tensors' names read from the files' headers), None for another."""
    if checkpoint_quantization(raw) not in ("fp8", "compressed-tensors") or not files:
        return None
    from picovllm.loader import fp8
    scheme = fp8.Fp8Scheme.from_quantization_config(raw["quantization_config"])
    names = {n for n in _tensor_names(files, multimodal) if not _in_layers(n, mtp)}
    scaled = {n.rpartition(".")[0] + ".weight" for n in names if n.rpartition(".")[2] in scheme.scale_names}
    blocks = scheme.granularities
    block = None if reordered or len(blocks) != 1 or None in blocks[0] or blocks[0][1] % 16 else blocks[0]
    return Fp8Checkpoint(frozenset(scaled & names), frozenset(n for n in names if n.endswith(".weight")), block,
                         block is not None and str(raw["quantization_config"].get("scale_fmt")).lower() == "ue8m0",
                         per_channel=blocks == ((1, None),))


def _in_rotary_order(name: str, t, config: ModelConfig, head_order: list[int]):
    """Partial or interleaved rotary: q's and k's rows (Phi-3's fused q/k/v rows too), biases and per-head norms
    with each head's dims in layers/rotary.head_order; every other tensor as it is."""
    import torch

    from picovllm.layers.rotary import head_rows
    d = config.head_dim
    if name.endswith((".q_norm.weight", ".k_norm.weight")) or ".q_proj." in name or ".k_proj." in name:
        return t[head_rows(len(t), d, head_order)]
    if ".qkv_proj." in name:
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        q_rows, k_rows, v_rows = t.split([q, kv, kv])
        return torch.cat([q_rows[head_rows(q, d, head_order)], k_rows[head_rows(kv, d, head_order)], v_rows])
    return t

