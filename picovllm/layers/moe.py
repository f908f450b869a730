"""Mixture of experts (Qwen3-MoE, Mixtral; Qwen2-MoE, GLM-4.5 and DeepSeek-V2/V3 with shared experts): a router picks
each token's top-k experts, each a gated MLP, and the layer sums their outputs weighted by the router's scores. How the
scores pick and weigh the experts is the layer's Routing (softmax, DeepSeek-V2's softmax with group-limited selection
and a scale, or DeepSeek-V3's sigmoid with group-limited selection).

Under tensor parallelism every rank holds every expert with its intermediate dimension sharded, as a dense MLP's
(gate/up column-parallel, down row-parallel): each rank computes every routed token's partial output, and one
all-reduce of the combined sum finishes the layer. The router is replicated, so the ranks route alike.

route(), route_sigmoid() and experts_reference() are the torch reference: the CPU path, and the oracle of the
routing and grouped Triton kernels (picovllm/kernels/moe.py) that the layer runs on the GPU. The routing kernel
(route_topk) computes the plain softmax only: another Routing is computed by route_grouped / route_sigmoid in torch on
the GPU too, and its ids and weights go to the same grouped GEMMs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from picovllm import kernels
from picovllm.distributed import SINGLE, TPGroup
from picovllm.layers.activation import gated_activation
from picovllm.layers.fp8_weights import FP8, dequantize


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] float32, expert ids [T, k] int64): softmax over all experts in float32,
    the k largest, renormalised to sum to 1 if asked (Mixtral always, Qwen3-MoE per norm_topk_prob)."""
    probs = router_logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True)
class Routing:
    """How a MoE layer's router scores pick each token's top-k experts and weigh them, beside top_k and renormalize
    (ModelConfig: scoring_func, n_group, topk_group, routed_scaling_factor).

    softmax (Qwen3-MoE, Mixtral, GPT-OSS): route(); with groups or a scale (DeepSeek-V2's greedy and
    group_limited_greedy): route_grouped(). sigmoid (DeepSeek-V3, GLM-4.5): route_sigmoid(); the router then has a
    float32 weight and a per-expert e_score_correction_bias (the checkpoint's), as HF keeps both."""
    scoring: str = "softmax"      # "softmax" | "sigmoid"
    n_group: int = 1              # the experts in this many equal groups ...
    topk_group: int = 1           # ... of which each token picks from the best this many
    scale: float = 1.0            # routed_scaling_factor, the routed weights' factor (after renormalising)

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"Routing.scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")

    @property
    def plain(self) -> bool:
        """Softmax over every expert, unscaled: route(), what the fused routing kernel (route_topk) computes."""
        return self.scoring == "softmax" and self.topk_group >= self.n_group and self.scale == 1.0


