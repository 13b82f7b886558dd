"""vLLM's fused MoE layers: what the plugin replaces there.

Class-level (CPU fixes, installed with :mod:`..cpu_fixes` on the CPU platform for the vLLM
versions with the bugs):

- ``CPUUnquantizedExperts.apply`` passes the router's *global* expert ids to the CPU kernel and
  ignores ``expert_map``; under expert parallelism each rank holds ``E / ep_size`` experts, so
  the kernel indexes past its weights (a segfault, or silently wrong output). The fix maps the
  ids through ``expert_map`` (:func:`localize_topk`).
- ``MoERunner._select_forward``: on CPU the runner calls its MoE function directly, so Dynamo
  traces the DP gather/scatter into the graph with one step's token counts. The fix makes
  data-parallel (or sequence-parallel) MoE layers call vLLM's opaque
  ``torch.ops.vllm.moe_forward`` op, as CUDA vLLM always does.

What each engine changes on its own MoE layers (the plugin's custom op as the layer's forward,
the TP shuffle's routed-experts stage, the DP + EP prepare/finalize stage, the placement's id
map after top-k and its per-expert weight loaders) is listed in
:data:`vllm_semmoe.vllm_adapter.patches.LAYER_HOOKS`; the DP + EP stages are in
:mod:`.prepare_finalize`.
"""

from __future__ import annotations

import functools

from .base import Patch


def localize_topk(topk_weights, topk_ids, expert_map, apply_router_weight_on_input: bool):
    """Map global ``topk_ids`` to this rank's expert slots.

    Returns ``(weights, local_ids, apply_router_weight_on_input)`` for the kernel: pairs routed
    to experts of other ranks (``expert_map == -1``; also any negative id) get weight 0 and
    local id 0. When the router weight was already applied to the input (the kernel would then
    skip the weights), the weights become the 0/1 locality mask and the kernel is told to apply
    them, which multiplies local pairs by 1 and remote pairs by 0.
    """
    import torch

    ids = topk_ids.long()
    n_map = expert_map.numel()
    local = expert_map.to(device=topk_ids.device)[ids.clamp(0, n_map - 1)]
    is_local = (local >= 0) & (ids >= 0) & (ids < n_map)
    local_ids = local.clamp_min(0).to(topk_ids.dtype).contiguous()
    if apply_router_weight_on_input:
        weights = is_local.to(topk_weights.dtype).contiguous()
        return weights, local_ids, False
    weights = torch.where(is_local, topk_weights, torch.zeros_like(topk_weights)).contiguous()
    return weights, local_ids, apply_router_weight_on_input


def _make_ep_apply(original):
    """Wrap ``CPUUnquantizedExperts.apply`` (0.32 signature) to honour ``expert_map``."""

    @functools.wraps(original)
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        if expert_map is not None:
            topk_weights, topk_ids, apply_router_weight_on_input = localize_topk(
                topk_weights, topk_ids, expert_map, apply_router_weight_on_input)
            expert_map = None  # ids are local now: never map them twice
        return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
                        activation, global_num_experts, expert_map, a1q_scale, a2_scale,
                        workspace13, workspace2, expert_tokens_meta,
                        apply_router_weight_on_input)

    apply.__semmoe_original__ = original
    return apply


def _make_select_forward(original):
    """Wrap ``MoERunner._select_forward``: DP (or sequence-parallel) MoE layers use the opaque
    ``torch.ops.vllm.moe_forward[_shared]`` op instead of the traced function."""

    @functools.wraps(original)
    def _select_forward(self):
        entry = original(self)
        config = self.moe_config
        if getattr(config, "dp_size", 1) > 1 or getattr(config, "is_sequence_parallel", False):
            import torch

            return torch.ops.vllm.moe_forward if self.shared_experts is None else torch.ops.vllm.moe_forward_shared
        return entry

    _select_forward.__semmoe_original__ = original
    return _select_forward


EXPERT_MAP_APPLY = Patch(
    "vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts.apply",
    "CPU fix: honour expert_map under expert parallelism (the CPU kernel takes global expert ids)",
    _make_ep_apply)
DP_OPAQUE_MOE = Patch(
    "vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner._select_forward",
    "CPU fix: data-parallel MoE layers run vLLM's opaque MoE op, so compiled models gather each step's sizes",
    _make_select_forward)

PATCHES = (EXPERT_MAP_APPLY, DP_OPAQUE_MOE)
