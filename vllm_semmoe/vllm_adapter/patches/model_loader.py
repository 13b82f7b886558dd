"""vLLM's model loader: the placement goes in before the weights load, and the engine state is made."""

from __future__ import annotations

import functools

from .. import compat
from ..config import SemMoEConfig
from ..install import build_state, replica_slots
from .base import Patch


def _create_model(original):
    @functools.wraps(original)
    def create_model(self, vllm_config, model_config, prefix: str = ""):
        config = SemMoEConfig.from_additional_config(getattr(vllm_config, "additional_config", None))
        if config is not None:  # engines built without EngineArgs are refused here
            compat.check_features(config, vllm_config.parallel_config)
        tables = config.read_tables() if config is not None else None  # read once, before the build
        with compat.redundant_expert_slots(vllm_config, replica_slots(tables)):
            model = original(self, vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        if config is not None:
            build_state(model, config, vllm_config, tables)
        return model

    return create_model


CREATE_MODEL = Patch(
    "vllm.model_executor.model_loader.base_loader.BaseModelLoader.create_model",
    "build the MoE layers with the tables' replica slots, install the placement before the weights load "
    "and create the engine's state", _create_model)

PATCHES = (CREATE_MODEL,)