def _keep_groups(choice: torch.Tensor, group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """choice [T, E] with the experts outside each token's topk_group best groups (by group_scores [T, groups]) at
    -inf."""
    t, e = choice.shape
    groups = group_scores.shape[1]
    kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1, sorted=False)[1], 1.0)
    kept = kept.view(t, groups, 1).expand(t, groups, e // groups).reshape(t, e)    # each expert's group's
    return choice.masked_fill(kept == 0, float("-inf"))


def route_grouped(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                  routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's routing, as HF's DeepseekV2TopkRouter: [T, E] logits -> (weights [T, k] float32, ids [T, k]
    int64). Softmax over all experts in float32; with groups (group_limited_greedy: topk_group < n_group) the choice
    is among the topk_group groups whose best expert scores highest; the k best scores, renormalised to sum to 1 if
    asked, times routing.scale. Ids are in no particular order."""
    scores = router_logits.float().softmax(-1)
    t, e = scores.shape
    choice = scores
    if routing.topk_group < routing.n_group:
        choice = _keep_groups(scores, scores.view(t, routing.n_group, e // routing.n_group).amax(-1),
                              routing.topk_group)
    weights, ids = choice.topk(top_k, dim=-1, sorted=False)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * routing.scale, ids


def route_sigmoid(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, renormalize: bool,
                  routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing, as HF's Glm4MoeTopkRouter: [T, E] logits -> (weights [T, k] float32, ids [T, k] int64).
    Scores sigmoid(logits); experts are chosen by score + correction_bias ([E]; for the choice only), among the
    topk_group groups (of n_group) whose two best biased scores sum highest; the weights are the chosen experts'
    unbiased scores, renormalised to sum to 1 if asked, times routing.scale. Ids are in no particular order."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    t, e = choice.shape
    groups = routing.n_group
    if routing.topk_group < groups:       # with every group kept the mask is all ones: skipped
        best2 = choice.view(t, groups, e // groups).topk(2, dim=-1)[0].sum(-1)          # [T, groups]
        choice = _keep_groups(choice, best2, routing.topk_group)
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)     # HF's guard against an all-zero row
    return weights * routing.scale, ids


def experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor, act: nn.Module, gate_up_bias: torch.Tensor | None = None,
                      down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; weights, ids [T, k]; gate_up [E, 2I, H]; down [E, H, I]; biases [E, 2I], [E, H] or None (GPT-OSS
    has them) -> sum over each token's k experts of weight * down(act(gate_up(x))), [T, H] in x's dtype. One expert
    at a time, over the tokens routed to it."""
    acc = torch.promote_types(x.dtype, torch.float32)     # float32 sums; float64 for a float64 oracle
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        h = act(F.linear(x[token], gate_up[e], None if gate_up_bias is None else gate_up_bias[e]))
        y = F.linear(h, down[e], None if down_bias is None else down_bias[e]).to(acc) * weights[token, slot, None]
        out.index_add_(0, token, y)
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    """The router (`gate`, [E, H], replicated) and the stacked experts: experts.gate_up_proj [E, 2 I/tp, H] (each
    expert's gate rows, then its up rows) and experts.down_proj [E, H, I/tp]. Checkpoints keep one tensor per expert;
    the loader (loader/weights.py) hands each to load() with shard (expert, 0 gate | 1 up | None down)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, renormalize: bool,
                 act: str = "silu", tp: TPGroup = SINGLE, routing: Routing = Routing()) -> None:
        super().__init__()
        if intermediate % tp.size:
            raise ValueError(f"moe_intermediate_size {intermediate} is not divisible by tensor_parallel_size "
                             f"{tp.size}")
        self.num_experts, self.top_k, self.renormalize, self.tp = num_experts, top_k, renormalize, tp
        self.routing = routing
        self.inter = intermediate // tp.size
        sigmoid = routing.scoring == "sigmoid"      # its router in float32 whatever the model's dtype, as HF's
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=torch.float32 if sigmoid else None)
        self.gate.weight.requires_grad_(False)
        if sigmoid:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                             requires_grad=False)
        self.experts = nn.Module()   # a namespace, so the parameters are named as the checkpoint's experts
        self.experts.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden),
                                                 requires_grad=False)
        self.experts.down_proj = nn.Parameter(torch.empty(num_experts, hidden, self.inter), requires_grad=False)
        self.experts.gate_up_proj.shard_ids = [(e, part) for e in range(num_experts) for part in (0, 1)]
        self.experts.down_proj.shard_ids = [(e, None) for e in range(num_experts)]
        for p in self.experts.parameters():
            p.weight_loader = self.load
        self.act = gated_activation(act)

    def load(self, param: nn.Parameter, w: torch.Tensor, shard: tuple[int, int | None], name: str = "") -> None:
        expert, part = shard
        n, r = self.inter, self.tp.rank
        if part is None:     # down [H, I]: this rank's input columns
            want, src, dst = (param.shape[1], n * self.tp.size), w.narrow(1, r * n, n), param.data[expert]
        else:                # gate or up [I, H]: this rank's rows
            want, src, dst = (n * self.tp.size, param.shape[2]), w.narrow(0, r * n, n), \
                param.data[expert].narrow(0, part * n, n)
        if tuple(w.shape) != want:
            raise ValueError(f"weight {name}: shape mismatch, model expects {want}, checkpoint has {tuple(w.shape)}")
        dst.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.routed(x))

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the experts' sum (its shards of every expert), before the all-reduce."""
        logits = self.gate(x.to(self.gate.weight.dtype))
        ex = self.experts
        w13, w2 = ex.gate_up_proj, ex.down_proj
        b13, b2 = self.expert_biases()
        fp8 = w13.dtype == FP8       # quantization="fp8" (layers/fp8_weights.py)
        if kernels.use_triton(x):   # routed in one kernel, tokens grouped by expert, a grouped GEMM a projection;
            from picovllm.kernels.moe import fused_experts, route_topk    # the torch code is their reference
            if self.routing.plain:
                weights, ids = route_topk(logits, self.top_k, self.renormalize)
            else:       # route_topk is plain softmax only: groups, scales, sigmoid in torch ops, then the same GEMMs
                weights, ids = self.route(logits)
            out = fused_experts(x, weights, ids, w13, w2, self.act, b13, b2,
                                *(ex.gate_up_proj_scale, ex.down_proj_scale, ex.gate_up_proj_block) if fp8 else ())
        else:
            if fp8:     # the grouped kernels' reference: the float8 codes times their scales
                w13 = dequantize(w13, ex.gate_up_proj_scale, x.dtype, ex.gate_up_proj_block)
                w2 = dequantize(w2, ex.down_proj_scale, x.dtype, ex.down_proj_block)
            out = experts_reference(x, *self.route(logits), w13, w2, self.act, b13, b2)
        return out

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference of the layer's routing: [T, E] logits -> (weights [T, k] float32, ids [T, k])."""
        if self.routing.plain:
            return route(logits, self.top_k, self.renormalize)
        if self.routing.scoring == "softmax":
            return route_grouped(logits, self.top_k, self.renormalize, self.routing)
        return route_sigmoid(logits, self.gate.e_score_correction_bias, self.top_k, self.renormalize, self.routing)

    def expert_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The experts' gate/up and down biases ([E, 2 I/tp], [E, H]), None where the family has none."""
        return None, None


class SharedExpertMoE(FusedMoE):
    """The routed experts plus a dense gated MLP every token takes (`shared_expert`, sharded as a dense MLP). Qwen2-MoE
    (gated): its output scaled by sigmoid(shared_expert_gate(x)) (replicated, [1, H]), as HF's
    Qwen2MoeSparseMoeBlock; GLM-4.5 (not gated): added as it is, as HF's Glm4MoeMoE (its n_shared_experts as one MLP
    of n times the width)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, renormalize: bool,
                 shared_intermediate: int, act: str = "silu", tp: TPGroup = SINGLE, routing: Routing = Routing(),
                 gated: bool = True) -> None:
        super().__init__(num_experts, top_k, hidden, intermediate, renormalize, act, tp, routing)
        if shared_intermediate % tp.size:
            raise ValueError(f"the shared expert's intermediate size {shared_intermediate} is not divisible by "
                             f"tensor_parallel_size {tp.size}")
        from picovllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
        self.shared_expert = nn.Module()
        self.shared_expert.gate_up_proj = MergedColumnParallelLinear(hidden, [shared_intermediate] * 2, tp=tp)
        self.shared_expert.down_proj = RowParallelLinear(shared_intermediate, hidden, tp=tp, reduce=False)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if gated else None
        if gated:
            self.shared_expert_gate.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert.down_proj(self.act(self.shared_expert.gate_up_proj(x)))   # a partial sum
        if self.shared_expert_gate is not None:
            # the gate is replicated: gate * (sum of the ranks' parts) = sum of gate * part, one all-reduce for both
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.tp.all_reduce(self.routed(x) + shared)

