"""Everything that touches vLLM internals lives in this folder (a vLLM upgrade touches only it).

- :mod:`.compat`: every vLLM internal the adapter reaches, the supported versions (0.32, 0.33),
  the start-up check, and the accessors (per-version differences live there only);
- :mod:`.doctor`: ``semmoe doctor``, the same check on a vLLM source tree or wheel (``ast``);
- :mod:`.plugin`: the ``vllm.general_plugins`` entry point;
- :mod:`.patches`: every patch of vLLM, in one place (one module per patched area, each patch
  naming its internal and why; installed and removed there), and the list of what each engine
  changes on its own vLLM objects;
- :mod:`.state`: one :class:`~.state.EngineState` per engine, one :class:`~.state.ApiServerState` per
  routing API server, reached from the hooks;
- :mod:`.ops`: the custom ops that run the per-step work inside compiled models;
- :mod:`.config`: the ``additional_config["semmoe"]`` settings;
- :mod:`.replacement`: applying a placement at weight-load time;
- :mod:`.capture`: live routing capture and live LAR;
- :mod:`.tp_shuffle`: the Attention-TP token shuffle (``mode: tp``);
- :mod:`.dp_routing`: Sem-MoE's DP rank choice (``mode: dp``);
- :mod:`.cpu_fixes`: which of the patches fix vLLM's CPU build (TP+EP, DP+EP) and the version and
  platform guard that installs them.
"""
