"""A cost model of one expert-parallel MoE layer, step by step, on named hardware.

LAR and byte counts say how much traffic a placement saves; they do not say whether the time
saved on the all-to-all is eaten by a more loaded straggler rank, by the per-exchange latency
no placement removes, or by the collectives of the serving mode. This module turns per-step,
per-layer counts (:class:`StepTraffic`) into modelled MoE-layer time. Every MoE layer of a
step runs in lock step over the EP group (DP ranks and TP ranks alike): each phase ends when
its slowest rank is done, so

``layer time = decision + collectives + dispatch + experts + combine``, each the slowest rank's:

- **decision** (TP mode with Sem-MoE's scheduling): every rank computes the same shuffle of the
  step's tokens before the layer; its time is measured, not modelled (:data:`TP_DECISION_US`).

- **dispatch / combine** (one bulk exchange each, the α-β model): every rank sends and
  receives at once over its own links; a rank's exchange takes ``rows × row_bytes /
  bandwidth`` per link class (NVLink inside a node, the network between nodes, used at the
  same time; the slower bounds it), the exchange ends when the slowest rank is done, plus
  one fixed latency (the network's when the EP group spans nodes). What a row is depends on
  the kernel (:attr:`Hardware.unit`): one per token and remote rank (``rank``: DeepEP's normal
  kernels inside a node, this project's ``bench-ep``), one per remote (token, expert) pair
  (``expert``: DeepEP's low-latency kernels, pplx-kernels), or hierarchical (``node``:
  DeepEP's normal kernels across nodes: one network row per token and remote node, to the
  GPU of the same local index there, which forwards it over NVLink to the ranks of its node
  that need it). Combine moves the same rows back.
- **experts**: a roofline per rank: the larger of its (token, expert) pairs × FLOPs per pair
  at the GEMM throughput, and the weights of the distinct experts it runs (home or replica)
  read once from HBM. Decode-sized steps are bound by the weights, prefill-sized by FLOPs.
- **collectives** (TP mode): Sem-MoE's TP pipeline replaces stock TP's two all-reduces per
  decoder layer by a shuffled reduce-scatter before the MoE layer and one all-gather (MoE
  output and residual) after it (``tp_shuffle``); stock TP + EP (every rank holds every token,
  computes its own experts on all of them, no exchange) pays the two all-reduces
  (``tp_allreduce``). Ring volumes per rank: reduce-scatter and all-gather ``(E-1)/E`` of the
  tensor (one ring pass each), all-reduce twice that (two passes); each pass pays one
  collective latency. DP mode has none.

:func:`even_spread` puts the same per-step totals evenly on every rank: the time the same
locality would give without a straggler (``time_bound``).

Hardware sets (:data:`HARDWARE`): two nominal ones (link figures from datasheets, stated
assumptions for latency) and calibrated ones, whose exchange bandwidth and per-exchange
latency are fitted by least squares to published kernel measurements (:data:`PUBLISHED`),
each naming its source. ``tests/test_cost_model.py`` recomputes every published figure a set
was fitted on from this model. What is not fitted (GEMM throughput, HBM efficiency, collective
latency) is nominal and says so in the set's ``source``.

Inputs are plain arrays (no vLLM, no torch).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

import numba
import numpy as np

#: exchange granularities (:attr:`Hardware.unit`)
UNITS = ("rank", "expert", "node")


@dataclass(frozen=True)
class Hardware:
    """A named EP deployment: the EP group is spread evenly over ``nodes`` nodes; GPUs of a node
    share NVLink, nodes talk over the network.

    Exchange bandwidths are bytes/s per GPU per direction, in rows of :attr:`unit` (for a
    calibrated set, what reproduces the kernel's measured time on its benchmark's routing);
    latencies are seconds per exchange.
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
    calibrated: bool = False  # exchange bandwidth and latency fitted to published measurements
    unit: str = "rank"  # what one exchanged row is: see UNITS and the module docstring
    hbm_bytes_s: float = 3.35e12  # HBM bandwidth of one GPU (H100 / H800 SXM5 datasheet: 3.35 TB/s)
    hbm_efficiency: float = 0.8  # share of it an expert GEMM's weight read reaches (nominal)
    ring_nvlink_bytes_s: float | None = None  # collectives' NVLink bandwidth (None: nvlink_bytes_s)
    ring_network_bytes_s: float | None = None  # collectives' network bandwidth (None: network_bytes_s)
    collective_latency_s: float = 10e-6  # per ring pass of a collective (nominal)

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"hardware {self.name}: unit must be one of {', '.join(UNITS)}, got {self.unit!r}")
        if self.nodes < 1:
            raise ValueError(f"hardware {self.name}: nodes must be >= 1, got {self.nodes}")

    @property
    def exchange_latency_s(self) -> float:
        return self.network_latency_s if self.nodes > 1 else self.nvlink_latency_s

    @property
    def ring_bytes_s(self) -> float:
        """A ring collective's per-GPU bandwidth: NVLink inside a node; across nodes a ring
        crosses the network, whose link bounds every pass."""
        nvl = self.ring_nvlink_bytes_s or self.nvlink_bytes_s
        net = self.ring_network_bytes_s or self.network_bytes_s
        return nvl if self.nodes == 1 else min(nvl, net)


