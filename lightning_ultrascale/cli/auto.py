"""``parallel=auto``: the planner's best layout for a run, chosen before any process group.

The search (:func:`lightning_ultrascale.plan.search`) prices every valid layout of the run's
workload on its world size and device and ranks those that fit; the run takes the first, its
plugins built by the planner itself, and its batch per data rank as ``data.micro_batch_size``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_ultrascale.errors import ConfigError, is_positive_int

log = logging.getLogger(__name__)

#: CUDA device names (as torch reports them) -> built-in profile.
_CUDA_PROFILES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


def device_profile(gpu: Any, accelerator: str) -> Any:
    """The :class:`~lightning_ultrascale.plan.Hardware` to plan on: ``gpu`` if given, else the device's."""
    from lightning_ultrascale.plan import get_hardware

    if gpu is not None:
        return get_hardware(OmegaConf.to_container(gpu) if isinstance(gpu, DictConfig) else gpu)
    if accelerator == "cpu":
        return get_hardware("cpu")
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    for key, profile in _CUDA_PROFILES:
        if key in name:
            return get_hardware(profile)
    raise ConfigError(
        f"parallel.auto.gpu=null: the device ({name}) has no built-in profile; valid: parallel.auto.gpu=h100, h200, "
        "a100 or cpu, or a mapping of its figures (parallel.auto.gpu={name: x, peak_flops: 4e14, memory_bytes: ...})"
    )


def choose_layout(cfg: DictConfig, world_size: int, workload: Any) -> tuple[list[Any], int]:
    """The planner's best layout for ``cfg``'s ``workload`` on ``world_size`` ranks: (plugins, data.micro_batch_size).

    Logs the chosen layout, its predicted step time and memory, and why the runner-up lost.
    """
    from lightning_ultrascale.plan import search

    auto = cfg.parallel.auto
    pins = auto.get("space")
    space = OmegaConf.to_container(pins, resolve=True) if isinstance(pins, DictConfig) else dict(pins or {})
    assert isinstance(space, Mapping)
    gpu = device_profile(auto.get("gpu"), str(cfg.trainer.accelerator))
    result = search(workload, world_size, gpu, space=space)  # type: ignore[arg-type]
    best = result.best
    runner = result.fitting[1] if len(result.fitting) > 1 else None
    why = (
        f"the runner-up, {runner.candidate.label()}, {result.why_slower(runner)}"
        if runner
        else "the only one that fits"
    )
    log.info(
        "parallel=auto on %d x %s: %s (predicted %.3f s per step, %.1f GiB per rank; %d layouts fit); %s",
        world_size, gpu.name, best.candidate.label(), best.step_time, best.peak / 2**30, len(result.fitting), why,
    )  # fmt: skip
    return list(copy.deepcopy(best.candidate.plugins)), best.candidate.batch_per_rank


def world_size_of(trainer: DictConfig) -> int:
    """``trainer.devices x trainer.num_nodes``, which ``parallel=auto`` plans for."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    if not is_positive_int(devices):
        raise ConfigError(
            f"trainer.devices={devices!r}: parallel=auto plans for a known number of ranks; valid: a positive "
            "integer (e.g. trainer.devices=8)"
        )
    return devices * int(nodes)
