"""``torch`` operations on the tensors' own device: the TP decision (:mod:`.scheduling_torch`),
the serving slots of a placement (:mod:`.placement_torch`) and the EP exchange
(:mod:`.ep_exchange`). Each has a Numba or NumPy twin in :mod:`vllm_semmoe.core` that the tests
hold it to; the Triton kernels are in the top-level ``csrc_triton`` package."""