@dataclass(frozen=True)
class MoEShape:
    """What one (token, expert) activation costs: bytes on the wire, FLOPs and weights."""

    hidden: int
    expert_intermediate: int
    dispatch_bytes_per_element: float = 2.0  # bf16 rows out
    combine_bytes_per_element: float = 2.0  # bf16 partial sums back
    weight_bytes_per_element: float = 2.0  # bf16 expert weights
    activation_bytes_per_element: float = 2.0  # bf16 hidden states in the TP collectives

    @property
    def flops_per_activation(self) -> float:
        """Gate, up and down projections of one expert for one token: ``3 × 2 × H × I``."""
        return 6.0 * self.hidden * self.expert_intermediate

    @property
    def expert_weight_bytes(self) -> float:
        """Gate, up and down projection weights of one expert: ``3 × H × I`` elements."""
        return 3.0 * self.hidden * self.expert_intermediate * self.weight_bytes_per_element


#: DeepSeek-V2-Lite's routed experts (hidden 2048, expert intermediate 1408).
DSV2_LITE = MoEShape(hidden=2048, expert_intermediate=1408)
#: DeepSeek-V3's widths (hidden 7168, expert intermediate 2048): a what-if on another model's routing.
DSV3_WIDTH = MoEShape(hidden=7168, expert_intermediate=2048)


# ---- counts ---------------------------------------------------------------------------------
@dataclass
class StepTraffic:
    """Per-step, per-layer counts of one schedule (``S`` steps, ``L`` layers, ``E`` ranks).

    Attributes:
        rank_rows: ``[S, L, E, E]`` tokens rank ``src`` sends to rank ``dst`` (once per token
            and remote rank computing any of its experts; diagonal zero).
        expert_rows: ``[S, L, E, E]`` remote (token, expert) pairs ``src → dst`` (diagonal zero).
        node_rows: ``{G: [S, L, E, G]}`` tokens of rank ``src`` with an expert on node ``g``
            of ``G`` equal nodes (``g`` not ``src``'s node; zero there).
        activations: ``[S, L, E]`` (token, expert) pairs computed on each rank.
        active_experts: ``[S, L, E]`` distinct experts (home or replica copies) each rank runs.
        step_tokens: ``[S]`` tokens in each step (over all ranks).
        local: activations computed on the token's own rank (for LAR).
    """

    rank_rows: np.ndarray
    expert_rows: np.ndarray | None
    activations: np.ndarray
    active_experts: np.ndarray | None
    step_tokens: np.ndarray
    node_rows: dict = field(default_factory=dict)
    local: int = 0
    exchange: bool = True  # False: every rank holds every token (stock TP), nothing is exchanged

    @property
    def ranks(self) -> int:
        return self.rank_rows.shape[-1]

    @property
    def lar(self) -> float:
        return float(self.local / max(self.activations.sum(), 1))

    def rows_for(self, hw: Hardware) -> np.ndarray:
        if hw.unit == "expert":
            if self.expert_rows is None:
                raise ValueError(f"hardware {hw.name} exchanges one row per (token, expert) and these counts "
                                 "have none; count them with cost_model.step_traffic")
            return self.expert_rows
        return self.rank_rows

    def node_rows_for(self, nodes: int) -> np.ndarray:
        if nodes not in self.node_rows:
            raise ValueError(f"these counts have no per-node rows for {nodes} nodes; count them with "
                             f"cost_model.step_traffic(..., node_groups=({nodes},))")
        return self.node_rows[nodes]


