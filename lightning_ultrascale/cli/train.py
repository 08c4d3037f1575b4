"""``ultrascale-train``: compose the Hydra config, build the objects, run ``Trainer.fit``.

Examples::

    ultrascale-train                                   # tiny Llama, bundled corpus, 2 CPU processes
    ultrascale-train parallel.dp=2 model=llama_tiny trainer.max_steps=50
    ultrascale-train recipe=llama3_8b                  # a whole run from recipes/llama3_8b.yaml
    ultrascale-train ckpt_path=outputs/.../checkpoints/last.ckpt trainer.max_steps=600   # resume

One run directory for all ranks: Hydra would otherwise make one per process (each with its own
timestamp; lightning-hydra-template #393, hydra #2070). The directory is fixed once, before any
rank starts, and handed to every rank through ``ULTRASCALE_RUN_DIR``: Lightning's own launcher
passes its environment to the processes it starts; under SLURM and torchrun the name comes from
the job id, which every rank sees. Only rank 0 writes Hydra's ``.hydra/`` record.

Every configuration error is raised here, before the Trainer (and so any process group) exists.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_ultrascale.errors import ConfigError

log = logging.getLogger("lightning_ultrascale")

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = Path(os.environ.get("ULTRASCALE_CONFIG_DIR", REPO / "conf"))
RECIPES_DIR = Path(os.environ.get("ULTRASCALE_RECIPES_DIR", REPO / "recipes"))


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


def hydra_argv(argv: list[str]) -> list[str]:
    """Rewrite ``recipe=NAME`` into Hydra's primary-config flags; silence ``.hydra/`` off rank 0."""
    out: list[str] = []
    for arg in argv:
        if arg.startswith("recipe="):
            name = arg.split("=", 1)[1]
            available = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
            if name not in available:
                raise ConfigError(f"recipe={name!r} is unknown; valid: {', '.join(available)} (in {RECIPES_DIR})")
            out += [f"--config-dir={RECIPES_DIR}", f"--config-name={name}"]
        else:
            out.append(arg)
    if _global_rank() != 0 and not any(a.startswith("hydra.output_subdir") for a in out):
        out.append("hydra.output_subdir=null")
    return out


def _div(a: Any, b: Any) -> int:
    return int(a) // int(b)


def main() -> None:
    """Console entry point of ``ultrascale-train``."""
    if not CONFIG_DIR.is_dir():
        raise SystemExit(
            f"ultrascale-train: config directory {CONFIG_DIR} not found; install the repository editable "
            "(pip install -e .) or set ULTRASCALE_CONFIG_DIR"
        )
    try:
        run_dir()
    except ConfigError as err:
        raise SystemExit(f"ultrascale-train: {err}") from None
    OmegaConf.register_new_resolver("ultrascale.div", _div, replace=True)
    try:
        sys.argv = [sys.argv[0], *hydra_argv(sys.argv[1:])]
    except ConfigError as err:
        raise SystemExit(f"ultrascale-train: {err}") from None
    hydra.main(config_path=str(CONFIG_DIR), config_name="train", version_base="1.3")(_hydra_task)()


def _hydra_task(cfg: DictConfig) -> None:
    try:
        trainer, module, datamodule = build(cfg)
    except ConfigError as err:
        # One line naming option, value and valid values; no traceback for a config mistake.
        raise SystemExit(f"ultrascale-train: {err}") from None
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)


def plugins(parallel: DictConfig) -> list[Any]:
    """The parallelism plugins a ``parallel`` config group asks for."""
    from lightning_ultrascale.parallel.context import ContextParallel
    from lightning_ultrascale.parallel.data import ZeRO
    from lightning_ultrascale.parallel.pipeline import PipelineParallel
    from lightning_ultrascale.parallel.recompute import Recompute
    from lightning_ultrascale.parallel.tensor import TensorParallel

    chosen: list[Any] = [
        ZeRO(
            stage=parallel.zero_stage,
            size=parallel.dp,
            replicate=parallel.replicate,
            bucket_mb=parallel.bucket_mb,
            reshard_after_forward=parallel.reshard_after_forward,
            reduce_dtype=parallel.reduce_dtype,
        )
    ]
    if parallel.pp > 1:
        split_points = parallel.pp_split_points
        chosen.append(
            PipelineParallel(
                parallel.pp,
                parallel.pp_schedule,
                microbatches=parallel.pp_microbatches,
                virtual_stages=parallel.pp_virtual_stages,
                split_points=list(split_points) if split_points is not None else None,
            )
        )
    if parallel.cp > 1:
        chosen.append(ContextParallel(parallel.cp, parallel.cp_method, parallel.cp_kernel))
    if parallel.tp > 1:
        chosen.append(TensorParallel(parallel.tp, parallel.sequence_parallel, parallel.loss_parallel))
    if parallel.recompute != "none":
        chosen.append(Recompute(parallel.recompute, every=parallel.recompute_every))
    return chosen


def build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """Turn a composed config into (Trainer, LlamaModule, DataModule); validates everything first."""
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lightning_ultrascale.callbacks import TrainingMetrics, UltraScaleProgressBar
    from lightning_ultrascale.data import UltraScaleDataModule
    from lightning_ultrascale.module import LlamaModule, OptimConfig
    from lightning_ultrascale.strategy import UltraScaleStrategy

    module = LlamaModule(
        cfg.model.name,
        optim=OptimConfig(**{k: (tuple(v) if k == "betas" else v) for k, v in cfg.optim.items() if k != "grad_clip"}),
        seed=cfg.seed,
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

    chosen = plugins(cfg.parallel)
    strategy = UltraScaleStrategy(*chosen, seed=cfg.seed)
    t = cfg.trainer
    dims = strategy.resolve_dims(int(t.devices) * int(t.num_nodes))
    dims.validate_model(module.model_spec)
    for plugin in chosen:
        plugin.validate(dims, module.model_spec)
        plugin.validate_data(data.seq_len, data.micro_batch_size)
    accumulate = dims.grad_accumulation(data.global_batch_size, data.micro_batch_size)

    out = Path(run_dir())
    callbacks: list[Any] = [
        ModelCheckpoint(
            dirpath=str(out / "checkpoints"), every_n_train_steps=cfg.checkpoint_every_n_steps, save_last=True
        ),
        TrainingMetrics(),
        LearningRateMonitor(logging_interval="step"),
    ]
    if t.get("enable_progress_bar", True):
        callbacks.append(UltraScaleProgressBar())
    # Every key of the trainer group goes to L.Trainer as it is: `trainer.X=...` overrides any Trainer argument.
    trainer = L.Trainer(
        **OmegaConf.to_container(t, resolve=True),  # type: ignore[arg-type]
        strategy=strategy,
        precision=cfg.precision.precision,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=cfg.optim.get("grad_clip"),
        # Its own folder: CSVLogger clears the folder it logs into on a fresh start.
        logger=CSVLogger(save_dir=str(out), name="csv", version=""),
        callbacks=callbacks,
        default_root_dir=str(out),
    )
    if trainer.global_rank == 0:
        log.info("run directory: %s", out.resolve())
        log.info("layout: %s, gradient accumulation %d", strategy.describe(), accumulate)
    return trainer, module, datamodule


if __name__ == "__main__":
    main()
