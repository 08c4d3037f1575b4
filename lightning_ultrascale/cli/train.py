"""``ultrascale-train``: compose the Hydra config, build the objects, run ``Trainer.fit``.

Examples::

    ultrascale-train                                   # tiny Llama, bundled corpus, 2 CPU processes
    ultrascale-train parallel.dp=2 model=llama_tiny trainer.max_steps=50
    ultrascale-train recipe=llama3_8b                  # a whole run from recipes/llama3_8b.yaml
    ultrascale-train ckpt_path=outputs/.../checkpoints/last.ckpt trainer.max_steps=600   # resume
    ultrascale-train -m parallel=zero1,zero2 trainer.max_steps=20                        # a sweep

Every node with a ``_target_`` is built from it: each plugin under ``parallel``, each logger
under ``logger``, each callback under ``callbacks``. Short keys (``parallel.tp=2``) are expanded
to their nodes (``cli/keys.py``).

One run directory for all ranks: Hydra would otherwise make one per process (each with its own
timestamp; lightning-hydra-template #393, hydra #2070). The directory is fixed once, before any
rank starts, and handed to every rank through ``ULTRASCALE_RUN_DIR``: Lightning's own launcher
passes its environment to the processes it starts; under SLURM and torchrun the name comes from
the job id, which every rank sees. Only rank 0 writes Hydra's ``.hydra/`` record. In a sweep
(``-m``) each job gets ``<run dir>/<job number>``, and the ranks Lightning starts for a job run
that job only.

Every configuration error is raised here, before the Trainer (and so any process group) exists,
as one line naming the config key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from lightning_ultrascale.cli.keys import error_keys, expand, plugin_nodes
from lightning_ultrascale.errors import ConfigError, config_keys

log = logging.getLogger("lightning_ultrascale")

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = Path(os.environ.get("ULTRASCALE_CONFIG_DIR", REPO / "conf"))
RECIPES_DIR = Path(os.environ.get("ULTRASCALE_RECIPES_DIR", REPO / "recipes"))
MULTIRUN_FLAGS = ("-m", "--multirun")


def run_dir() -> str:
    """The run directory every rank of this job agrees on (and exports for the ranks it starts)."""
    if "ULTRASCALE_RUN_DIR" not in os.environ:
        if os.environ.get("SLURM_JOB_ID"):
            name = f"slurm-{os.environ['SLURM_JOB_ID']}"
        elif os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
            name = f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            name = _torchrun_agent_name()
        else:
            name = time.strftime("%Y-%m-%d/%H-%M-%S")
        os.environ["ULTRASCALE_RUN_DIR"] = str(Path("outputs") / name)
    return os.environ["ULTRASCALE_RUN_DIR"]


def _torchrun_agent_name() -> str:
    """A name all ranks of a torchrun job without ``--rdzv-id`` share: their agent's pid and start time.

    Timestamps taken by each rank could straddle a second. Ranks on one node are children of one
    torchrun agent; ranks on several nodes share nothing before the process group exists.
    """
    if os.environ.get("WORLD_SIZE") != os.environ.get("LOCAL_WORLD_SIZE"):
        raise ConfigError(
            "torchrun on several nodes without --rdzv-id: ranks cannot agree on a run directory; "
            "pass --rdzv-id (any id shared by all nodes) or set ULTRASCALE_RUN_DIR (recipes/torchrun.sh does)"
        )
    agent = os.getppid()
    start = Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[19]  # field 22: start time
    return f"torchrun-{agent}-{start}"


def _global_rank() -> int:
    for var in ("RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


OmegaConf.register_new_resolver("ultrascale.div", lambda a, b: int(a) // int(b), replace=True)
OmegaConf.register_new_resolver("ultrascale.run_dir", run_dir, replace=True)


#: Overrides of a model's MoE and MLA settings (``model.moe.top_k=4``).
MODEL_PARTS = ("model.moe.", "model.mla.")


def expand_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides with short plugin keys expanded to their nodes (``parallel.tp=2``)."""
    nodes = plugin_nodes(CONFIG_DIR)
    return [expand(o, nodes) for o in overrides]


def check_group_choices(overrides: list[str]) -> None:
    """``model=llama9``: name the valid options of a config group (Hydra lists its search path instead)."""
    for override in overrides:
        key, sep, value = override.lstrip("+").partition("=")
        group = CONFIG_DIR / key
        if not sep or "." in key or key.startswith("-") or not group.is_dir():
            continue
        valid = sorted(p.stem for p in group.glob("*.yaml"))
        for choice in value.strip("[]").split(","):
            if choice.strip() and choice.strip() not in valid:
                raise ConfigError(f"{key}={choice.strip()} is unknown; valid: {', '.join(valid)} (in {group})")


