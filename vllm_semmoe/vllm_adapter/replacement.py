"""Apply a placement transparently, at weight-load time.

Logical expert ``e`` of MoE layer ``l`` is loaded into physical slot ``l2p[l, e]`` and the
gate's output row ``p`` is the checkpoint's row ``p2l[l, p]``, so router logits come out in
physical order and every kernel, expert map and all-to-all sees physical ids. vLLM's
``linear`` expert map puts slots ``r*n .. (r+1)*n-1`` on EP rank ``r``, so each rank loads
exactly the experts the placement gives it. Nothing changes at run time: the model computes
the same function (permutation of experts and logits together).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..placement import Placement
from .config import SemMoEConfigError


def moe_runners(model: torch.nn.Module) -> list:
    """The model's MoE layers (vLLM ``MoERunner`` modules) in forward order."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return [m for m in model.modules() if isinstance(m, MoERunner)]


def check_model_shape(runners: list, num_layers: int, num_experts: int, what: str) -> None:
    """Raise :class:`SemMoEConfigError` if the model's MoE shape differs from ``what``'s."""
    if not runners:
        raise SemMoEConfigError("semmoe: the model has no MoE layers (no vLLM MoERunner found)")
    model_experts = {int(r.routed_experts.global_num_experts) for r in runners}
    problems = []
    if len(runners) != num_layers:
        problems.append(f"{num_layers} MoE layers (model has {len(runners)})")
    if model_experts != {num_experts}:
        problems.append(f"{num_experts} experts per layer (model has {sorted(model_experts)})")
    if problems:
        raise SemMoEConfigError(f"semmoe: {what} built for another model: " + "; ".join(problems))


def install_placement(runners: list, placement: Placement) -> None:
    """Wrap the gate and expert weight loaders of every MoE layer with the permutation.

    Must run after the model is built and before its weights are loaded.
    """
    check_model_shape(runners, placement.num_layers, placement.num_experts, "tables")
    p2l = placement.physical_to_logical()
    l2p = placement.logical_to_physical()
    for layer, runner in enumerate(runners):
        strategy = getattr(runner.routed_experts, "expert_placement_strategy", "linear")
        if str(strategy).lower().split(".")[-1] not in ("linear", "none"):
            raise SemMoEConfigError(
                f"semmoe: needs vLLM's linear expert placement, got {strategy!r}; "
                "drop --expert-placement-strategy"
            )
        gate = getattr(runner, "gate", None)
        if gate is None or not hasattr(gate, "weight"):
            raise SemMoEConfigError(
                f"semmoe: MoE layer {layer} computes router logits outside vLLM's MoERunner; "
                "this model is not supported yet"
            )
        rows = torch.from_numpy(p2l[layer].copy())
        _wrap_loader(gate.weight, lambda loader, param, w, *a, rows=rows, **k: loader(param, w[rows.to(w.device)], *a, **k))
        mapping = l2p[layer].tolist()
        for name in ("w13_weight", "w2_weight"):
            param = getattr(runner.routed_experts, name)
            _wrap_loader(param, functools.partial(_load_expert, mapping))


def _load_expert(mapping, loader, param, loaded_weight, weight_name, shard_id, expert_id, *args, **kwargs):
    return loader(param, loaded_weight, weight_name, shard_id, mapping[int(expert_id)], *args, **kwargs)


def _wrap_loader(param, wrapper) -> None:
    loader = param.weight_loader
    if getattr(loader, "_semmoe_wrapped", False):
        raise RuntimeError("semmoe: placement installed twice on the same layer")

    def wrapped(*args, **kwargs):
        return wrapper(loader, *args, **kwargs)

    wrapped._semmoe_wrapped = True
    param.weight_loader = wrapped


def physical_to_logical_ids(topk_ids: np.ndarray, p2l: np.ndarray) -> np.ndarray:
    """Map captured physical expert ids ``[T, K]`` of one layer back to logical ids."""
    return p2l[topk_ids]


def local_expert_fingerprints(worker) -> list[list[float]]:
    """Per MoE layer, the sum of each local expert's ``w2`` weights on this rank (in local slot
    order); for tests that check which experts a rank loaded. Usable with ``collective_rpc``.
    """
    runner = getattr(worker, "model_runner", worker)
    return [[float(w.float().sum()) for w in layer.routed_experts.w2_weight]
            for layer in moe_runners(runner.get_model())]
