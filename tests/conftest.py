import pytest
from process_groups import process_group
from shared_fixtures import dev_trace, dev_trace_path, small_trace  # noqa: F401


@pytest.fixture(scope="module")
def triton_interpreter():
    """``TRITON_INTERPRET=1`` for a test module: the Triton kernels' dispatchers read it at call
    time, so on CPU they run in Triton's interpreter (the compile-only and CUDA tests unset it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


#: Files that start vLLM engines or solve the full trace, longest first: the order their groups
#: are handed out in. Under ``scripts/test.sh`` (``pytest -n N --dist loadgroup``) each process
#: takes one group of tests (:func:`process_groups.process_group`) and the next group in
#: collection order when one test of its own is left (:func:`pytest_xdist_make_scheduler`), the
#: short files filling in after these; a file keeps its own test order.
LONGEST_FIRST = ("test_dp_routing.py", "test_architectures.py", "test_cpu_parallel.py", "test_compiled.py",
                 "test_durable_capture.py", "test_multinode.py", "test_acceptance.py", "test_capture_honesty.py",
                 "test_serve.py", "test_plugin.py", "test_engine_state.py", "test_tiny_moe_asset.py",
                 "test_profile_cli.py")


def pytest_configure(config):
    """Keep :data:`LONGEST_FIRST`'s order: pytest-xdist otherwise hands groups out by how many
    tests each holds (``--loadscope-reorder``, its default), which sends the engine groups of few
    tests out last, to run alone at the end."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups of :func:`process_groups.process_group`, handing a
    process its next group only when one test of its groups is left. pytest-xdist's own rule is
    two, which queues a long engine group behind the last two tests of another's while the
    other processes idle; one, not none, because a process holds its last test back until it
    knows what runs after it. (pytest-xdist's own ``xdist_group`` marks do not reach its
    scheduler under pytest 9, which no longer takes a test id rewritten after collection.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByProcessGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return process_group(nodeid)

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return ByProcessGroup(config, log)
