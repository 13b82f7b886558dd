"""Start-up of every Python process the test suite runs (``conftest.py`` puts this folder on
``PYTHONPATH``): garbage collection that does not re-scan vLLM's import-time heap.

A process that imports vLLM holds about 620,000 objects the collector tracks (modules, classes,
functions: alive until the process ends). Python's automatic full collections run about nine
times while they are imported, and vLLM calls ``gc.collect()`` several times per engine start
(after loading weights, before freezing its own heap); each pass scans the whole heap, about
0.35 CPU-seconds here. Measured with ``perf`` on the suite's engine tests, the collector took
about 30 % of their CPU time, and the suite is CPU-bound. So in test processes:

- automatic full collections are rare (``gc.set_threshold``'s third value); young generations
  are collected as usual, and every explicit ``gc.collect()`` still runs in full;
- at vLLM's first ``load_general_plugins()`` (every vLLM process calls it when its first engine
  is configured, before any engine object exists) the surviving heap is frozen (``gc.freeze``),
  as vLLM freezes its own heap once an engine has started. vLLM unfreezes everything when an
  engine shuts down, so what an engine leaves behind is collected as it would be otherwise; and
  the heap is unfrozen at exit, so that interpreter shutdown finalizes it as usual (frozen
  objects outlive it, and extensions such as Triton's then report them as leaked).

And one cache of compiled kernels for the whole suite. vLLM points ``TORCHINDUCTOR_CACHE_DIR``
at a folder per hash of the engine's whole configuration, which includes the plugin's table and
capture paths, so every compiled engine in the suite compiled every kernel again (mostly
``g++``: 15-20 CPU-seconds per engine for the tiny model). Inductor's own caches in that folder (FX
graphs, AOT autograd, generated C++ and its built libraries) are keyed by their content: the
traced graph, its inputs' metadata, the compiler's configuration and versions. Where
``SEMMOE_TEST_INDUCTOR_CACHE`` names a folder, every write of ``TORCHINDUCTOR_CACHE_DIR`` in
this process (vLLM's included) names that folder instead; an engine still traces its model and
still builds every graph that differs, it only reuses what an identical graph built before.

Nothing here changes what a program computes: only when unreachable cycles are reclaimed, and
where identical compiled kernels are looked up. It imports nothing of ``vllm_semmoe`` (the
freeze is :func:`vllm_semmoe.testing.launcher.freeze_heap`'s, written out): the plugin-free
baseline processes check that none of it is loaded.
"""

import atexit
import gc
import importlib.abc
import importlib.util
import os
import sys

gc.set_threshold(700, 10, 1000)

_SHARED_INDUCTOR_CACHE = os.environ.get("SEMMOE_TEST_INDUCTOR_CACHE")
if _SHARED_INDUCTOR_CACHE:
    _environ_setitem = os._Environ.__setitem__

    def _setitem(self, key, value):
        if key == "TORCHINDUCTOR_CACHE_DIR" and self is os.environ:
            value = _SHARED_INDUCTOR_CACHE
        _environ_setitem(self, key, value)

    os._Environ.__setitem__ = _setitem
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _SHARED_INDUCTOR_CACHE


class _FreezeAtFirstPluginLoad(importlib.abc.MetaPathFinder):
    """Wraps ``vllm.plugins.load_general_plugins`` as ``vllm.plugins`` is imported."""

    def find_spec(self, name, path, target=None):
        if name != "vllm.plugins":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            load = getattr(module, "load_general_plugins", None)
            if load is None:
                return
            frozen = []

            def load_general_plugins(*args, **kwargs):
                if not frozen:
                    frozen.append(True)
                    gc.collect()
                    gc.freeze()
                    atexit.register(gc.unfreeze)
                return load(*args, **kwargs)

            module.load_general_plugins = load_general_plugins

        spec.loader.exec_module = exec_and_wrap
        return spec


if "vllm.plugins" not in sys.modules:
    sys.meta_path.insert(0, _FreezeAtFirstPluginLoad())