def hydra_argv(argv: list[str]) -> list[str]:
    """Rewrite ``recipe=NAME`` into Hydra's primary-config flags, expand short keys, fix a sweep's
    directory, and silence ``.hydra/`` off rank 0."""
    check_group_choices(argv)
    out: list[str] = []
    for arg in expand_overrides(argv):
        if arg.startswith(MODEL_PARTS):
            # Force-add: on a dense model Hydra would stop at "Key 'moe' is not in struct"; _model_config
            # then names the option, the model and what is valid instead.
            out.append("++" + arg)
        elif arg.startswith("recipe="):
            name = arg.split("=", 1)[1]
            available = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
            if name not in available:
                raise ConfigError(f"recipe={name!r} is unknown; valid: {', '.join(available)} (in {RECIPES_DIR})")
            out += [f"--config-dir={RECIPES_DIR}", f"--config-name={name}"]
        else:
            out.append(arg)
    if any(a in MULTIRUN_FLAGS for a in out) and not any(a.startswith("hydra.sweep.dir") for a in out):
        out.append(f"hydra.sweep.dir={run_dir()}")  # resolved once: jobs re-point ULTRASCALE_RUN_DIR
    if _global_rank() != 0 and not any(a.startswith("hydra.output_subdir") for a in out):
        out.append("hydra.output_subdir=null")
    return out


def main() -> None:
    """Console entry point of ``ultrascale-train``."""
    if not CONFIG_DIR.is_dir():
        raise SystemExit(
            f"ultrascale-train: config directory {CONFIG_DIR} not found; install the repository editable "
            "(pip install -e .) or set ULTRASCALE_CONFIG_DIR"
        )
    try:
        run_dir()
        sys.argv = [sys.argv[0], *hydra_argv(sys.argv[1:])]
    except ConfigError as err:
        raise SystemExit(f"ultrascale-train: {err}") from None
    hydra.main(config_path=str(CONFIG_DIR), config_name="train", version_base="1.3")(_hydra_task)()


def _hydra_task(cfg: DictConfig) -> None:
    with _one_job(), config_keys(error_keys(cfg)):
        try:
            trainer, module, datamodule = build(cfg)
            trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        except ConfigError as err:
            # One line naming option, value and valid values; no traceback for a config mistake.
            raise SystemExit(f"ultrascale-train: {err}") from None


@contextlib.contextmanager
def _one_job() -> Iterator[None]:
    """In a sweep: this job's own run directory, and ranks Lightning starts that run this job only.

    Hydra runs a sweep's jobs one after another in this process. Lightning starts each job's
    other ranks with this process's command line, which would re-run the whole sweep, so the
    command line becomes this job's overrides; the job's environment (its run directory, the
    port Lightning picked) and its process group end with it.
    """
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        yield
        return
    argv, environ = list(sys.argv), dict(os.environ)
    flags = [a for a in argv[1:] if a.startswith("-") and a not in MULTIRUN_FLAGS]
    sys.argv = [argv[0], *flags, *HydraConfig.get().overrides.task]
    os.environ["ULTRASCALE_RUN_DIR"] = HydraConfig.get().runtime.output_dir
    try:
        yield
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)


def instantiate(node: DictConfig, where: str) -> Any:
    """Build ``_target_(**settings)`` (no Hydra wrapper around its errors, so a ConfigError stays one line).

    A node may say how to install what its target needs (``_install_``); a missing package then
    fails with that hint.
    """
    settings = OmegaConf.to_container(node, resolve=True)
    assert isinstance(settings, dict)
    target, install = settings.pop("_target_"), settings.pop("_install_", None)
    try:
        return get_class(target)(**settings)
    except (ImportError, ModuleNotFoundError) as err:
        hint = f"; install it: {install}" if install else ""
        raise ConfigError(f"{where} ({target}) needs a package that is not installed ({err}){hint}") from None


def plugins(parallel: DictConfig) -> list[Any]:
    """The parallelism plugins: one per node of the ``parallel`` group."""
    return [instantiate(node, f"parallel.{name}") for name, node in parallel.items() if "_target_" in node]


def _callbacks(cfg: DictConfig) -> list[Any]:
    from lightning.pytorch.callbacks import ProgressBar

    built = [instantiate(node, f"callbacks.{name}") for name, node in (cfg.get("callbacks") or {}).items()]
    if cfg.trainer.get("enable_progress_bar", True):
        return built
    return [c for c in built if not isinstance(c, ProgressBar)]  # Lightning refuses a bar it may not show


def build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """Turn a composed config into (Trainer, LlamaModule, DataModule); validates everything first."""
    with config_keys(error_keys(cfg)):
        return _build(cfg)


