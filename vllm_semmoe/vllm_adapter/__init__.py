"""Everything that touches vLLM internals lives in this folder (a vLLM upgrade touches only it).

- :mod:`.plugin`: the ``vllm.general_plugins`` entry point and the version/internals check;
- :mod:`.config`: the ``additional_config["semmoe"]`` settings;
- :mod:`.replacement`: applying a placement at weight-load time;
- :mod:`.capture`: live routing capture and live LAR;
- :mod:`.cpu_fixes`: version-guarded fixes that make TP+EP and DP+EP run on vLLM's CPU build.
"""
