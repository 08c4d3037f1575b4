"""Models that declare their parallel plan, and the registry of named configurations.

Example:
    >>> from lightning_ultrascale.models import build_model, get_model_config
    >>> get_model_config("llama3_8b").n_kv_heads
    8
    >>> model = build_model("llama3_70b", device="meta")  # no memory: materialise after sharding
    >>> model.spec.n_layers
    80
"""

from __future__ import annotations

from types import ModuleType

import torch

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import deepseek, llama, mixtral, qwen3
from lightning_ultrascale.models.common.decoder import Llama, LlamaConfig, RopeScaling
from lightning_ultrascale.models.common.mla import MLAConfig
from lightning_ultrascale.models.common.moe import MoEConfig
from lightning_ultrascale.models.spec import (
    AuxLossModel,
    ModelSpec,
    PipelineLoss,
    RoutedExperts,
    SequenceStatistics,
    SpecifiedModel,
    StagedModel,
    StepMaxima,
    StepSums,
    SwappableAttention,
    declares,
    require_spec,
    spec_of,
)

__all__ = [
    "FAMILIES",
    "MODEL_CONFIGS",
    "AuxLossModel",
    "Llama",
    "LlamaConfig",
    "MLAConfig",
    "MoEConfig",
    "ModelSpec",
    "PipelineLoss",
    "RopeScaling",
    "RoutedExperts",
    "SequenceStatistics",
    "SpecifiedModel",
    "StagedModel",
    "StepMaxima",
    "StepSums",
    "SwappableAttention",
    "build_model",
    "declares",
    "get_model_config",
    "require_spec",
    "spec_of",
]

#: Every family's folder, in the order its presets are listed; each holds ``CONFIGS`` (name -> config).
FAMILIES = (llama, mixtral, deepseek, qwen3)


def _gather(families: tuple[ModuleType, ...]) -> dict[str, LlamaConfig]:
    """Every family's presets under their names; two families may not claim one name."""
    configs: dict[str, LlamaConfig] = {}
    for family in families:
        for name, config in family.CONFIGS.items():
            if name in configs:
                raise ConfigError(f"model preset {name!r} is in two families; {family.__name__} must rename its own")
            configs[name] = config
    return configs


MODEL_CONFIGS = _gather(FAMILIES)


def get_model_config(name: str) -> LlamaConfig:
    """The named configuration, or a :class:`ConfigError` listing the known names.

    Example:
        >>> get_model_config("llama_tiny").dim
        64
    """
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise ConfigError(f"model={name} is unknown; valid: {', '.join(MODEL_CONFIGS)}") from None


def build_model(name_or_config: str | LlamaConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> Llama:
    """Build a model on ``device``, initialised from ``seed`` unless ``device`` is meta.

    A meta model has shapes and no storage: shard it first, then ``to_empty(device=...)`` and
    ``init_weights(seed)`` give each rank its part of the same weights a CPU build would have.

    Example:
        >>> model = build_model("llama_tiny", seed=0)
        >>> sum(p.numel() for p in model.parameters())
        238144
    """
    cfg = get_model_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    device = torch.device(device)
    with torch.device(device):
        model = Llama(cfg)
    if device.type != "meta":
        model.init_weights(seed)
    return model
