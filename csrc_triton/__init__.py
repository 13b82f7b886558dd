"""Triton kernels for Sem-MoE's shuffled reduce-scatter / all-gather (SRS/SAG).

Each kernel comes with a PyTorch reference used on CPU; see the online data-scheduling work.
"""
