"""A cost model of one expert-parallel MoE layer on named hardware.

LAR and byte counts say how much traffic a placement saves; they do not say whether the time
saved on the all-to-all is eaten by a more loaded straggler rank in the expert computation.
This module turns per-step, per-layer counts into a modelled MoE-layer time:

- **all-to-all** (dispatch, then combine, each one bulk exchange, the α-β model): every rank
  sends and receives at once, to all peers in parallel, over its own links; a rank's exchange
  takes ``bytes / bandwidth`` per link class (NVLink inside a node, the network between
  nodes, used at the same time; the slower one bounds it), and the exchange ends when the
  slowest rank is done, plus one fixed latency (the network's when the EP group spans nodes).
- **experts**: rank ``r`` computes ``activations[r]`` (token, expert) pairs — its own tokens'
  local experts and the rows it received — at ``flops_per_activation / (peak × efficiency)``
  seconds each. The layer waits for the straggler rank.

``time = dispatch + experts(straggler) + combine``. ``experts_mean`` (the same work spread
evenly) is reported beside it, so ``experts - experts_mean`` is what expert imbalance costs.

Inputs are plain arrays (no vLLM, no torch):

- ``rows[S, L, E, E]``: token rows rank ``src`` sends to rank ``dst`` in step ``s`` at layer
  ``l`` (a token is sent once per remote rank holding any of its experts; the diagonal is
  ignored). Combine returns the same rows (``rows.T``).
- ``activations[S, L, E]``: (token, expert) pairs computed on each rank.

Hardware parameter sets (:data:`HARDWARE`) are documented where they are defined; they are
nominal link figures, not measurements, and say so in their ``source``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Hardware:
    """A named EP deployment: the EP group is spread evenly over ``nodes`` nodes; GPUs of a node
    share NVLink, nodes talk over the network.

    Bandwidths are bytes/s per GPU per direction; latencies are seconds per exchange.
    """

    name: str
    nodes: int
    nvlink_bytes_s: float
    network_bytes_s: float
    nvlink_latency_s: float
    network_latency_s: float
    peak_flops: float  # dense bf16 FLOP/s of one GPU
    efficiency: float  # share of peak the grouped expert GEMMs reach
    source: str


#: Named parameter sets (nominal figures, not measurements). H100 SXM: 900 GB/s NVLink 4 per GPU
#: (450 GB/s per direction), 989 TFLOP/s dense bf16; 400 Gb/s = 50 GB/s per GPU per direction
#: (one ConnectX-7 InfiniBand port per GPU). The latencies (10 µs per exchange inside a node,
#: 20 µs across nodes) and the 40 % of peak that grouped expert GEMMs reach are assumptions of
#: this model, stated here so that a reader can change them.
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("1-node-nvlink", 1, 450e9, 450e9, 10e-6, 10e-6, 989e12, 0.4,
                 "one node of H100 SXM: NVLink 4, 900 GB/s per GPU (450 GB/s per direction), "
                 "989 TFLOP/s bf16, 40% of peak in expert GEMMs"),
        Hardware("2-node-ib400", 2, 450e9, 50e9, 10e-6, 20e-6, 989e12, 0.4,
                 "the EP group split over 2 nodes of H100 SXM: NVLink inside a node, "
                 "400 Gb/s InfiniBand per GPU between nodes"),
    )
}


@dataclass(frozen=True)
class MoEShape:
    """What one (token, expert) activation costs: bytes on the wire and FLOPs."""

    hidden: int
    expert_intermediate: int
    dispatch_bytes_per_element: float = 2.0  # bf16 rows out
    combine_bytes_per_element: float = 2.0  # bf16 partial sums back

    @property
    def flops_per_activation(self) -> float:
        """Gate, up and down projections of one expert for one token: ``3 × 2 × H × I``."""
        return 6.0 * self.hidden * self.expert_intermediate


#: DeepSeek-V2-Lite's routed experts (hidden 2048, expert intermediate 1408).
DSV2_LITE = MoEShape(hidden=2048, expert_intermediate=1408)


def exchange_seconds(rows: np.ndarray, row_bytes: float, hw: Hardware) -> np.ndarray:
    """Time of one bulk all-to-all per step and layer.

    Args:
        rows: ``[S, L, E, E]`` rows sent ``src → dst`` (diagonal ignored).
        row_bytes: bytes of one row.
    Returns:
        ``[S, L]`` seconds: the slowest rank's ``max(send, receive)`` time over its link
        classes, plus one exchange latency.
    """
    rows = np.asarray(rows, dtype=np.float64)
    E = rows.shape[-1]
    if E % hw.nodes:
        raise ValueError(f"EP size {E} cannot be spread evenly over {hw.nodes} nodes ({hw.name})")
    off = rows * (1.0 - np.eye(E))
    node = np.arange(E) // (E // hw.nodes)
    same = node[:, None] == node[None, :]
    seconds = np.zeros(rows.shape[:-2] + (E,))
    for mask, bw in ((same, hw.nvlink_bytes_s), (~same, hw.network_bytes_s)):
        part = off * mask
        send = part.sum(axis=-1) * row_bytes  # [S, L, E(src)]
        recv = part.sum(axis=-2) * row_bytes  # [S, L, E(dst)]
        seconds = np.maximum(seconds, np.maximum(send, recv) / bw)
    latency = hw.network_latency_s if hw.nodes > 1 else hw.nvlink_latency_s
    return seconds.max(axis=-1) + latency


def moe_layer_cost(rows: np.ndarray, activations: np.ndarray, tokens: int, shape: MoEShape,
                   hw: Hardware) -> dict:
    """Modelled MoE time per token, summed over all steps and layers.

    Args:
        rows: ``[S, L, E, E]`` dispatched rows per step, layer, source and destination rank.
        activations: ``[S, L, E]`` (token, expert) pairs computed per rank.
        tokens: tokens processed (each counted once, not per layer).
    Returns:
        microseconds per token: ``dispatch_us``, ``combine_us``, ``experts_us`` (straggler),
        ``experts_mean_us`` (perfectly balanced), ``total_us``, ``imbalance_cost_us``
        (``experts - experts_mean``), and ``compute_imbalance`` (straggler / mean work).
    """
    rows = np.asarray(rows)
    acts = np.asarray(activations, dtype=np.float64)
    if rows.ndim != 4 or rows.shape[-1] != rows.shape[-2] or acts.shape != rows.shape[:-1]:
        raise ValueError(f"rows must be [S, L, E, E] and activations [S, L, E]; got {rows.shape}, {acts.shape}")
    per_act = shape.flops_per_activation / (hw.peak_flops * hw.efficiency)
    dispatch = exchange_seconds(rows, shape.hidden * shape.dispatch_bytes_per_element, hw).sum()
    combine = exchange_seconds(np.swapaxes(rows, -1, -2), shape.hidden * shape.combine_bytes_per_element, hw).sum()
    experts = acts.max(axis=-1).sum() * per_act
    experts_mean = acts.mean(axis=-1).sum() * per_act
    scale = 1e6 / max(int(tokens), 1)
    return {
        "dispatch_us": float(dispatch * scale),
        "combine_us": float(combine * scale),
        "experts_us": float(experts * scale),
        "experts_mean_us": float(experts_mean * scale),
        "imbalance_cost_us": float((experts - experts_mean) * scale),
        "total_us": float((dispatch + combine + experts) * scale),
        "compute_imbalance": float(acts.max(axis=-1).sum() / max(acts.mean(axis=-1).sum(), 1e-12)),
    }


def cost_table(counts: dict, shape: MoEShape = DSV2_LITE, hardware=tuple(HARDWARE)) -> dict:
    """Model every method on every named hardware set.

    Args:
        counts: ``{method: {"step_rows": [S, L, E, E], "activations_per_rank": [S, L, E],
            "tokens": int, ...}}`` (what :func:`vllm_semmoe.bench_ep.analytic_counts` returns).
        shape: the MoE layer's shape; ``hardware``: names in :data:`HARDWARE`.
    Returns:
        ``{hardware_name: {method: moe_layer_cost(...) + {"time_ratio_vs_vanilla"}}}``.
    """
    unknown = [h for h in hardware if h not in HARDWARE]
    if unknown:
        raise ValueError(f"unknown hardware {', '.join(unknown)}; choose from {', '.join(HARDWARE)}")
    out = {}
    for name in hardware:
        rows = {m: moe_layer_cost(c["step_rows"], c["activations_per_rank"], c["tokens"], shape, HARDWARE[name])
                for m, c in counts.items()}
        base = rows.get("vanilla")
        for row in rows.values():
            row["time_ratio_vs_vanilla"] = row["total_us"] / base["total_us"] if base and base["total_us"] else None
        out[name] = rows
    return out


def format_cost_table(table: dict, shape: MoEShape) -> str:
    """Plain-text table: one block per hardware set, one row per method (µs per token)."""
    cols = ("dispatch_us", "combine_us", "experts_us", "imbalance_cost_us", "total_us", "time_ratio_vs_vanilla")
    lines = [f"modelled MoE time per token (all layers), hidden {shape.hidden}, expert intermediate "
             f"{shape.expert_intermediate}"]
    for name, rows in table.items():
        lines.append(f"{name}: {HARDWARE[name].source}")
        lines.append(f"  {'method':<12}" + "".join(f"{c:>{len(c) + 2}}" for c in cols))
        for method, row in rows.items():
            cells = "".join(f"{(row[c] if row[c] is not None else float('nan')):>{len(c) + 2}.3f}" for c in cols)
            lines.append(f"  {method:<12}{cells}")
    return "\n".join(lines)


def step_counts(serving: np.ndarray, token_device: np.ndarray, offsets: np.ndarray,
                ep_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-step dispatch rows and per-rank activations implied by routing and a schedule.

    Args:
        serving: ``[T, L, K]`` rank computing each activation of each scheduled token
            (:meth:`vllm_semmoe.placement.Placement.serving_device`: the expert's home rank, or
            the token's own rank where it holds a replica).
        token_device: ``[T, L]`` rank each token sits on at each layer.
        offsets: ``[S + 1]`` step boundaries into the token axis.
        ep_size: E.
    Returns:
        ``rows [S, L, E, E]`` (tokens rank ``src`` sends to ``dst``: at least one of its
        activations computed there, ``src != dst``) and ``activations [S, L, E]`` (pairs
        computed on each rank).
    """
    ed = np.asarray(serving, dtype=np.int64)
    dev = np.asarray(token_device, dtype=np.int64)
    T, L, K = ed.shape
    E = int(ep_size)
    present = np.zeros((T, L, E), bool)
    np.put_along_axis(present, ed, True, axis=2)
    step = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    S = len(offsets) - 1
    rows = np.zeros((S, L, E, E), np.int64)
    t, l, d = np.nonzero(present)
    np.add.at(rows, (step[t], l, dev[t, l], d), 1)
    rows[:, :, np.arange(E), np.arange(E)] = 0
    activations = np.zeros((S, L, E), np.int64)
    np.add.at(activations, (np.repeat(step, L * K), np.tile(np.repeat(np.arange(L), K), T), ed.ravel()), 1)
    return rows, activations


def hardware_table() -> list[dict]:
    """The named parameter sets as rows (for reports and the README)."""
    return [asdict(h) for h in HARDWARE.values()]
