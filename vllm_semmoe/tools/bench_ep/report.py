"""Aggregation of the ranks' results (with the self-checks) and the printed table."""

from __future__ import annotations

import numpy as np

from .plan import BenchPlan, analytic_counts

CHECK_TOL = 0.05  # per-token relative L2 error allowed against the fp32 reference (bf16 wire/compute)
_ELEMENT_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


class BenchEPError(RuntimeError):
    """The benchmark could not run or its self-checks failed; the message says which."""


def aggregate(plan: BenchPlan, cfg: dict, per_rank: list) -> dict:
    E, L = plan.ranks, plan.num_layers
    out = {"mode": plan.mode, "ranks": E, "hidden": cfg["hidden"], "expert_dim": cfg["expert_dim"],
           "dtype": cfg["dtype"], "batches": max(cfg["steps"].values()), "layers": L,
           "backend": cfg["backend"], "methods": {}}
    problems = []
    for i, m in enumerate(plan.methods):
        def stack(key, i=i):
            return np.stack([pr[f"{key}_{i}"] for pr in per_rank])  # [E(rank), ...]

        disp_sent = stack("disp_sent").transpose(1, 0, 2)  # [L, src, dst]
        disp_recv = stack("disp_recv").transpose(1, 2, 0)  # rank r's [L, src] -> [L, src, dst=r]
        comb_sent = stack("comb_sent").transpose(1, 0, 2)
        comb_recv = stack("comb_recv").transpose(1, 2, 0)
        times = stack("times")  # [rank, S, L, 4] seconds (nan where a step does not exist)
        stats = stack("stats").sum(axis=0)  # local, activations, remote_pairs, tokens, meta_bytes
        check = float(stack("check").max())
        local, acts, remote_pairs, tokens, meta_bytes = (int(v) for v in stats)
        conserved = bool(np.array_equal(disp_sent, disp_recv) and np.array_equal(comb_sent, comb_recv)
                         and np.array_equal(comb_sent, disp_sent.transpose(0, 2, 1)))
        analytic = analytic_counts(plan, m)
        row_bytes = cfg["hidden"] * _ELEMENT_SIZE[cfg["dtype"]]
        matches = bool(np.array_equal(disp_sent, analytic["rows"] * row_bytes)
                       and local == analytic["local"] and acts == analytic["activations"])
        # per step and rank: what each rank received, against the routing's count for that step
        recv_steps = stack("disp_recv_steps").sum(axis=3).transpose(1, 2, 0)  # [S, L, rank]
        S = analytic["step_rows"].shape[0]
        want_steps = analytic["step_rows"].sum(axis=2) * row_bytes  # [S, L, dst]
        step_matches = bool(np.array_equal(recv_steps[:S], want_steps) and not recv_steps[S:].any())
        straggler = recv_steps[:S].max(axis=2)  # the step's most-receiving rank, [S, L]
        mean_recv = recv_steps[:S].mean(axis=2)
        if not conserved:
            problems.append(f"{m}: bytes sent and received differ")
        if not matches:
            problems.append(f"{m}: measured bytes differ from the routing's analytic count")
        if not step_matches:
            problems.append(f"{m}: bytes a rank received in some step differ from the routing's count for it")
        if not check <= CHECK_TOL:
            problems.append(f"{m}: combined output differs from the reference (rel err {check:.3g})")
        layer_wall = np.nanmax(times[..., 3], axis=0)  # slowest rank, [S, L]
        dispatch, combine = int(disp_sent.sum()), int(comb_sent.sum())
        out["methods"][m] = {
            "dispatch_bytes": dispatch,
            "combine_bytes": combine,
            "total_bytes": dispatch + combine,
            "bytes_per_token": (dispatch + combine) / max(tokens, 1),
            "bytes_ratio_vs_vanilla": None,
            "layer_ms": float(np.nanmean(layer_wall) * 1e3),
            "layer_ms_median": float(np.nanmedian(layer_wall) * 1e3),
            "time_ratio_vs_vanilla": None,
            "lar": local / max(acts, 1),
            "remote_pairs": remote_pairs,
            "activation_ratio_vs_vanilla": None,
            "remote_activations": acts - local,
            "tokens": tokens,
            "batches": cfg["steps"][m],
            "metadata_bytes": meta_bytes,
            "dispatch_ms": float(np.nanmean(times[..., 0]) * 1e3),
            "expert_ms": float(np.nanmean(times[..., 1]) * 1e3),
            "combine_ms": float(np.nanmean(times[..., 2]) * 1e3),
            "layer_ms_per_layer": [float(v) for v in np.nanmean(layer_wall, axis=0) * 1e3],
            "bytes_per_layer": [int(v) for v in (disp_sent.sum(axis=(1, 2)) + comb_sent.sum(axis=(1, 2)))],
            "dispatch_matrix": disp_sent.sum(axis=0).tolist(),
            "combine_matrix": comb_sent.sum(axis=0).tolist(),
            "dispatch_recv_matrix": disp_recv.sum(axis=0).tolist(),
            "combine_recv_matrix": comb_recv.sum(axis=0).tolist(),
            "straggler_recv_bytes": float(straggler.mean()),  # per step and layer, the most-receiving rank's
            "straggler_recv_ratio": float(straggler.sum() / max(mean_recv.sum(), 1e-12)),  # over the ranks' mean
            "conservation_ok": conserved,
            "analytic_match": matches,
            "step_match": step_matches,
            "check_max_rel_err": check,
            "solve_s": round(plan.solve_s[m], 3),
            "redundant": plan.placements[m].redundant,
            "experts_per_rank": plan.placements[m].experts_per_device,
        }
    base = out["methods"].get("vanilla")
    if base:
        for row in out["methods"].values():
            row["bytes_ratio_vs_vanilla"] = row["bytes_per_token"] / base["bytes_per_token"] if base["bytes_per_token"] else None
            row["time_ratio_vs_vanilla"] = row["layer_ms"] / base["layer_ms"] if base["layer_ms"] else None
            v_remote = 1.0 - base["lar"]
            row["activation_ratio_vs_vanilla"] = (1.0 - row["lar"]) / v_remote if v_remote else None
    if problems:
        raise BenchEPError("bench-ep self-check failed: " + "; ".join(problems))
    return out


