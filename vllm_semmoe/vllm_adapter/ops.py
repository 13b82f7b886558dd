"""The plugin's custom ops: Sem-MoE's per-step work as opaque operators of the compiled model.

vLLM compiles the model (Dynamo traces it once; CUDA vLLM also captures CUDA graphs). Python
inside a traced function runs once, at trace time, and is gone afterwards; so whatever must
happen on every step (read the step's tokens, schedule them, exchange rows of a varying size)
runs inside an operator the compiler treats as a black box, the way vLLM treats attention:

- ``semmoe::decoder_layer(positions, hidden_states, residual, layer_name)``: a Qwen3-MoE-style
  decoder layer with the TP shuffle fused into its collectives (:func:`.tp_shuffle.fused_decoder_forward`);
- ``semmoe::moe_layer(hidden_states, router_logits, layer_name)``: a MoE layer with the TP
  shuffle at its boundary (vLLM's MoE layer, eagerly, whose routed-experts stage is
  :class:`.tp_shuffle.ShuffledRoutedExperts`).

``layer_name`` is the MoE layer's vLLM name; the op finds the layer in vLLM's forward context,
the engine's :class:`~.state.EngineState` from the layer, and the step context in the state.
Outside a real step (warm-up, profiling, dummy batches) or on a padded batch, the op runs
vLLM's own forward of that layer, eagerly. Piecewise CUDA graphs must leave these ops out
(:data:`SPLITTING_OPS`); full CUDA graphs cannot run them (refused at engine start).
"""

from __future__ import annotations

import functools
import time

import torch

from . import compat
from .state import state_of

#: ops piecewise CUDA graphs must split at (plus vLLM's MoE op when routing is captured)
SPLITTING_OPS = ("semmoe::decoder_layer", "semmoe::moe_layer")
CAPTURE_SPLITTING_OPS = ("vllm::moe_forward", "vllm::moe_forward_shared")

_LIBRARY = None


def register_ops() -> None:
    """Define the ``semmoe`` ops once per process."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("semmoe", "FRAGMENT")
    compat.register_op(library, "decoder_layer", _decoder_layer, _decoder_layer_fake,
                       mutates_args=("hidden_states", "residual"))
    compat.register_op(library, "moe_layer", _moe_layer, _moe_layer_fake, mutates_args=("hidden_states",))
    _LIBRARY = library  # the ops live as long as their library object


def _not_aliasing(out: torch.Tensor, *inputs) -> torch.Tensor:
    """Custom ops may not return their inputs: copy when vLLM's forward handed one back."""
    for x in inputs:
        if x is not None and out.data_ptr() == x.data_ptr():
            return out.clone()
    return out


def _lookup(layer_name: str):
    runner = compat.layer_by_name(layer_name)
    state = state_of(runner)
    if state is None:
        raise RuntimeError(f"semmoe: MoE layer {layer_name} runs a Sem-MoE op but its engine has no "
                           "Sem-MoE state (the engine was shut down?)")
    return runner, state


def _decoder_layer(positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                   layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    from . import tp_shuffle

    _, state = _lookup(layer_name)
    decoder = state.fused[layer_name]()
    step = state.step
    if step is None or hidden_states.shape[0] != len(step.rows):
        out, res = type(decoder).forward(decoder, positions, hidden_states, residual)
    else:
        start = time.perf_counter()
        out, res = tp_shuffle.fused_decoder_forward(decoder, state.tp_layers[layer_name], positions,
                                                    hidden_states, residual, step)
        step.counters["moe_layer_s"] += time.perf_counter() - start
    return _not_aliasing(out, hidden_states, residual), _not_aliasing(res, hidden_states, residual)


def _decoder_layer_fake(positions, hidden_states, residual, layer_name):
    return torch.empty_like(hidden_states), torch.empty_like(hidden_states)


def _moe_layer(hidden_states: torch.Tensor, router_logits: torch.Tensor, layer_name: str) -> torch.Tensor:
    runner, state = _lookup(layer_name)
    step = state.step
    if step is None or hidden_states.shape[0] != len(step.rows):
        return _not_aliasing(compat.moe_forward_eager(runner, hidden_states, router_logits), hidden_states)
    start = time.perf_counter()  # the routed experts shuffle this step (.tp_shuffle.ShuffledRoutedExperts)
    out = compat.moe_forward_eager(runner, hidden_states, router_logits)
    step.counters["moe_layer_s"] += time.perf_counter() - start
    return _not_aliasing(out, hidden_states)


def _moe_layer_fake(hidden_states, router_logits, layer_name):
    return torch.empty_like(hidden_states)


# ---- forwards installed on the engine's modules (traced by the compiler) ---------------------
def decoder_forward(layer_name: str, positions, hidden_states, residual):
    return torch.ops.semmoe.decoder_layer(positions, hidden_states, residual, layer_name)


def moe_forward(layer_name: str, hidden_states, router_logits, *args, **kwargs):
    return torch.ops.semmoe.moe_layer(hidden_states, router_logits, layer_name)


def install_decoder_op(decoder, layer_name: str) -> None:
    """Route ``decoder``'s forward through ``semmoe::decoder_layer``."""
    decoder.forward = functools.partial(decoder_forward, layer_name)


def install_moe_op(runner, layer_name: str) -> None:
    """Route the MoE layer ``runner``'s forward through ``semmoe::moe_layer``."""
    runner.forward = functools.partial(moe_forward, layer_name)
