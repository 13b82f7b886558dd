"""Fixtures shared by tests/ and benchmarks/ (imported by both conftest.py files)."""

import os
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from vllm_semmoe.core.capture_store import load_trace

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("SEMMOE_DATA_DIR", REPO.parent / "shared" / "data"))
DEV_TRACE = DATA_DIR / "routing" / "dsv2lite_puffin-dev.npz"


def metrics_text(base: str) -> str:
    """The ``/metrics`` page of the server at ``base``."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        return resp.read().decode()


def per_label(text: str, metric: str, label: str, **only: str) -> dict[int, float]:
    """``metric`` summed per value of ``label`` on a ``/metrics`` page, over the samples whose
    labels include ``only``."""
    counts: dict[int, float] = {}
    for labels, value in re.findall(rf"^{re.escape(metric)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        found = re.search(rf'{label}="(\d+)"', labels)
        if found and all(f'{key}="{want}"' in labels for key, want in only.items()):
            counts[int(found.group(1))] = counts.get(int(found.group(1)), 0.0) + float(value)
    return counts


def settled(read, what: str, timeout: float = 60):
    """``read()`` once two reads a second apart agree (the engines that write it are idle);
    ``read`` returns ``None`` while there is nothing to read yet. Fails the test after
    ``timeout`` seconds, naming ``what`` was read."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        now = read()
        if now is not None and now == last:
            return now
        last = now
        time.sleep(1.0)
    pytest.fail(f"{what}: not settled within {timeout:.0f} s (last read {last})")


@pytest.fixture(scope="session")
def dev_trace_path() -> Path:
    if not DEV_TRACE.exists():
        pytest.fail(
            f"real routing trace not found at {DEV_TRACE}; these tests need the shared data "
            "laid out beside the checkout (../shared/data) or SEMMOE_DATA_DIR pointing at it"
        )
    return DEV_TRACE


@pytest.fixture(scope="session")
def dev_trace(dev_trace_path):
    return load_trace(dev_trace_path)


@pytest.fixture(scope="session")
def small_trace(dev_trace):
    """The first 200 real requests: quick to solve, still real routing."""
    return dev_trace.select_requests(np.arange(200))


def serving_by_hand(expert_device, holds, experts, token_device):
    """The rank computing each activation, token by token (an independent restatement of
    ``Placement.serving_device``): the token's own rank where it holds a copy of the expert;
    else, if the expert has one copy, its home; else (slot order) the first of its copies
    ([home rank, replica ranks ascending]) among the ranks the token already goes to, else
    copy ``(row * K + slot) mod copies``.

    expert_device ``[L, N]``; holds ``[L, N, E]`` bool; experts ``[T, L, K]``; token_device
    ``[T, L]``. Returns ``[T, L, K]`` int64."""
    T, L, K = experts.shape
    out = np.zeros((T, L, K), np.int64)
    for t in range(T):
        for l in range(L):
            d = int(token_device[t, l])
            holders = []
            for k in range(K):
                e = int(experts[t, l, k])
                home = int(expert_device[l, e])
                holders.append([home] + [r for r in range(holds.shape[2]) if holds[l, e, r] and r != home])
            goes_to = {h[0] for h in holders if len(h) == 1 and d not in h}
            for k in range(K):
                h = holders[k]
                if d in h:
                    out[t, l, k] = d
                elif len(h) == 1:
                    out[t, l, k] = h[0]
            for k in range(K):
                h = holders[k]
                if d in h or len(h) == 1:
                    continue
                shared = [r for r in h if r in goes_to]
                out[t, l, k] = shared[0] if shared else h[(t * K + k) % len(h)]
                goes_to.add(int(out[t, l, k]))
    return out


@pytest.fixture(scope="session")
def solve_cache():
    """Placements solved on the real trace, kept under ``$SEMMOE_CACHE_DIR`` (default
    ``~/.cache/vllm-semmoe``)/solves, keyed by the profile, the solve's parameters and a hash of
    the solver sources (:func:`vllm_semmoe.evaluation.evaluate.placement_cache`): an edited solver
    solves again."""
    from vllm_semmoe.evaluation.evaluate import placement_cache
    from vllm_semmoe.testing.checkpoints import cache_dir

    return placement_cache(str(cache_dir() / "solves"))


@pytest.fixture(scope="session")
def tp_seed0(dev_trace, solve_cache):
    """``(profile, held_out, placement, tables)``: the real trace's seed-0 split as the acceptance
    figures split it (20 % profiled, the tuning split in neither part), Sem-MoE's TP placement for
    EP 8 solved on the profile (through :func:`solve_cache`: the acceptance figures' entry) and
    its TP tables."""
    from vllm_semmoe.core.policy import get_policy
    from vllm_semmoe.core.tables import build_tables
    from vllm_semmoe.evaluation.evaluate import solve_key

    profile, held_out = dev_trace.split(0.2, seed=0, hold_out_tuning=True)
    placement = solve_cache(solve_key("semmoe", profile, 8, "tp"),
                            lambda: get_policy("semmoe").solve(profile, 8, mode="tp"))
    return profile, held_out, placement, build_tables(profile, placement, mode="tp")
