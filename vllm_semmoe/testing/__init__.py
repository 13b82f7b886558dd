"""Test helpers that ship with the package: tiny random checkpoints of real MoE architectures,
runs of vLLM with the plugin not loaded (the baseline of exactness checks), bounded helper
processes, TP ranks under vLLM's external launcher."""
