"""vLLM's engine arguments: the semmoe settings, tables and layout are validated at engine start."""

from __future__ import annotations

import functools

from .. import compat
from ..checks import check_engine_config
from ..config import SemMoEConfig
from .base import Patch


def _create_engine_config(original):
    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        config = SemMoEConfig.from_additional_config(getattr(vllm_config, "additional_config", None))
        if config is not None:
            compat.check_features(config, vllm_config.parallel_config)
            check_engine_config(config, vllm_config)
        return vllm_config

    return create_engine_config


CREATE_ENGINE_CONFIG = Patch(
    "vllm.engine.arg_utils.EngineArgs.create_engine_config",
    "refuse a semmoe configuration this engine cannot serve (settings, tables, layout, compilation) before "
    "vLLM builds anything", _create_engine_config)

PATCHES = (CREATE_ENGINE_CONFIG,)
