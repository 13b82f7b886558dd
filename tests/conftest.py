import pytest
from shared_fixtures import dev_trace, dev_trace_path, small_trace  # noqa: F401


@pytest.fixture(scope="module")
def triton_interpreter():
    """``TRITON_INTERPRET=1`` for a test module: the Triton kernels' dispatchers read it at call
    time, so on CPU they run in Triton's interpreter (the compile-only and CUDA tests unset it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


#: Files that start vLLM engines or solve the full trace, in the order they are handed out. Under
#: ``scripts/test.sh`` (``pytest -n 3 --dist loadfile``) each process takes whole files in
#: collection order, two at the start: the three longest first, then the three next in reverse
#: (so the longest pairs with the shortest of them), the short files filling in around them; a
#: file keeps its own test order.
LONGEST_FIRST = ("test_architectures.py", "test_cpu_parallel.py", "test_dp_routing.py", "test_plugin.py",
                 "test_durable_capture.py", "test_compiled.py", "test_bench_serve_repeat.py", "test_acceptance.py",
                 "test_multinode.py", "test_capture_honesty.py", "test_serve.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
