"""Fixtures shared by tests/ and benchmarks/ (imported by both conftest.py files)."""

import os
from pathlib import Path

import numpy as np
import pytest

from vllm_semmoe.trace import load_trace

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("SEMMOE_DATA_DIR", REPO.parent / "shared" / "data"))
DEV_TRACE = DATA_DIR / "routing" / "dsv2lite_puffin-dev.npz"


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
