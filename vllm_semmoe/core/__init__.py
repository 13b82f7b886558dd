"""The algorithms and formats, free of vLLM and torch.

Offline: routing traces and captures (:mod:`.trace`, :mod:`.capture_store`), co-activation
(:mod:`.affinity`), expert placement (:mod:`.policy`, :mod:`.placement`), lookup tables
(:mod:`.tables`). Online: the scheduling decisions (:mod:`.scheduling` kernels, :mod:`.schedulers`
over a whole trace, :mod:`.route` for an outside router) and the serving modes (:mod:`.modes`).
"""