def format_bench_ep(result: dict) -> str:
    """The side-by-side table of :func:`run_bench_ep`'s result."""
    head = (f"bench-ep: mode {result['mode']}, {result['ranks']} ranks ({result['backend']}), "
            f"hidden {result['hidden']} {result.get('dtype', '')}, {result['layers']} layers, "
            f"{result['batches']} batches of {result.get('batch_tokens', '?')} tokens"
            + (" spread over the stream" if result.get("sample") == "spread" else ""))
    cols = [("method", "<12"), ("experts/rank", ">13"), ("dispatch_MB", ">12"), ("combine_MB", ">11"), ("total_MB", ">10"),
            ("KB/token", ">9"), ("bytes_x", ">8"), ("remote_pairs", ">13"), ("lar", ">7"),
            ("act_x", ">7"), ("strag_x", ">8"), ("layer_ms", ">9"), ("time_x", ">7"), ("disp/exp/comb ms", ">19")]
    lines = [head, "".join(f"{name:{fmt}}" for name, fmt in cols)]

    def ratio(v):
        return "-" if v is None else f"{v:.3f}"

    for m, row in result["methods"].items():
        phases = f"{row['dispatch_ms']:.1f}/{row['expert_ms']:.1f}/{row['combine_ms']:.1f}"
        slots = f"{row['experts_per_rank']}" + (f" (R={row['redundant']})" if row["redundant"] else "")
        cells = [m, slots, f"{row['dispatch_bytes'] / 1e6:.1f}", f"{row['combine_bytes'] / 1e6:.1f}",
                 f"{row['total_bytes'] / 1e6:.1f}", f"{row['bytes_per_token'] / 1e3:.1f}",
                 ratio(row["bytes_ratio_vs_vanilla"]), f"{row['remote_pairs']}", f"{row['lar']:.4f}",
                 ratio(row["activation_ratio_vs_vanilla"]), f"{row['straggler_recv_ratio']:.3f}", f"{row['layer_ms']:.2f}",
                 ratio(row["time_ratio_vs_vanilla"]), phases]
        lines.append("".join(f"{c:{fmt}}" for c, (_, fmt) in zip(cells, cols)))
    lines.append("experts/rank: expert slots each rank holds per layer (N/E + R replica slots; expert memory).")
    lines.append("bytes_x: all-to-all bytes (dispatch+combine, deduplicated per destination rank) vs vanilla; "
                 "act_x: remote (token, expert) activations vs vanilla; time_x: layer_ms vs vanilla.")
    lines.append("strag_x: per step and layer, the most-receiving rank's dispatch bytes over the ranks' mean.")
    lines.append("checks: bytes sent == received, == analytic count from the routing, per step and rank too; "
                 "output == reference "
                 f"(max rel err {max(r['check_max_rel_err'] for r in result['methods'].values()):.2e}).")
    if "run_s" in result:
        lines.append(f"run {result['run_s']:.1f} s (ranks), {result['wall_s']:.1f} s with solving")
    return "\n".join(lines)
