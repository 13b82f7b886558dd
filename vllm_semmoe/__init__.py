"""vllm-semmoe: Semantic Parallelism (Sem-MoE) for vLLM.

Packages, each importing only those listed before it:

- :mod:`.core`: the algorithms and formats: routing traces and captures, expert placement
  policies, lookup tables, the online scheduling decisions, serving modes;
- :mod:`.kernels`: the decisions and the EP exchange as ``torch`` operations on the tensors' own
  device (twins of the core's Numba kernels, tested against them);
- :mod:`.evaluation`: the offline evaluator, the cost model, step times, the time objective and
  the report;
- :mod:`.vllm_adapter`: everything that touches vLLM's internals (the plugin);
- :mod:`.tools`: ``bench-serve``, ``bench-ep``, the engine workflows, import/export;
- :mod:`.cli`: the ``semmoe`` command.

Importing this package, :mod:`.core`, :mod:`.kernels` or :mod:`.evaluation` does not import vLLM.
"""

__version__ = "0.1.0"
