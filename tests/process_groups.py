"""Which tests run together in one test process under ``scripts/test.sh`` (tests/conftest.py's
scheduler): a file's tests, except in the files that split where their parts share no engine,
so that the parts run side by side. Decided from the test's id alone (the scheduling process
collects no tests)."""

from __future__ import annotations

from vllm_semmoe.testing.checkpoints import ARCHITECTURES

#: the architectures with cells of their own in test_architectures.py (gpt-oss is refused at
#: start: its one cell joins the ``other`` group)
SERVED_ARCHS = tuple(a for a in ARCHITECTURES if a != "gpt_oss")

#: test_cpu_parallel.py's engine tests by what they share: ``serve`` the ``vllm serve`` DP 2
#: runs, ``shuffle`` the ``tp`` mode runs on Sem-MoE tables, ``tp`` the placement-only TP 2 + EP
#: runs; the rest stay with the file. Each part starts its own TP 1 reference (and ``shuffle``
#: its own ShareGPT profile).
CPU_PARALLEL = {
    "test_serve_dp2_matches_tp1": "serve",
    "test_tp2_srs_sag_shuffle": "shuffle", "test_tp2_shuffle_serves_replicas": "shuffle",
    "test_tp4_shuffle_chooses_among_replica_copies": "shuffle",
    "test_tp2_expert_parallel_matches_tp1": "tp", "test_tp2_expert_parallel_with_replacement": "tp",
}


def arch_group(arch: str) -> str:
    """The group of test_architectures.py's cells of ``arch``: the architecture itself (its
    baselines and multi-rank process are its own), or ``other`` for the single cells."""
    return arch if arch in SERVED_ARCHS else "other"


def process_group(nodeid: str) -> str:
    """``file`` or ``file::part`` for a test id such as ``tests/test_x.py::test_y[param]``."""
    path, _, test = nodeid.partition("::")
    name = path.rsplit("/", 1)[-1]
    function, _, param = test.partition("[")
    if name == "test_architectures.py":
        part = arch_group(param.rstrip("]"))
    else:
        part = CPU_PARALLEL.get(function) if name == "test_cpu_parallel.py" else None
    return f"{name}::{part}" if part else name
