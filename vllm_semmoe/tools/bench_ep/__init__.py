"""Expert-parallel MoE-layer benchmark over ``torch.distributed``, replaying real routing.

``semmoe eval`` *counts* remote activations offline. This module *moves* them: it spawns one
process per EP rank, gives every rank its ``N/E`` experts of every MoE layer (a small real
down/up MLP each), plus, with ``redundant=R``, copies of the ``R`` experts per layer that the
placement replicates there (``N/E + R`` expert slots, vLLM EPLB's layout), places tokens on
ranks exactly as :mod:`.evaluate` schedules them, and runs each MoE layer as a standard EP
layer would:

1. **dispatch** — every token is sent once to every *remote* rank that computes at least one
   of its top-k experts (per-destination deduplication, as in DeepEP / vLLM's all2all
   managers); experts with a copy on the token's own rank are computed there without
   communication, and a remote expert with several copies is computed by the copy
   :meth:`~vllm_semmoe.core.placement.Placement.serving_device` picks (one on a rank the token goes
   to anyway, else vLLM EPLB's position-modulo spread). The
   per-destination row counts are exchanged first (``all_to_all_single`` of int64), then the
   routing metadata of the sent rows (expert ids and gate weights), then the hidden rows
   themselves (``all_to_all_single`` with uneven ``input_split_sizes``/``output_split_sizes``);
2. **experts** — each rank applies its local experts to its own tokens and to the rows it
   received, weighting every output by the token's gate weight;
3. **combine** — for every row it received, a rank returns one partial sum (the weighted sum
   of its experts' outputs for that token) through the reverse ``all_to_all_single``; the
   token's home rank adds the partial sums to its local result.

What is reported, per method (placement + its data scheduling):

- bytes of hidden-state rows actually handed to ``all_to_all_single`` for other ranks,
  dispatch and combine (``element_size × rows × hidden``), per layer and as ``[src, dst]``
  matrices, as sent and as received (they must agree: conservation); the count exchange and
  the routing metadata are counted apart (``metadata_bytes``), not in the headline;
- the same counts derived analytically from the routing (``analytic_match``), so that the
  measured volume is shown to be exactly what the routing implies;
- ``lar`` (local (token, expert) activations / all) and ``remote_pairs`` (the number of
  (token, layer, remote rank) pairs, i.e. rows dispatched), plus the per-activation remote
  share relative to vanilla (``activation_ratio_vs_vanilla``) beside the deduplicated byte
  ratio (``bytes_ratio_vs_vanilla``, the headline);
- wall time per layer: after a barrier, each rank times dispatch + experts + combine; a
  layer's time is the slowest rank's, averaged over batches and layers (``layer_ms``).

Data scheduling is :mod:`vllm_semmoe.core.schedulers`' (``tp_devices`` / ``dp_ranks``):

- **TP** — batches of ``batch_tokens`` consecutive evaluation tokens; ``semmoe`` places each
  token per layer with Sem-MoE's TP scheduler and its tables, baselines use the
  reduce-scatter's contiguous equal slices (token ``i`` → rank ``i // ceil(B/E)``).
- **DP** — each request stays on one rank for all layers (``semmoe``: T2D votes +
  ``dp_assign``; baselines: round-robin by request). DP ranks run lock-stepped, each with a
  step budget of ``ceil(batch_tokens / E)`` tokens taken from its own queue of requests (in
  arrival order), so one benchmark batch is ``batch_tokens`` tokens over all ranks.

Hidden states are random but deterministic per (token, layer) (rows of a seeded pool), as
are the gate weights and every expert's weights (seeded by layer and logical expert id), so
that on the first batch of every method each rank checks its combined output against a
single-process reference computed from all experts (``check_max_rel_err``).

Nothing here imports vLLM. Heavy imports (policies, Numba) happen in the parent only.

Modules by job: :mod:`.plan` (solve and schedule, analytic counts), :mod:`.worker` (one rank),
:mod:`.report` (aggregation, self-checks, table), :mod:`.run` (spawn and collect); the command
line is :mod:`vllm_semmoe.cli.bench`.
"""

from __future__ import annotations

from .plan import DEFAULT_METHODS, BenchPlan, analytic_counts, plan_bench_ep
from .report import CHECK_TOL, BenchEPError, format_bench_ep
from .run import run_bench_ep

__all__ = ["CHECK_TOL", "DEFAULT_METHODS", "BenchEPError", "BenchPlan", "analytic_counts", "format_bench_ep",
           "plan_bench_ep", "run_bench_ep"]
