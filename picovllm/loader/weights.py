"""Put a checkpoint's tensors into a model: each parameter's own weight_loader takes its shard."""
from __future__ import annotations

import re

import torch
from torch import nn

from picovllm.loader.source import WeightIterator


def parameter_of(model: nn.Module, ckpt_name: str) -> tuple[str, object]:
    """(the model's parameter name, shard id within a fused parameter or None) for a checkpoint tensor."""
    name, shard = model.checkpoint_name(ckpt_name), None
    for frag, (fused, shard_id) in model.packed_modules.items():
        if f".{frag}." in name:
            name, shard = name.replace(f".{frag}.", f".{fused}."), shard_id
            break
    return _stacked_expert(name, shard)


def load_weights(model: nn.Module, weights: WeightIterator, elsewhere: frozenset[str] = frozenset()) -> None:
    """elsewhere: parameter names the caller fills itself (quantized weights), not expected from `weights`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    tied = getattr(model.cfg, "tie_word_embeddings", False)
    no_head = getattr(model, "lm_head", True) is None      # a pooling model's (engine/pooling.py)
    for ckpt_name, tensor in unfused(weights, model.cfg):
        if "rotary_emb.inv_freq" in ckpt_name:
            continue
        if (tied and ckpt_name == "lm_head.weight") or (no_head and ckpt_name.startswith("lm_head.")):
            continue  # tied to the embedding, loaded from there; or no LM head at all
        name, shard = parameter_of(model, ckpt_name)
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} matches no parameter of {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            if loader is not None:
                loader(param, tensor.to(param.dtype), shard, name=ckpt_name)
            else:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {ckpt_name}: shape mismatch, model expects {tuple(param.shape)}, "
                                     f"checkpoint has {tuple(tensor.shape)}")
                param.data.copy_(tensor)
        loaded.add(name if shard is None else f"{name}#{shard}")
    expected = set()
    for name, p in model.named_parameters():
        if name in elsewhere:
            continue
        if hasattr(p, "shard_ids"):
            expected |= {f"{name}#{shard}" for shard in p.shard_ids}
        elif name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            expected |= {f"{name}#q", f"{name}#k", f"{name}#v"}
        elif name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):   # mlp_bias: gate's and up's biases
            expected |= {f"{name}#0", f"{name}#1"}
        else:
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))


def _stacked_expert(name: str, shard: object) -> tuple[str, object]:
    """MoE checkpoints keep one tensor per expert (...experts.N.gate_up_proj.weight, after the renaming above);
    the MoE layer stacks them: ...experts.gate_up_proj, shard (N, the part within the expert)."""
    m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
    return (name, shard) if m is None else (f"{m[1]}.{m[3]}", (int(m[2]), shard))


def unfused(weights: WeightIterator, cfg) -> WeightIterator:
    """Checkpoints that store q/k/v or gate/up as one tensor (Phi-3) as the separate tensors the fused
    layers' shard loaders take: rows [q; k; v] and [gate; up]."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name, tensor in weights:
        if ".qkv_proj." in name:
            for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                yield name.replace(".qkv_proj.", f".{part}."), t
        elif ".gate_up_proj." in name:
            for part, t in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                yield name.replace(".gate_up_proj.", f".{part}."), t
        else:
            yield name, tensor
