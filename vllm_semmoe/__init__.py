"""vllm-semmoe: Semantic Parallelism (Sem-MoE) for vLLM.

Offline: profile routing (:mod:`.trace`, :mod:`.affinity`) → place experts
(:mod:`.policy`) → build lookup tables (:mod:`.tables`). Online: pure scheduling
decisions (:mod:`.scheduling`) used by the vLLM adapter. Importing this package does not
import vLLM.
"""

__version__ = "0.1.0"
