"""vLLM's Triton kernel re-binding scan (model runner v1 versions).

The scan walks every loaded module and calls ``vars(value)`` on its attributes; llvmlite's
ctypes wrappers (loaded with Numba, which the plugin uses) answer ``__dict__`` with a non-dict
and crash worker start-up. The scan's module is given a ``vars`` that treats such objects as
having no attributes. 0.34's scan (``_rebind_impls``) tolerates them itself: nothing is
installed there.
"""

from __future__ import annotations

import warnings

from .base import Patch


def safe_vars(obj):
    """``vars(obj)``, or ``{}`` when ``obj`` has no dict namespace."""
    with warnings.catch_warnings():  # deprecated module attributes warn when touched
        warnings.simplefilter("ignore")
        namespace = getattr(obj, "__dict__", None)
    return namespace if isinstance(namespace, dict) else {}


REBIND_SCAN = Patch(
    "vllm.triton_utils.dispatcher._rebind_kernels",
    "give the re-binding scan a vars() that tolerates llvmlite's ctypes wrappers, which crash it otherwise",
    lambda original: safe_vars, owner="vllm.triton_utils.dispatcher", attribute="vars")

PATCHES = (REBIND_SCAN,)


def needed() -> bool:
    """Whether this vLLM has the scan (the module and its ``_rebind_kernels``)."""
    try:
        return callable(getattr(REBIND_SCAN.target(), "_rebind_kernels", None))
    except ImportError:
        return False
