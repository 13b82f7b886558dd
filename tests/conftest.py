"""Suite-wide set-up. Every process the suite starts (xdist workers, engines, servers, launched
ranks: they inherit this environment) gets ``startup/sitecustomize.py`` (garbage collection that
does not re-scan vLLM's import-time heap) and ``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads that
have finished their share wait asleep instead of spinning, which on a 2-core machine running
three test processes took CPU from the others; and ``SEMMOE_TEST_INDUCTOR_CACHE``, one Inductor
cache for the run's compiled engines (created here, removed when this process ends; what an
engine computes is the same, see ``startup/sitecustomize.py``)."""

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

STARTUP = Path(__file__).resolve().parent / "startup"
if str(STARTUP) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(STARTUP), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "SEMMOE_TEST_INDUCTOR_CACHE" not in os.environ:  # the run's first process; the rest inherit it
    os.environ["SEMMOE_TEST_INDUCTOR_CACHE"] = _inductor = tempfile.mkdtemp(prefix="semmoe-inductor-")
    atexit.register(shutil.rmtree, _inductor, ignore_errors=True)
if "sitecustomize" not in sys.modules:  # this process started before PYTHONPATH named it
    _spec = importlib.util.spec_from_file_location("sitecustomize", STARTUP / "sitecustomize.py")
    sys.modules["sitecustomize"] = _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)

import pytest  # noqa: E402
from shared_fixtures import dev_trace, dev_trace_path, small_trace, solve_cache  # noqa: E402,F401


@pytest.fixture(scope="module")
def triton_interpreter():
    """``TRITON_INTERPRET=1`` for a test module: the Triton kernels' dispatchers read it at call
    time, so on CPU they run in Triton's interpreter (the compile-only and CUDA tests unset it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


#: Files that start vLLM engines or solve the full trace, then the other files that take more than
#: about ten seconds, longest first: the order they are handed out in. Under ``scripts/test.sh``
#: (``pytest -n 3 --dist loadfile``) each process starts with one whole file and takes the next
#: file in collection order when it is within two tests of the end of its own (pytest-xdist's
#: rule), the short files filling in after these, so that the run ends on short files rather
#: than with one process alone on a long one; a file keeps its own test order.
LONGEST_FIRST = ("test_cpu_parallel.py", "test_compiled.py", "test_architectures.py", "test_dp_routing.py",
                 "test_durable_capture.py", "test_multinode.py", "test_acceptance.py", "test_capture_honesty.py",
                 "test_serve.py", "test_plugin.py", "test_engine_state.py", "test_tiny_moe_asset.py",
                 "test_profile_cli.py", "test_evaluate.py", "test_placement.py", "test_vllm_compat.py",
                 "test_bench_ep.py", "test_cli.py", "test_report.py", "test_errors.py", "test_scale.py",
                 "test_collective_meter.py", "test_interop.py", "test_cost_model.py", "test_tables.py",
                 "test_time_objective.py")


def pytest_configure(config):
    """Keep :data:`LONGEST_FIRST`'s order under ``--dist loadfile``: pytest-xdist otherwise hands
    files out by how many tests each holds (``--loadscope-reorder``, its default), which sends the
    engine files of few tests (one in ``test_multinode.py``) out last, to run alone at the end."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
