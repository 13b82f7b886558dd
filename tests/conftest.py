import pytest
from shared_fixtures import dev_trace, dev_trace_path, small_trace  # noqa: F401


@pytest.fixture(scope="module")
def triton_interpreter():
    """``TRITON_INTERPRET=1`` for a test module: the Triton kernels' dispatchers read it at call
    time, so on CPU they run in Triton's interpreter (the compile-only and CUDA tests unset it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield
