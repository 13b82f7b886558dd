"""vLLM's DP + EP prepare/finalize stage: the sparse EP exchange and the meter, as subclasses.

Under data parallelism with expert parallelism, vLLM's modular MoE kernel moves tokens in its
prepare/finalize stage (``FusedMoEPrepareAndFinalizeModular``, the interface DeepEP, pplx and
flashinfer plug into). Without all-to-all kernels that stage is
``MoEPrepareAndFinalizeNaiveDPEPModular`` (all-gather, reduce-scatter). The two classes here
are that class with:

- :class:`SparsePrepareAndFinalize`: the project's EP exchange (each token sent once to every
  other rank holding one of its experts; see :mod:`..ep_dispatch`);
- :class:`MeteredPrepareAndFinalize`: vLLM's own exchange, its bytes counted.

:func:`install_stages` puts one of them in the kernel of every MoE layer of an engine whose
stage is vLLM's all-gather one, once, before the model's first forward (vLLM builds the kernels
when the weights load); a layer that moves its tokens another way is reported unmetered.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...kernels.ep_exchange import EpExchange, send_plan
from .. import compat
from ..ep_dispatch import EXCHANGE_KEYS, comm_for, unmetered_reason
from ..replacement import is_monolithic

_AllGatherStage = compat.allgather_stage_class()


class _CountingStage(_AllGatherStage):
    """vLLM's all-gather stage built with the settings of the layer's own stage (``stage``),
    adding to ``counters_of()`` (the engine's counters while it serves, a scratch dict in warm-up)."""

    def __init__(self, stage, counters_of: Callable[[], dict]):
        super().__init__(is_sequence_parallel=stage.is_sequence_parallel, num_dispatchers=stage.num_dispatchers())
        self._counters_of = counters_of


class SparsePrepareAndFinalize(_CountingStage):
    """vLLM's all-gather prepare/finalize stage with the sparse EP exchange. State between
    ``prepare`` and ``finalize`` of one forward: the exchange, the send order, the split sizes
    and this rank's row count."""

    def __init__(self, stage, counters_of: Callable[[], dict]):
        super().__init__(stage, counters_of)
        self._pending = None

    def allocate_fused_expert_output(self, *args, **kwargs):
        return None  # the experts' own buffer (the all-gather stage's is sized for the gathered batch)

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant: bool = False):
        """Send each row of ``a1`` ``[m, H]`` to the other ranks holding one of its ``topk_ids``
        ``[m, K]``; return vLLM's prepare result for ``[m + received]`` rows (own rows first)."""
        if apply_router_weight_on_input:
            assert topk_ids.size(1) == 1, "apply_router_weight_on_input is only implemented for topk=1"
            a1 = a1 * topk_weights.to(a1.dtype)
        if getattr(quant_config, "quant_dtype", None) == "nvfp4":
            raise NotImplementedError("semmoe: the sparse EP dispatch does not carry NVFP4 activation scales; "
                                      "serve this model with --dispatch vllm")
        a1q, a1q_scale = compat.quantize_for_dispatch(a1, quant_config, defer_input_quant)
        group = compat.ep_group()
        rank, world = group.rank_in_group, group.world_size
        m = a1.shape[0]
        dest = topk_ids.long() // (num_experts // world)  # [m, K] rank holding each chosen expert
        order, send_counts = send_plan(dest, rank, world)
        xchg = EpExchange(comm_for(group, a1q.device))
        sends = send_counts.tolist()
        recvs = xchg.exchange_counts(send_counts)
        recv_x = xchg.dispatch(a1q.index_select(0, order), sends, recvs)
        recv_ids = xchg.dispatch(topk_ids.index_select(0, order), sends, recvs, metadata=True)
        recv_w = xchg.dispatch(topk_weights.index_select(0, order), sends, recvs, metadata=True)
        if a1q_scale is not None and a1q_scale.ndim > 0 and a1q_scale.shape[0] == m:  # per-token scales
            a1q_scale = torch.cat([a1q_scale, xchg.dispatch(a1q_scale.index_select(0, order), sends, recvs,
                                                            metadata=True)])
        self._pending = (xchg, order, sends, recvs, m)
        counters = self._counters_of()
        local = int((dest == rank).sum())
        counters["local_activations"] += local
        counters["remote_activations"] += dest.numel() - local
        counters["tokens"] += m
        counters["layers_run"] += 1
        return (torch.cat([a1q, recv_x]), a1q_scale, None, torch.cat([topk_ids, recv_ids]),
                torch.cat([topk_weights, recv_w]))

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl) -> None:
        """Reduce each row over its top-k, send the received rows' partial sums home, add them
        to this rank's own rows, write ``output`` ``[m, H]``."""
        xchg, order, sends, recvs, m = self._pending
        self._pending = None
        reduced = compat.weight_and_reduce(weight_and_reduce_impl, fused_expert_output, topk_weights, topk_ids,
                                           apply_router_weight_on_input)
        back = xchg.combine(reduced[m:].contiguous(), sends, recvs)
        mine = reduced[:m]
        if order.numel():
            mine = mine.index_add(0, order, back.to(mine.dtype))
        output.copy_(mine)
        counters = self._counters_of()
        for key in EXCHANGE_KEYS:
            counters[key] += getattr(xchg.counters, key)


