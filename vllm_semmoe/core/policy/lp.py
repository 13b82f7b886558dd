"""Small exact sub-problems solved with HiGHS."""

from __future__ import annotations

import contextlib
import os

import highspy
import numpy as np

_BANNER_SHOWN = False


def new_highs() -> highspy.Highs:
    """A silent HiGHS instance (the first one in a process prints a banner on stdout)."""
    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        h = highspy.Highs()
    else:
        with _stdout_to_devnull():
            h = highspy.Highs()
        _BANNER_SHOWN = True
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", 0)
    return h


@contextlib.contextmanager
def _stdout_to_devnull():
    try:
        fd = os.dup(1)
    except OSError:  # no stdout to protect
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(fd, 1)
        os.close(fd)


def assign_experts(gain: np.ndarray, max_load: np.ndarray | None = None, load: np.ndarray | None = None,
                   time_limit: float = 5.0) -> np.ndarray:
    """Place experts on devices, exactly ``N/E`` per device, maximising total gain.

    Args:
        gain: ``[E, N]``, the benefit of putting expert ``n`` on device ``e``.
        max_load, load: optional balance constraint ``Σ_{n on e} load[n] <= max_load`` for every
            device (``load: [N]``, ``max_load`` scalar). Without it the problem is a transportation
            problem whose LP optimum is integral; with it HiGHS solves a small MIP.
    Returns:
        ``[N]`` int64 device of each expert.
    """
    E, N = gain.shape
    per_device = N // E
    # variable x[e, n] at column e*N + n
    num_col = E * N
    cols = np.arange(num_col)
    # rows: N "each expert once", E "per_device experts per device", E optional load rows
    rows = [np.tile(np.arange(N), E), N + np.repeat(np.arange(E), N)]
    vals = [np.ones(num_col), np.ones(num_col)]
    row_lo = [np.ones(N), np.full(E, per_device)]
    row_hi = [np.ones(N), np.full(E, per_device)]
    constrained = max_load is not None
    if constrained:
        rows.append(N + E + np.repeat(np.arange(E), N))
        vals.append(np.tile(np.asarray(load, float), E))
        row_lo.append(np.full(E, -highspy.kHighsInf))
        row_hi.append(np.full(E, float(max_load)))
    row_idx = np.concatenate(rows)
    col_idx = np.concatenate([cols] * len(rows))
    val = np.concatenate(vals)
    order = np.lexsort((row_idx, col_idx))
    starts = np.searchsorted(col_idx[order], np.arange(num_col + 1))

    lp = highspy.HighsLp()
    lp.num_col_ = num_col
    lp.num_row_ = int(sum(len(r) for r in row_lo))
    lp.col_cost_ = np.asarray(gain, float).ravel()
    lp.col_lower_ = np.zeros(num_col)
    lp.col_upper_ = np.ones(num_col)
    lp.row_lower_ = np.concatenate(row_lo)
    lp.row_upper_ = np.concatenate(row_hi)
    lp.sense_ = highspy.ObjSense.kMaximize
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = starts.astype(np.int32)
    lp.a_matrix_.index_ = row_idx[order].astype(np.int32)
    lp.a_matrix_.value_ = val[order]
    if constrained:
        lp.integrality_ = [highspy.HighsVarType.kInteger] * num_col
    h = new_highs()
    if constrained:
        h.setOptionValue("time_limit", float(time_limit))
        h.setOptionValue("mip_rel_gap", 1e-4)
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    x = np.asarray(h.getSolution().col_value).reshape(E, N) if h.getSolution().value_valid else None
    if x is None or status not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit):
        if constrained:  # infeasible balance bound: fall back to the unconstrained optimum
            return assign_experts(gain)
        raise RuntimeError(f"HiGHS failed on the expert assignment: {h.modelStatusToString(status)}")
    return _round_balanced(x, per_device)


def _round_balanced(x: np.ndarray, per_device: int) -> np.ndarray:
    """``x: [E, N]`` (near-)integral assignment → ``[N]`` devices with exactly ``per_device`` each.

    Simplex vertices of the transportation problem are integral, so this is normally a plain
    argmax; the greedy pass only guards against numerical fuzz.
    """
    E, N = x.shape
    device = np.argmax(x, axis=0)
    if np.all(np.bincount(device, minlength=E) == per_device):
        return device.astype(np.int64)
    device = np.full(N, -1, np.int64)
    room = np.full(E, per_device)
    for flat in np.argsort(-x, axis=None, kind="stable"):
        e, n = divmod(int(flat), N)
        if device[n] < 0 and room[e] > 0:
            device[n] = e
            room[e] -= 1
    return device
