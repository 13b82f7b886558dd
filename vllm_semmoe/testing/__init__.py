"""Test helpers that ship with the package (tiny random checkpoints of real MoE architectures)."""
