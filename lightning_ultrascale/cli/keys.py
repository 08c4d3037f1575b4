"""Short command-line keys for the plugin nodes, and the config key of every setting an error names.

Each plugin is one node under ``parallel`` (``parallel.tp.size``, ``parallel.pp.schedule``, ...),
built from its ``_target_``. The short keys users type stay valid: ``parallel.<node>=V`` sets the
node's ``size``, ``parallel.<node>_<arg>=V`` its ``arg``, and a few keys older than the nodes keep
their names (:data:`LEGACY`). A new plugin node gets both forms without any edit here.

Errors name a setting as the CLI user wrote it: ``parallel.tp=3``, not ``TensorParallel(size=3)``
(see :func:`lightning_ultrascale.errors.config_keys`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig

#: Short keys whose names do not follow ``parallel.<node>[_<arg>]`` (and one older than ``checkpoint.*``).
LEGACY: dict[str, str] = {
    "parallel.dp": "parallel.zero.size",
    "parallel.replicate": "parallel.zero.replicate",
    "parallel.bucket_mb": "parallel.zero.bucket_mb",
    "parallel.reshard_after_forward": "parallel.zero.reshard_after_forward",
    "parallel.reduce_dtype": "parallel.zero.reduce_dtype",
    "parallel.sequence_parallel": "parallel.tp.sequence_parallel",
    "parallel.loss_parallel": "parallel.tp.loss_parallel",
    "parallel.recompute": "parallel.recompute.mode",
    "parallel.compile": "parallel.compile.enabled",
    "checkpoint_every_n_steps": "checkpoint.every_n_steps",
}
_SHORT = {full: short for short, full in LEGACY.items()}


def plugin_nodes(*config_dirs: Path) -> list[str]:
    """The plugin nodes: the config groups under each directory's ``parallel/``, longest name first."""
    groups = [d / "parallel" for d in config_dirs if (d / "parallel").is_dir()]
    names = {node.name for group in groups for node in group.iterdir() if node.is_dir()}
    return sorted(names, key=lambda name: (-len(name), name))


def expand(override: str, nodes: Iterable[str]) -> str:
    """``parallel.tp=2`` -> ``parallel.tp.size=2``, ``parallel.pp_schedule=zbv`` -> ``parallel.pp.schedule=zbv``.

    Example:
        >>> expand("parallel.cp_method=ring", ["cp", "tp"]), expand("trainer.devices=4", ["cp"])
        ('parallel.cp.method=ring', 'trainer.devices=4')
    """
    prefix = override[: len(override) - len(override.lstrip("+~"))]
    key, sep, value = override[len(prefix) :].partition("=")
    if key in LEGACY:
        return f"{prefix}{LEGACY[key]}{sep}{value}"
    if not key.startswith("parallel.") or key.count(".") != 1:
        return override
    name = key.removeprefix("parallel.")
    for node in nodes:
        if name == node:
            return f"{prefix}parallel.{node}.size{sep}{value}"
        if name.startswith(f"{node}_"):
            return f"{prefix}parallel.{node}.{name.removeprefix(node + '_')}{sep}{value}"
    return override


def short_key(node: str, arg: str) -> str:
    """The key a user types for ``arg`` of plugin ``node`` (the inverse of :func:`expand`)."""
    full = f"parallel.{node}.{arg}"
    if full in _SHORT:
        return _SHORT[full]
    return f"parallel.{node}" if arg == "size" else f"parallel.{node}_{arg}"


def error_keys(cfg: DictConfig) -> dict[tuple[str, str], str]:
    """``(class name, argument) -> config key`` of every plugin node, the DataModule, each callback and the profiler."""
    keys: dict[tuple[str, str], str] = {}
    for node, settings in cfg.parallel.items():
        target = settings.get("_target_") if isinstance(settings, DictConfig) else None
        if target:
            owner = str(target).rsplit(".", 1)[-1]
            keys.update({(owner, str(arg)): short_key(str(node), str(arg)) for arg in settings if arg != "_target_"})
    # The DataModule's arguments are its node's keys, whatever class the node builds.
    data_class = str(cfg.data.get("_target_", "UltraScaleDataModule")).rsplit(".", 1)[-1]
    keys.update({(data_class, str(arg)): f"data.{arg}" for arg in cfg.data if arg != "_target_"})
    keys.update({("FP8Precision", arg): f"precision.{key}" for arg, key in FP8_KEYS.items()})
    # Each callback's arguments are its node's keys (callbacks.<name>.<arg>), the profiler's profiler.<arg>.
    nodes = {f"callbacks.{name}": node for name, node in (cfg.get("callbacks") or {}).items()}
    nodes["profiler"] = cfg.get("profiler")
    for where, node in nodes.items():
        target = node.get("_target_") if isinstance(node, DictConfig) else None
        if target:
            owner = str(target).rsplit(".", 1)[-1]
            keys.update({(owner, str(arg)): f"{where}.{arg}" for arg in node if arg != "_target_"})
    return keys


#: FP8Precision's arguments and their keys in the ``precision`` config group.
FP8_KEYS = {"recipe": "fp8", "precision": "precision", "emulate": "emulate"}