def _module_and_data(cfg: DictConfig) -> tuple[Any, Any]:
    from lightning_ultrascale.data import UltraScaleDataModule
    from lightning_ultrascale.module import LlamaModule, OptimConfig

    optim = {k: (tuple(v) if k == "betas" else v) for k, v in cfg.optim.items() if k != "grad_clip"}
    init_from = cfg.model.get("init_from")
    kernels = cfg.get("kernels") or {}
    module = LlamaModule(
        _model_config(cfg.model),
        optim=OptimConfig(**optim),
        seed=cfg.seed,
        init_from=init_from,
        kernels=kernels.get("name", "reference"),
        fused_cross_entropy=kernels.get("fused_cross_entropy"),
    )
    data = cfg.data
    datamodule = UltraScaleDataModule(
        source=data.source,
        seq_len=data.seq_len,
        micro_batch_size=data.micro_batch_size,
        dtype=data.get("dtype", "uint16"),
        val_fraction=data.val_fraction,
        seed=cfg.seed,
        num_workers=data.num_workers,
    )
    if data.seq_len > module.config.max_seq_len:
        raise ConfigError(
            f"data.seq_len={data.seq_len} exceeds model.max_seq_len={module.config.max_seq_len} of {cfg.model.name}"
        )
    return module, datamodule


def _model_config(model: DictConfig) -> Any:
    """The named config, with the ``model.moe.*`` and ``model.mla.*`` keys of the model node applied."""
    from lightning_ultrascale.models import MODEL_CONFIGS, get_model_config

    config = get_model_config(model.name)
    for part in ("moe", "mla"):
        node = model.get(part)
        if node is None:
            continue
        settings = OmegaConf.to_container(node)
        assert isinstance(settings, dict)
        current = getattr(config, part)
        if current is None:
            having = ", ".join(n for n, c in MODEL_CONFIGS.items() if getattr(c, part) is not None)
            what = "mixture of experts" if part == "moe" else "multi-head latent attention"
            raise ConfigError(
                f"model.{part}.{next(iter(settings), '')} is set, but model={model.name} has no {what}; "
                f"valid: a model with one ({having})"
            )
        fields = [f.name for f in dataclasses.fields(current)]
        unknown = sorted(set(settings) - set(fields))
        if unknown:
            raise ConfigError(f"model.{part}.{unknown[0]} is unknown; valid: {', '.join(fields)}")
        config = dataclasses.replace(config, **{part: dataclasses.replace(current, **settings)})
    config.validate()
    return config


def _precision(node: DictConfig) -> dict[str, Any]:
    """The Trainer's precision argument, or, with ``precision.fp8``, the FP8Precision plugin carrying it."""
    fp8 = node.get("fp8")
    if fp8 is None:
        return {"precision": node.precision}
    from lightning_ultrascale.fp8.precision import FP8Precision

    return {"plugins": [FP8Precision(fp8, node.precision, emulate=node.get("emulate"))]}


def _build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    import lightning as L

    from lightning_ultrascale.checkpoint import check_checkpoint_model, check_checkpoint_path
    from lightning_ultrascale.guard import NonFiniteGuard
    from lightning_ultrascale.parallel.dims import DataShape
    from lightning_ultrascale.strategy import UltraScaleStrategy

    module, datamodule = _module_and_data(cfg)
    if cfg.ckpt_path is not None:
        check_checkpoint_path(cfg.ckpt_path)
        check_checkpoint_model(cfg.ckpt_path, module.hparams)
    strategy = UltraScaleStrategy(
        *plugins(cfg.parallel),
        seed=cfg.seed,
        async_checkpoint=cfg.checkpoint["async"],
        guard=NonFiniteGuard(skip_step=cfg.guard.skip_step),
        tf32=cfg.get("tf32", True),
    )
    t, data = cfg.trainer, cfg.data
    shape = DataShape.declared_by(datamodule)
    assert shape is not None
    shape = dataclasses.replace(shape, global_batch_size=data.global_batch_size)
    strategy.validate(module.model_spec, shape, world_size=int(t.devices) * int(t.num_nodes))
    accumulate = strategy.parallel_dims.grad_accumulation(data.global_batch_size, data.micro_batch_size)
    loggers = [instantiate(node, f"logger.{name}") for name, node in (cfg.get("logger") or {}).items()]
    out = Path(run_dir())
    # Every key of the trainer group goes to L.Trainer as it is: `trainer.X=...` overrides any Trainer argument.
    trainer = L.Trainer(
        **OmegaConf.to_container(t, resolve=True),  # type: ignore[arg-type]
        strategy=strategy,
        **_precision(cfg.precision),
        accumulate_grad_batches=accumulate,
        gradient_clip_val=cfg.optim.get("grad_clip"),
        logger=loggers or False,
        callbacks=_callbacks(cfg),
        default_root_dir=str(out),
    )
    if trainer.global_rank == 0:
        log.info("run directory: %s", out.resolve())
        log.info("layout: %s, gradient accumulation %d", strategy.describe(), accumulate)
    return trainer, module, datamodule


if __name__ == "__main__":
    main()