def step_counts(serving: np.ndarray, token_device: np.ndarray, offsets: np.ndarray,
                ep_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-step dispatch rows and per-rank activations implied by routing and a schedule.

    Args:
        serving: ``[T, L, K]`` rank computing each activation of each scheduled token
            (:meth:`vllm_semmoe.core.placement.Placement.serving_device`: the expert's home rank, or
            the token's own rank where it holds a replica).
        token_device: ``[T, L]`` rank each token sits on at each layer.
        offsets: ``[S + 1]`` step boundaries into the token axis.
        ep_size: E.
    Returns:
        ``rows [S, L, E, E]`` (tokens rank ``src`` sends to ``dst``: at least one of its
        activations computed there, ``src != dst``) and ``activations [S, L, E]`` (pairs
        computed on each rank).
    """
    traffic = step_traffic(serving, token_device, offsets, ep_size)
    return traffic.rank_rows, traffic.activations


def step_traffic(serving: np.ndarray, token_device: np.ndarray, offsets: np.ndarray, ep_size: int,
                 experts: np.ndarray | None = None, node_groups=()) -> StepTraffic:
    """Every count the model reads, from routing and a schedule.

    Args:
        serving: ``[T, L, K]`` rank computing each activation (as :func:`step_counts`).
        token_device: ``[T, L]`` rank each token sits on at each layer.
        offsets: ``[S + 1]`` step boundaries into the token axis.
        ep_size: E.
        experts: ``[T, L, K]`` logical expert ids (for the distinct experts each rank runs);
            ``None`` leaves ``active_experts`` unknown (the expert time is then FLOP-bound).
        node_groups: node counts ``G`` to count per-node rows for (hierarchical kernels).
    """
    ed = np.ascontiguousarray(serving, dtype=np.int64)
    dev = np.ascontiguousarray(token_device, dtype=np.int64)
    T, L, K = ed.shape
    E = int(ep_size)
    offsets = np.asarray(offsets, np.int64)
    S = len(offsets) - 1
    if dev.shape != (T, L) or offsets[-1] != T or offsets[0] != 0:
        raise ValueError(f"token_device must be [T={T}, L={L}] and offsets run 0..{T}; got {dev.shape}, "
                         f"{offsets[0]}..{offsets[-1]}")
    step = np.repeat(np.arange(S, dtype=np.int64), np.diff(offsets))
    ex = np.zeros((T, L, K), np.int64) if experts is None else np.ascontiguousarray(experts, dtype=np.int64)
    if ex.shape != ed.shape:
        raise ValueError(f"experts must be [T, L, K] like serving {ed.shape}; got {ex.shape}")
    N = int(ex.max(initial=0)) + 1
    rank_rows, expert_rows, activations, active, local = _count_steps(ed, dev, step, S, E, ex, N)
    node_rows = {}
    for G in node_groups:
        G = int(G)
        if E % G:
            raise ValueError(f"EP size {E} cannot be spread evenly over {G} nodes")
        node_rows[G] = _count_node_rows(ed, dev, step, S, E, G)
    return StepTraffic(rank_rows=rank_rows, expert_rows=expert_rows, activations=activations,
                       active_experts=None if experts is None else active, step_tokens=np.diff(offsets),
                       node_rows=node_rows, local=int(local))


@numba.njit(cache=True)
def _count_steps(ed, dev, step, S, E, experts, N):
    """One pass over the scheduled activations (tokens in step order): rows per (token, remote
    rank) and per remote (token, expert), pairs per rank, distinct experts per rank, local pairs."""
    T, L, K = ed.shape
    rank_rows = np.zeros((S, L, E, E), np.int64)
    expert_rows = np.zeros((S, L, E, E), np.int64)
    activations = np.zeros((S, L, E), np.int64)
    active = np.zeros((S, L, E), np.int64)
    seen = np.full((L, E, N), -1, np.int64)  # the last step that counted (layer, rank, expert)
    mark = np.full(E, -1, np.int64)
    local = 0
    for t in range(T):
        s = step[t]
        for l in range(L):
            d = dev[t, l]
            stamp = t * L + l
            for k in range(K):
                r = ed[t, l, k]
                activations[s, l, r] += 1
                n = experts[t, l, k]
                if seen[l, r, n] != s:
                    seen[l, r, n] = s
                    active[s, l, r] += 1
                if r == d:
                    local += 1
                else:
                    expert_rows[s, l, d, r] += 1
                    if mark[r] != stamp:
                        mark[r] = stamp
                        rank_rows[s, l, d, r] += 1
    return rank_rows, expert_rows, activations, active, local


@numba.njit(cache=True)
def _count_node_rows(ed, dev, step, S, E, G):
    """Tokens each rank sends to each other node (once per token and node with one of its experts)."""
    T, L, K = ed.shape
    P = E // G
    out = np.zeros((S, L, E, G), np.int64)
    mark = np.full(G, -1, np.int64)
    for t in range(T):
        s = step[t]
        for l in range(L):
            d = dev[t, l]
            stamp = t * L + l
            for k in range(K):
                g = ed[t, l, k] // P
                if g != d // P and mark[g] != stamp:
                    mark[g] = stamp
                    out[s, l, d, g] += 1
    return out


def even_spread(traffic: StepTraffic) -> StepTraffic:
    """The same per-step totals spread evenly: every rank sends and receives the mean, to every
    peer alike (over remote nodes alike for per-node rows), computes the mean activations and
    runs the mean number of distinct experts. Modelled, it is the time the schedule's locality
    would give without a straggler."""
    E = traffic.ranks
    off = 1.0 - np.eye(E)

    def spread(rows):
        if rows is None:
            return None
        total = rows.sum(axis=(-1, -2), dtype=np.float64)[..., None, None]
        return total * off / max(E * (E - 1), 1)

    node_rows = {}
    for G, rows in traffic.node_rows.items():
        P = E // G
        remote = (np.arange(E)[:, None] // P) != np.arange(G)[None, :]  # [E, G]
        total = rows.sum(axis=(-1, -2), dtype=np.float64)[..., None, None]
        node_rows[G] = total * remote / max(E * (G - 1), 1)
    mean = lambda a: None if a is None else np.broadcast_to(a.mean(axis=-1, keepdims=True), a.shape)  # noqa: E731
    return StepTraffic(rank_rows=spread(traffic.rank_rows), expert_rows=spread(traffic.expert_rows),
                       activations=mean(traffic.activations.astype(np.float64)),
                       active_experts=mean(None if traffic.active_experts is None
                                           else traffic.active_experts.astype(np.float64)),
                       step_tokens=traffic.step_tokens, node_rows=node_rows, local=traffic.local,
                       exchange=traffic.exchange)


# ---- time -----------------------------------------------------------------------------------
def link_rows(traffic: StepTraffic, hw: Hardware) -> list[tuple[str, np.ndarray, float]]:
    """Rows each rank moves per link class: ``[(link, rows [S, L, E], bytes/s)]``, a rank's
    rows being the larger of what it sends and what it receives on that link."""
    rows = np.asarray(traffic.rows_for(hw), dtype=np.float64)
    E = rows.shape[-1]
    if E % hw.nodes:
        raise ValueError(f"EP size {E} cannot be spread evenly over {hw.nodes} nodes ({hw.name})")
    G, P = hw.nodes, E // hw.nodes
    off = rows * (1.0 - np.eye(E))
    node = np.arange(E) // P
    same = node[:, None] == node[None, :]
    if hw.unit != "node" or G == 1:
        out = []
        for name, mask, bw in (("nvlink", same, hw.nvlink_bytes_s), ("network", ~same, hw.network_bytes_s)):
            part = off * mask
            out.append((name, np.maximum(part.sum(axis=-1), part.sum(axis=-2)), bw))
        return out
    # hierarchical: src (gs, p) → network → relay (g, p) → NVLink → dst (g, q)
    lead = rows.shape[:-2]
    net = np.asarray(traffic.node_rows_for(G), dtype=np.float64).reshape(lead + (G, P, G))  # [.., gs, p, g]
    net = net * (1.0 - np.eye(G))[:, None, :]
    net_send = net.sum(axis=-1).reshape(lead + (E,))
    net_recv = net.sum(axis=-3).transpose(tuple(range(len(lead))) + (len(lead) + 1, len(lead))).reshape(lead + (E,))
    r6 = off.reshape(lead + (G, P, G, P))  # [.., gs, ps, gd, pd]
    # relay (g, p) forwards to (g, q), q != p, what sources (gs != g, p) send to (g, q)
    fwd = r6.sum(axis=-4)  # [.., ps, gd, pd] summed over source nodes
    own = np.diagonal(r6, axis1=-4, axis2=-2)  # [.., ps, pd, g]: the relay's own node as source
    fwd = fwd - np.moveaxis(own, -1, -2)
    fwd = fwd * (1.0 - np.eye(P))[:, None, :]  # [.., p (relay), g, q]
    direct = off * same
    nvl_send = direct.sum(axis=-1) + np.moveaxis(fwd.sum(axis=-1), -2, -1).reshape(lead + (E,))
    nvl_recv = direct.sum(axis=-2) + fwd.sum(axis=-3).reshape(lead + (E,))
    return [("nvlink", np.maximum(nvl_send, nvl_recv), hw.nvlink_bytes_s),
            ("network", np.maximum(net_send, net_recv), hw.network_bytes_s)]


def exchange_seconds_per_byte(traffic: StepTraffic, hw: Hardware) -> np.ndarray:
    """``[S, L]``: the slowest rank's seconds per byte of a row, over its link classes (an
    exchange takes ``latency + row_bytes × this``)."""
    worst = None
    for _, rows, bw in link_rows(traffic, hw):
        t = (rows / bw).max(axis=-1)
        worst = t if worst is None else np.maximum(worst, t)
    return worst


def exchange_seconds(rows, row_bytes: float, hw: Hardware) -> np.ndarray:
    """Time of one bulk exchange per step and layer.

    Args:
        rows: a :class:`StepTraffic`, or ``[S, L, E, E]`` rows sent ``src → dst`` in
            ``hw``'s unit (diagonal ignored; not for the hierarchical ``node`` unit).
        row_bytes: bytes of one row.
    Returns:
        ``[S, L]`` seconds: the slowest rank's ``max(send, receive)`` time over its link
        classes, plus one exchange latency.
    """
    if not isinstance(rows, StepTraffic):
        rows = np.asarray(rows, dtype=np.float64)
        if hw.unit == "node" and hw.nodes > 1:
            raise ValueError(f"hardware {hw.name} forwards across nodes hierarchically; pass a StepTraffic "
                             "with per-node rows")
        rows = StepTraffic(rank_rows=rows, expert_rows=rows, activations=np.zeros(rows.shape[:-1]),
                           active_experts=None, step_tokens=np.zeros(rows.shape[0]))
    return exchange_seconds_per_byte(rows, hw) * row_bytes + hw.exchange_latency_s


def expert_seconds(activations: np.ndarray, active_experts: np.ndarray | None, shape: MoEShape,
                   hw: Hardware) -> np.ndarray:
    """Roofline per rank: ``max(pairs × FLOPs / (peak × efficiency), distinct experts × weight
    bytes / (HBM × efficiency))``; same shape as ``activations``."""
    compute = np.asarray(activations, np.float64) * shape.flops_per_activation / (hw.peak_flops * hw.efficiency)
    if active_experts is None:
        return compute
    memory = np.asarray(active_experts, np.float64) * shape.expert_weight_bytes / (hw.hbm_bytes_s * hw.hbm_efficiency)
    return np.maximum(compute, memory)


#: TP collectives of one MoE layer per serving pipeline: ``tensor_passes`` (ring passes of a
#: ``[B, H]`` tensor, each moving ``(E-1)/E`` of it per rank) and ``latency_passes`` (ring
#: passes launched, each paying :attr:`Hardware.collective_latency_s`)
COLLECTIVES = {
    # shuffled reduce-scatter (1 pass) + one all-gather of MoE output and residual (2 tensors, 1 pass)
    "tp_shuffle": {"tensor_passes": 3, "latency_passes": 2},
    # stock TP: two all-reduces, each a reduce-scatter pass and an all-gather pass
    "tp_allreduce": {"tensor_passes": 4, "latency_passes": 4},
}


def collective_seconds(step_tokens: np.ndarray, ep_size: int, shape: MoEShape, hw: Hardware,
                       kind: str | None) -> np.ndarray:
    """``[S]`` seconds of one MoE layer's TP collectives (ring model; ``kind`` None: none)."""
    step_tokens = np.asarray(step_tokens, np.float64)
    if kind is None or ep_size == 1:
        return np.zeros_like(step_tokens)
    if kind not in COLLECTIVES:
        raise ValueError(f"collectives must be one of {', '.join(COLLECTIVES)} or None, got {kind!r}")
    spec = COLLECTIVES[kind]
    E = int(ep_size)
    per_pass = (E - 1) / E * step_tokens * shape.hidden * shape.activation_bytes_per_element / hw.ring_bytes_s
    return spec["tensor_passes"] * per_pass + spec["latency_passes"] * hw.collective_latency_s


#: The TP decision of one MoE layer (scores, price rounds, repair, permutation) as the engine runs
#: it on CUDA tensors (PyTorch ops and the Triton price rounds, not fused), measured on an H200:
#: tokens per step -> µs. It is applied on every hardware set (all are H100/H200-class GPUs).
TP_DECISION_US = {64: 970.2, 512: 1401.8, 4096: 1407.9, 16384: 5038.2}
TP_DECISION_SOURCE = ("measured: `SEMMOE_GPU_NO_VLLM=1 bash scripts/gpu_check.sh` on an H200, "
                      "benchmarks/gpu/h200_no_vllm_run4_final_tree.json, timing_without_vllm.<tokens>.decision_ms")


def tp_decision_seconds(step_tokens: np.ndarray) -> np.ndarray:
    """``[S]`` seconds of the TP decision for one MoE layer of each step of ``step_tokens`` tokens:
    :data:`TP_DECISION_US` linear in log2(tokens) between its points, the nearest point outside."""
    points = np.array(sorted(TP_DECISION_US), np.float64)
    us = np.array([TP_DECISION_US[int(t)] for t in points], np.float64)
    tokens = np.maximum(np.asarray(step_tokens, np.float64), 1.0)
    return np.interp(np.log2(tokens), np.log2(points), us) * 1e-6


def layer_times(traffic: StepTraffic, shape: MoEShape, hw: Hardware, collectives: str | None = None,
                decision: bool = False) -> dict:
    """``{part: [S, L] seconds}`` of every MoE layer of every step: ``collectives``,
    ``dispatch``, ``combine`` (zero where the counts have no exchange, as in stock TP),
    ``experts`` (straggler), ``experts_mean`` (the same work spread evenly) and ``decision``
    (the TP decision, :func:`tp_decision_seconds`, where ``decision``: Sem-MoE's TP scheduling
    decides every layer of every step; zero otherwise, e.g. DP mode, whose rank choice runs per
    request in the API server, off the step)."""
    S, L = traffic.activations.shape[:2]
    E = traffic.ranks
    if traffic.exchange:
        per_byte = exchange_seconds_per_byte(traffic, hw)
        lat = hw.exchange_latency_s if E > 1 else 0.0
        dispatch = per_byte * shape.hidden * shape.dispatch_bytes_per_element + lat
        combine = per_byte * shape.hidden * shape.combine_bytes_per_element + lat
    else:
        dispatch = combine = np.zeros((S, L))
    experts = expert_seconds(traffic.activations, traffic.active_experts, shape, hw)
    mean_active = None if traffic.active_experts is None else traffic.active_experts.mean(axis=-1)
    return {
        "collectives": np.broadcast_to(collective_seconds(traffic.step_tokens, E, shape, hw, collectives)[:, None],
                                       (S, L)),
        "dispatch": dispatch,
        "combine": combine,
        "experts": experts.max(axis=-1),
        "experts_mean": expert_seconds(traffic.activations.mean(axis=-1), mean_active, shape, hw),
        "decision": np.broadcast_to((tp_decision_seconds(traffic.step_tokens) if decision
                                     else np.zeros(S))[:, None], (S, L)),
    }


def summarize(times: dict, traffic: StepTraffic, per: str = "layer_step") -> dict:
    """Microseconds from :func:`layer_times`: ``per="layer_step"`` the mean MoE layer of a step,
    ``per="token"`` per token summed over all layers (the two differ by ``L / tokens per step``).
    ``total_us`` = decision + collectives + dispatch + experts + combine."""
    if per == "layer_step":
        scale = 1e6 / times["dispatch"].size
    elif per == "token":
        scale = 1e6 / max(float(traffic.step_tokens.sum()), 1.0)
    else:
        raise ValueError(f"per must be 'layer_step' or 'token', got {per!r}")
    out = {f"{k}_us": float(v.sum() * scale) for k, v in times.items()}
    out["total_us"] = (out["decision_us"] + out["collectives_us"] + out["dispatch_us"] + out["experts_us"]
                       + out["combine_us"])
    out["imbalance_cost_us"] = out["experts_us"] - out["experts_mean_us"]
    return out


def moe_layer_cost(traffic: StepTraffic, shape: MoEShape, hw: Hardware, collectives: str | None = None,
                   per: str = "token") -> dict:
    """Modelled MoE time of a schedule (:func:`summarize` of :func:`layer_times`), plus
    ``compute_imbalance`` (the straggler's activations over the mean, summed over steps and
    layers) and ``lar``."""
    out = summarize(layer_times(traffic, shape, hw, collectives), traffic, per)
    acts = np.asarray(traffic.activations, np.float64)
    out["compute_imbalance"] = float(acts.max(axis=-1).sum() / max(acts.mean(axis=-1).sum(), 1e-12))
    out["lar"] = traffic.lar
    return out


def cost_table(traffic: dict, shape: MoEShape = DSV2_LITE, hardware=None, mode: str = "dp") -> dict:
    """Model every method on every named hardware set.

    Args:
        traffic: ``{method: StepTraffic}`` (e.g. :func:`vllm_semmoe.evaluation.cost_grid.plan_traffic`).
        shape: the MoE layer's shape; ``hardware``: names in :data:`HARDWARE` (default all);
        mode: ``tp`` adds Sem-MoE's TP pipeline collectives (reduce-scatter, all-gather).
    Returns:
        ``{hardware_name: {method: moe_layer_cost(...) (µs per token, all layers) +
        {"time_ratio_vs_vanilla"}}}``.
    """
    hardware = tuple(HARDWARE) if hardware is None else tuple(hardware)
    unknown = [h for h in hardware if h not in HARDWARE]
    if unknown:
        raise ValueError(f"unknown hardware {', '.join(unknown)}; choose from {', '.join(HARDWARE)}")
    collectives = "tp_shuffle" if str(mode) == "tp" else None
    out = {}
    for name in hardware:
        rows = {m: moe_layer_cost(t, shape, HARDWARE[name], collectives) for m, t in traffic.items()}
        base = rows.get("vanilla")
        for row in rows.values():
            row["time_ratio_vs_vanilla"] = row["total_us"] / base["total_us"] if base and base["total_us"] else None
        out[name] = rows
    return out


def format_cost_table(table: dict, shape: MoEShape) -> str:
    """Plain-text table: one block per hardware set, one row per method (µs per token)."""
    cols = ("collectives_us", "dispatch_us", "combine_us", "experts_us", "imbalance_cost_us", "total_us",
            "time_ratio_vs_vanilla")
    lines = [f"modelled MoE time per token (all layers), hidden {shape.hidden}, expert intermediate "
             f"{shape.expert_intermediate}"]
    for name, rows in table.items():
        hw = HARDWARE[name]
        lines.append(f"{name} ({'calibrated' if hw.calibrated else 'nominal'}, {hw.unit} rows): {hw.source}")
        lines.append(f"  {'method':<12}" + "".join(f"{c:>{len(c) + 2}}" for c in cols))
        for method, row in rows.items():
            cells = "".join(f"{(row[c] if row[c] is not None else float('nan')):>{len(c) + 2}.3f}" for c in cols)
            lines.append(f"  {method:<12}{cells}")
    return "\n".join(lines)


# ---- published measurements and the fit -------------------------------------------------------
DEEPEP_LEGACY = ("https://github.com/deepseek-ai/DeepEP/blob/main/docs/legacy.md (DeepEP V1 performance; "
                 "benchmarks tests/legacy/test_intranode.py, test_internode.py, test_low_latency.py)")
PPLX_README = ("https://github.com/ppl-ai/pplx-kernels/blob/main/README.md (Benchmark Results; benchmark "
               "tests/bench_all_to_all.py: float8_e4m3fn dispatch with float32 scales per 128, bfloat16 combine)")


@dataclass(frozen=True)
class Measurement:
    """One published figure of an EP kernel benchmark and the configuration it was measured in.

    ``figure``: ``"us"`` (the kernel's time) or ``"GB/s"`` (bytes the benchmark counts / time,
    ``counted`` saying which: ``"rank"`` rows received per token and rank, own rank included;
    ``"node"`` rows sent per token and node, own node included). Routing is the benchmark's:
    random scores, top-``top_k`` of ``num_experts`` (limited to the ``topk_groups`` best of
    one group per node where set).
    """

    source: str
    table: str
    row: str
    phase: str  # "dispatch" or "combine"
    ep: int
    tokens: int  # tokens per rank
    hidden: int
    top_k: int
    num_experts: int
    row_bytes: float  # bytes of one row on the wire in the benchmark
    value: float
    figure: str = "us"
    counted: str = ""
    topk_groups: int | None = None
    gpus_per_node: int = 8

    @property
    def nodes(self) -> int:
        return max(self.ep // self.gpus_per_node, 1)


_FP8 = 7168 * (1 + 4 / 128)  # DeepEP normal tests: bf16 bytes x (1 + 4/128) / 2
_FP8_LL = 7168 + 7168 / 128 * 4 + 16  # DeepEP test_low_latency.py: num_fp8_bytes
_FP8_PPLX = 7168 + 7168 // 128 * 4  # pplx bench: hidden + float32 scale per 128 elements
_BF16 = 7168 * 2


def _deepep_normal(row, ep, dispatch, combine, counted, groups=None):
    common = dict(source=DEEPEP_LEGACY, table="Normal kernels with NVLink and RDMA forwarding (H800, "
                  "4096 tokens, hidden 7168, top-8, FP8 dispatch, BF16 combine)", ep=ep, tokens=4096,
                  hidden=7168, top_k=8, num_experts=256, figure="GB/s", counted=counted, topk_groups=groups)
    return (Measurement(row=f"{row}, dispatch #EP {ep}", phase="dispatch", row_bytes=_FP8, value=dispatch, **common),
            Measurement(row=f"{row}, combine #EP {ep}", phase="combine", row_bytes=_BF16, value=combine, **common))


def _deepep_ll(ep, dispatch, combine):
    common = dict(source=DEEPEP_LEGACY, table="Low-latency kernels with pure RDMA (H800, 128 tokens, hidden 7168, "
                  "top-8, FP8 dispatch, BF16 combine)", ep=ep, tokens=128, hidden=7168, top_k=8, num_experts=256)
    return (Measurement(row=f"dispatch #EP {ep}", phase="dispatch", row_bytes=_FP8_LL, value=dispatch, **common),
            Measurement(row=f"combine #EP {ep}", phase="combine", row_bytes=_BF16, value=combine, **common))


def _pplx(tokens, dispatch, combine):
    common = dict(source=PPLX_README, table=f"{tokens} tok per GPU (EP8 column; the DeepSeek-R1 shape of the "
                  "benchmark: 256 experts, top-8, hidden 7168)", ep=8, tokens=tokens, hidden=7168, top_k=8,
                  num_experts=256)
    return (Measurement(row="NVLINK Dispatch", phase="dispatch", row_bytes=_FP8_PPLX, value=dispatch, **common),
            Measurement(row="NVLINK Combine", phase="combine", row_bytes=_BF16, value=combine, **common))


#: Published tables, every row of them, by the calibrated set fitted on them. DeepEP's legacy
#: (V1) tables; the "RDMA bandwidth" columns of the low-latency table are the same runs as its
#: latencies (bytes counted per (token, expert) / time) and are not entered twice. pplx-kernels:
#: the NVLink rows (EP 8, one node) of both tables; its internode rows (IBGDA, IBRC) are not
#: fitted (the two-node sets are DeepEP's). The pplx README names neither GPU nor model shape;
#: the shape is inferred from its benchmark's DeepSeek-R1 configuration and from its "DeepEP"
#: row, which repeats DeepEP's then-published figures for that shape.
PUBLISHED: dict[str, tuple[Measurement, ...]] = {
    "deepep-normal-1node": _deepep_normal("Intranode", 8, 153, 158, "rank"),
    "deepep-normal-2node": (_deepep_normal("Internode", 16, 43, 43, "node", groups=2)
                            + _deepep_normal("Internode", 32, 58, 57, "node", groups=4)
                            + _deepep_normal("Internode", 64, 51, 50, "node", groups=4)),
    "deepep-ll-1node": _deepep_ll(8, 77, 114),
    "deepep-ll-2node": (_deepep_ll(16, 118, 195) + _deepep_ll(32, 155, 273) + _deepep_ll(64, 173, 314)
                        + _deepep_ll(128, 192, 369) + _deepep_ll(256, 194, 360)),
    "pplx-1node": _pplx(1, 41.6, 41.7) + _pplx(128, 83.6, 102.3),
}


def _hit_probabilities(m: Measurement) -> tuple[float, float]:
    """``(P[a given rank holds one of a token's experts], P[a given node does])`` under the
    benchmark's routing: exact for plain top-k, simulated (fixed seed) when group-limited."""
    groups = None if m.topk_groups is None or m.topk_groups >= m.nodes else m.topk_groups
    return _routing_hits(m.num_experts, m.top_k, m.ep, m.nodes, groups)


@functools.lru_cache(maxsize=None)
def _routing_hits(N: int, K: int, E: int, G: int, groups: int | None) -> tuple[float, float]:
    if groups is None:
        miss = lambda n: math.comb(N - n, K) / math.comb(N, K)  # noqa: E731
        return 1.0 - miss(N // E), 1.0 - miss(N // G)
    rng = np.random.default_rng(0)
    tokens = 4096
    scores = np.abs(rng.standard_normal((tokens, N), dtype=np.float32)) + 1.0  # DeepEP test_internode.py's scores
    best = np.argpartition(-scores.reshape(tokens, G, N // G).max(axis=-1), groups - 1, axis=1)[:, :groups]
    keep = np.zeros((tokens, G), bool)
    np.put_along_axis(keep, best, True, axis=1)
    masked = np.where(np.repeat(keep, N // G, axis=1), scores, 0.0)
    top = np.argpartition(-masked, K - 1, axis=1)[:, :K]
    hit_rank = np.zeros((tokens, E), bool)
    np.put_along_axis(hit_rank, top // (N // E), True, axis=1)
    hit_node = np.zeros((tokens, G), bool)
    np.put_along_axis(hit_node, top // (N // G), True, axis=1)
    return float(hit_rank.mean()), float(hit_node.mean())


def benchmark_traffic(m: Measurement) -> StepTraffic:
    """The expected counts of one exchange of ``m``'s benchmark on one layer (every rank alike:
    ``tokens × P[hit]`` rows to every other rank, ``tokens × top_k / E`` (token, expert) pairs)."""
    E, G = m.ep, m.nodes
    p_rank, p_node = _hit_probabilities(m)
    off = 1.0 - np.eye(E)
    remote_node = (np.arange(E)[:, None] // (E // G)) != np.arange(G)[None, :]
    return StepTraffic(rank_rows=(m.tokens * p_rank * off)[None, None],
                       expert_rows=(m.tokens * m.top_k / E * off)[None, None],
                       activations=np.full((1, 1, E), m.tokens * m.top_k, np.float64),
                       active_experts=None, step_tokens=np.array([m.tokens * E]),
                       node_rows={G: (m.tokens * p_node * remote_node)[None, None]})


def published_seconds(m: Measurement) -> float:
    """``m`` as the kernel's seconds (a bandwidth figure divided into the bytes its benchmark counts)."""
    if m.figure == "us":
        return m.value * 1e-6
    return benchmark_counted_bytes(m) / (m.value * 1e9)


def benchmark_counted_bytes(m: Measurement) -> float:
    """Bytes per rank a bandwidth figure counts: rows per (token, rank) received, own rank
    included (``rank``), or rows per (token, node) sent, own node included (``node``)."""
    p_rank, p_node = _hit_probabilities(m)
    if m.counted == "rank":
        return m.ep * m.tokens * p_rank * m.row_bytes
    if m.counted == "node":
        return m.tokens * m.nodes * p_node * m.row_bytes
    raise ValueError(f"{m.row}: a GB/s figure needs counted 'rank' or 'node', got {m.counted!r}")


def model_figure(m: Measurement, hw: Hardware) -> float:
    """``m``'s figure (µs or GB/s, as published) recomputed from the model on ``hw`` deployed
    like the benchmark (``ep / 8`` nodes)."""
    hw = replace(hw, nodes=m.nodes)
    seconds = float(exchange_seconds(benchmark_traffic(m), m.row_bytes, hw)[0, 0])
    return seconds * 1e6 if m.figure == "us" else benchmark_counted_bytes(m) / seconds / 1e9


def fit_link(measurements, hw: Hardware, link: str) -> tuple[float, float]:
    """Least-squares ``(bytes/s, latency s)`` of ``link`` (``"nvlink"`` or ``"network"``) in
    ``hw`` that reproduce the measurements' times, the other link class held at ``hw``'s.

    Each measurement gives ``t = latency + max(bytes_on_link / bw, other)``; with the max
    resolved by the current fit this is linear in ``(latency, 1/bw)``, fitted on relative
    residuals (every figure weighs alike) and iterated until the bound link of every
    measurement stops changing. A negative latency is clamped to zero.
    """
    a, c, t = [], [], []
    for m in measurements:
        h = replace(hw, nodes=m.nodes)
        per_link = {name: (rows.max() * m.row_bytes, bw)
                    for name, rows, bw in link_rows(benchmark_traffic(m), h)}
        a.append(per_link[link][0])
        c.append(max([b / bw for name, (b, bw) in per_link.items() if name != link] + [0.0]))
        t.append(published_seconds(m))
    a, c, t = map(np.asarray, (a, c, t))
    bound = np.ones(len(t), bool)
    for _ in range(20):
        A = np.stack([np.ones_like(t), np.where(bound, a, 0.0)], axis=1) / t[:, None]
        b = (t - np.where(bound, 0.0, c)) / t
        (lat, inv), *_ = np.linalg.lstsq(A, b, rcond=None)
        if lat < 0:
            lat = 0.0
            inv = float(np.linalg.lstsq(A[:, 1:], b, rcond=None)[0][0])
        if inv <= 0 or not bound.any():
            raise ValueError(f"{link} of {hw.name}: the measurements do not determine its bandwidth")
        now = a * inv >= c
        if (now == bound).all():
            break
        bound = now
    return 1.0 / inv, float(lat)


def _calibrated() -> list[Hardware]:
    """The calibrated sets, each fitted on :data:`PUBLISHED` (links) over nominal parts."""
    h800 = ("H800 SXM5 (NVLink ~160 GB/s, CX7 400 Gb/s RDMA ~50 GB/s per GPU, as the source states; "
            "989 TFLOP/s bf16 and 3.35 TB/s HBM3 like H100 SXM5)")
    nominal = ("nominal: 40% of bf16 peak in expert GEMMs, 80% of HBM bandwidth for their weights, "
               "10 µs (1 node) / 20 µs (2 nodes) per collective ring pass launch")
    base = dict(peak_flops=989e12, efficiency=0.4, calibrated=True, ring_nvlink_bytes_s=160e9,
                ring_network_bytes_s=50e9)
    out = []
    for family, unit1, unit2, what in (("deepep-normal", "rank", "node", "DeepEP normal kernels"),
                                       ("deepep-ll", "expert", "expert", "DeepEP low-latency kernels")):
        one = Hardware(f"{family}-1node", 1, 160e9, 50e9, 10e-6, 20e-6, source="", unit=unit1, **base)
        bw, lat = fit_link(PUBLISHED[one.name], one, "nvlink")
        one = replace(one, nvlink_bytes_s=bw, nvlink_latency_s=lat, source=(
            f"{what} inside one {h800} node; NVLink {bw / 1e9:.0f} GB/s and {lat * 1e6:.1f} µs per exchange "
            f"fitted to {DEEPEP_LEGACY}, rows {', '.join(m.row for m in PUBLISHED[one.name])}; {nominal}"))
        two = replace(one, name=f"{family}-2node", nodes=2, unit=unit2, collective_latency_s=20e-6)
        bw, lat = fit_link(PUBLISHED[two.name], two, "network")
        two = replace(two, network_bytes_s=bw, network_latency_s=lat, source=(
            f"{what}, the EP group over 2 {h800} nodes; network {bw / 1e9:.1f} GB/s and {lat * 1e6:.1f} µs per "
            f"exchange fitted to {DEEPEP_LEGACY}, rows {', '.join(m.row for m in PUBLISHED[two.name])} (NVLink "
            f"as {one.name}); {nominal}"))
        out += [one, two]
    pplx = Hardware("pplx-1node", 1, 450e9, 50e9, 10e-6, 20e-6, source="", unit="expert",
                    **dict(base, ring_nvlink_bytes_s=450e9))
    bw, lat = fit_link(PUBLISHED[pplx.name], pplx, "nvlink")
    out.append(replace(pplx, nvlink_bytes_s=bw, nvlink_latency_s=lat, source=(
        f"pplx-kernels inside one node of H100-class GPUs (H100 SXM5: NVLink 4 450 GB/s per direction, "
        f"989 TFLOP/s bf16, 3.35 TB/s HBM3); NVLink {bw / 1e9:.0f} GB/s and {lat * 1e6:.1f} µs per exchange "
        f"fitted to {PPLX_README}, rows {', '.join(f'{m.row} ({m.tokens} tok)' for m in PUBLISHED['pplx-1node'])}; "
        f"{nominal}")))
    return out


#: Named parameter sets. Nominal (``calibrated`` false): H100 SXM: 900 GB/s NVLink 4 per GPU
#: (450 GB/s per direction), 989 TFLOP/s dense bf16; 400 Gb/s = 50 GB/s per GPU per direction
#: (one ConnectX-7 InfiniBand port per GPU); the latencies (10 µs per exchange inside a node,
#: 20 µs across nodes) and the 40 % of peak that grouped expert GEMMs reach are assumptions of
#: this model, stated here so that a reader can change them. Calibrated: :func:`_calibrated`.
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("1-node-nvlink", 1, 450e9, 450e9, 10e-6, 10e-6, 989e12, 0.4,
                 "nominal: one node of H100 SXM: NVLink 4, 900 GB/s per GPU (450 GB/s per direction), "
                 "989 TFLOP/s bf16, 3.35 TB/s HBM3; 10 µs per exchange and collective, 40% of peak in "
                 "expert GEMMs, 80% of HBM for their weights"),
        Hardware("2-node-ib400", 2, 450e9, 50e9, 10e-6, 20e-6, 989e12, 0.4,
                 "nominal: the EP group split over 2 nodes of H100 SXM: NVLink inside a node, "
                 "400 Gb/s InfiniBand per GPU between nodes; 20 µs per exchange and collective",
                 collective_latency_s=20e-6),
        *_calibrated(),
    )
}


def hardware_table() -> list[dict]:
    """The named parameter sets as rows (for reports and the README)."""
    return [asdict(h) for h in HARDWARE.values()]