class MeteredPrepareAndFinalize(_CountingStage):
    """vLLM's all-gather prepare/finalize stage, unchanged, with its bytes counted."""

    def __init__(self, stage, counters_of: Callable[[], dict]):
        super().__init__(stage, counters_of)
        self._rows: list[tuple[int, int]] = []  # (own rows, gathered rows) of each pending prepare

    def prepare(self, a1, topk_weights, topk_ids, num_experts, *args, **kwargs):
        group = compat.ep_group()
        rank, world = group.rank_in_group, group.world_size
        counters = self._counters_of()
        local = int((topk_ids.long() // (num_experts // world) == rank).sum())
        counters["local_activations"] += local
        counters["remote_activations"] += topk_ids.numel() - local
        result = super().prepare(a1, topk_weights, topk_ids, num_experts, *args, **kwargs)
        a1q, a1q_scale, _, ids, weights = result
        m, total = a1.shape[0], a1q.shape[0]
        counters["dispatch_bytes"] += m * _row_bytes(a1q) * (world - 1)
        meta = _row_bytes(ids) + _row_bytes(weights)
        if a1q_scale is not None and a1q_scale.ndim > 0 and a1q_scale.shape[0] == total:
            meta += _row_bytes(a1q_scale)
        counters["metadata_bytes"] += m * meta * (world - 1)
        counters["tokens"] += m
        counters["layers_run"] += 1
        self._rows.append((m, total))
        return result

    def finalize(self, output, *args, **kwargs):
        m, total = self._rows.pop() if self._rows else (output.shape[0], output.shape[0])
        self._counters_of()["combine_bytes"] += (total - m) * output.shape[-1] * output.element_size()
        return super().finalize(output, *args, **kwargs)


def _row_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size() // max(t.shape[0], 1)


def use_stage(runner, make: Callable, on_unmetered: Callable[[str], None], sparse: bool = False) -> None:
    """Give the MoE layer ``runner``'s kernel the stage ``make(stage)`` when its stage is vLLM's
    all-gather one; otherwise keep vLLM's way and report the layer unmetered to
    ``on_unmetered(reason)`` (``sparse``: the sparse dispatch was asked for)."""
    experts = runner.routed_experts
    layer = getattr(runner, "layer_name", "?")
    if is_monolithic(experts.quant_method):
        on_unmetered(unmetered_reason(layer, None, monolithic=True, sparse=sparse))
        return
    stage = compat.prepare_finalize(experts)
    if compat.is_allgather_stage(stage):
        compat.set_prepare_finalize(experts, make(stage))
    else:
        on_unmetered(unmetered_reason(layer, None if stage is None else type(stage).__name__,
                                      runner_all_gathers=compat.runner_dispatches_itself(runner), sparse=sparse))


def install_stages(model: torch.nn.Module, runners: list, sparse: bool, counters_of: Callable[[], dict],
                   on_unmetered: Callable[[str], None]) -> None:
    """Give the MoE layers ``runners`` of ``model`` the sparse (``sparse``) or metered stage
    (:func:`use_stage`), right before the model's first forward (vLLM's profiling run: the
    kernels exist then), and make them run vLLM's opaque MoE op (the exchange's sizes vary per
    step: it stays out of compiled graphs)."""
    stage_class = SparsePrepareAndFinalize if sparse else MeteredPrepareAndFinalize

    def hook(module, args):
        handle.remove()
        for runner in runners:
            use_stage(runner, lambda stage: stage_class(stage, counters_of), on_unmetered, sparse=sparse)

    handle = model.register_forward_pre_hook(hook)
    for runner in runners:
        compat.use_opaque_moe_op(runner)
