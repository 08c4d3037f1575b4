"""Runs that survive a cluster: resume from the newest checkpoint by themselves, and stop cleanly when preempted.

**Automatic resume** (``ckpt_path=auto``, the CLI's default): :func:`newest_checkpoint` finds the
newest complete checkpoint of the run directory, by step: a directory with DCP's ``.metadata`` and
our ``meta.pt`` (or a single-file checkpoint), never a ``.partial`` one (a save that did not
finish), and ``X.old`` only where ``X`` itself is missing (a crash between the two renames of a
save: ``checkpoint.publish``). None there: a fresh start. One holding more than data stops the run
(``checkpoint_io``) rather than being passed over for an older one. The run directory is the same when a job
is started again (``cli.train.run_dir``: the SLURM job id, which a requeued job keeps, torchrun's
``--rdzv-id``, or ``ULTRASCALE_RUN_DIR``), so a requeued or restarted job finds what it saved.

**Preemption** (:class:`Preemption`): SIGUSR1 (SLURM's warning before the time limit, with
``#SBATCH --signal=SIGUSR1@90``) and SIGTERM (cloud and Kubernetes preemption, ``scancel``) only set
a flag: a signal reaches ranks at different steps, and saving inside a handler would run
collectives from wherever each rank was interrupted. At every optimizer step the ranks agree
(the flag rides in the strategy's one control all-reduce, ``core/agreement.py``; under another
strategy, an all-reduce of its own): all stop at the same step, save through the strategy (every
layout, crash-safe), rank 0 asks SLURM to requeue the job (``scontrol requeue``) where it runs
under SLURM, and the run ends. Started again, ``ckpt_path=auto`` resumes from that checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import zipfile
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_ultrascale.core.agreement import StepAgreement
from lightning_ultrascale.core.checkpoint_io import CheckpointDataError, load
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.utils.comm import collective_device

__all__ = ["Preemption", "newest_checkpoint", "resolve_ckpt_path"]

log = logging.getLogger(__name__)

#: The signals :class:`Preemption` turns into a save and a clean stop.
SIGNALS = {"SIGUSR1": signal.SIGUSR1, "SIGTERM": signal.SIGTERM}


def _step_of(path: Path) -> int | None:
    """The optimizer step a complete checkpoint was saved at; None if it is not one (partial, foreign)."""
    try:
        if path.is_dir():
            if not (path / ".metadata").is_file() or not (path / "meta.pt").is_file():
                return None
            meta = load(path / "meta.pt")
        elif zipfile.is_zipfile(path):
            meta = load(path, mmap=True)
        else:
            return None
    except CheckpointDataError:
        raise  # not a torn copy: a file that must not load, which no resume may silently pass over
    except Exception as err:  # a torn copy: not a checkpoint to resume from
        log.warning("skipping %s: it does not load (%s)", path, err)
        return None
    step = meta.get("global_step") if isinstance(meta, dict) else None
    return int(step) if isinstance(step, int) else None


def newest_checkpoint(directory: str | Path) -> tuple[Path, int] | None:
    """The newest complete checkpoint in ``directory`` and its step, or None (see the module docstring).

    Example:
        >>> newest_checkpoint("/nonexistent") is None
        True
    """
    where = Path(directory)
    if not where.is_dir():
        return None
    found: list[tuple[int, int, Path]] = []
    for path in where.iterdir():
        name = path.name
        if name.endswith(".partial") or not (name.endswith(".ckpt") or name.endswith(".ckpt.old")):
            continue
        old = name.endswith(".old")
        if old and _step_of(path.with_name(name[: -len(".old")])) is not None:
            continue  # the save that replaced it finished
        step = _step_of(path)
        if step is not None:
            found.append((step, 0 if old else 1, path))
    if not found:
        return None
    step, _, path = max(found)
    return path, step


def resolve_ckpt_path(value: str | None, checkpoint_dir: str | Path) -> str | None:
    """``ckpt_path`` as the Trainer takes it: ``auto`` becomes the newest checkpoint in ``checkpoint_dir``
    (None: a fresh start), said in the log either way; any other value is returned as it is."""
    if value != "auto":
        return value
    newest = newest_checkpoint(checkpoint_dir)
    if newest is None:
        log.info("ckpt_path=auto: no complete checkpoint in %s; starting from step 0", checkpoint_dir)
        return None
    path, step = newest
    log.info("ckpt_path=auto: resuming from %s (step %d)", path, step)
    return str(path)


class Preemption(L.Callback):
    """On a signal, stop every rank at the same step after a checkpoint; requeue under SLURM (module docstring).

    Args:
        signals: the signal names that ask for it (``"SIGUSR1"``, ``"SIGTERM"``).
        requeue: under SLURM (``SLURM_JOB_ID`` set), rank 0 runs ``scontrol requeue <job>`` after the save.
        checkpoint_dir: where the checkpoint goes, as ``last.ckpt``; default: the ``ModelCheckpoint``
            callback's directory, else ``<default_root_dir>/checkpoints``.

    Example:
        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[Preemption()])  # doctest: +SKIP
    """

    def __init__(
        self,
        signals: tuple[str, ...] | list[str] = ("SIGUSR1", "SIGTERM"),
        requeue: bool = True,
        checkpoint_dir: str | None = None,
    ) -> None:
        unknown = [s for s in signals if s not in SIGNALS]
        if unknown:
            raise ConfigError(
                f"preemption.signals={list(signals)}: {unknown[0]} is unknown; valid: {', '.join(SIGNALS)}"
            )
        self.signals = tuple(signals)
        self.requeue = requeue
        self.checkpoint_dir = checkpoint_dir
        #: The signal received (its number), 0 before any.
        self.received = 0
        #: The step the ranks stopped at, once they did.
        self.stopped_at: int | None = None
        self._previous: dict[int, Any] = {}
        self._agreement: StepAgreement | None = None

    # ----------------------------------------------------------------------------- signals
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After Lightning's own handlers (registered as the run starts): ours replace them for these
        # signals, so a SIGTERM no longer ends the run before a save, nor kills the other ranks.
        if threading.current_thread() is not threading.main_thread():
            log.warning("Preemption: not the main thread, signal handlers not installed")
            return
        for name in self.signals:
            signum = SIGNALS[name]
            self._previous[signum] = signal.signal(signum, self._note)
        agreement = getattr(trainer.strategy, "agreement", None)
        if isinstance(agreement, StepAgreement):  # the flag rides in the step's one agreement
            agreement.stop_requested, agreement.stop = self._requested, False
            self._agreement = agreement
        if "SIGTERM" in self.signals:
            _without_lightnings_sigterm_broadcast(trainer)

    def _requested(self) -> bool:
        return self.received != 0

    def _note(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the ranks agree on the step after the next optimizer step.
        self.received = self.received or signum

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if self._agreement is not None:
            self._agreement.stop_requested, self._agreement = None, None

    # ----------------------------------------------------------------------------- agreement, save, stop
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.fit_loop._should_accumulate() or self.stopped_at is not None:
            return  # only at optimizer steps: a checkpoint there resumes exactly
        if not self._agreed(trainer):
            return
        self.stopped_at = trainer.global_step
        name = signal.Signals(self.received).name if self.received else "a signal on another rank"
        log.warning("preempted (%s): saving a checkpoint at step %d, then stopping", name, trainer.global_step)
        log.warning("preempted: saved %s", self._save(trainer))
        if self.requeue and trainer.is_global_zero:
            requeue_slurm_job()
        trainer.strategy.barrier("preemption")
        trainer.should_stop = True

    def _agreed(self, trainer: L.Trainer) -> bool:
        """Whether any rank received a signal, so all decide alike: as the step's agreement found (the
        strategy's, ``core/agreement.py``), else by one all-reduce (MAX) of the flag."""
        if self._agreement is not None:
            return self._agreement.stop
        flag = float(self.received != 0)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = torch.tensor([flag], device=collective_device())
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            flag = float(box.item())
        return flag > 0

    def _save(self, trainer: L.Trainer) -> str:
        """The run's ``last`` checkpoint, through the ``ModelCheckpoint`` that keeps it where there is one
        (its name, its rotation, and no second save of this step when the run ends); else ``last.ckpt``."""
        callback = trainer.checkpoint_callback
        save_last = getattr(callback, "_save_last_checkpoint", None)
        if self.checkpoint_dir is None and getattr(callback, "save_last", False) and save_last is not None:
            save_last(trainer, callback._monitor_candidates(trainer))  # type: ignore[union-attr]
            return str(callback.last_model_path)  # type: ignore[union-attr]
        dirpath = self.checkpoint_dir or getattr(callback, "dirpath", None)
        path = Path(dirpath) if dirpath else Path(trainer.default_root_dir) / "checkpoints"
        trainer.save_checkpoint(path / "last.ckpt")
        return str(path / "last.ckpt")


def _without_lightnings_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Turn off Lightning's SIGTERM check (rank 0's flag broadcast and read before every micro-batch): this
    callback's own handler takes SIGTERM, so Lightning's flag never rises and its broadcast only costs."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):  # (Lightning 2.5+; earlier versions have none)
        loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]


def requeue_slurm_job() -> bool:
    """``scontrol requeue`` this SLURM job (an array task: its own id); False (and a log line) where it cannot."""
    job = os.environ.get("SLURM_JOB_ID")
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if not job:
        log.info("preemption: not a SLURM job, nothing to requeue (start it again: ckpt_path=auto resumes)")
        return False
    if not re.fullmatch(r"[0-9_]+", job) or shutil.which("scontrol") is None:
        log.warning("preemption: cannot requeue SLURM job %r (scontrol not found or odd id); resubmit it", job)
        return False
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        log.warning("preemption: scontrol requeue %s failed (%d): %s", job, result.returncode, result.stderr.strip())
        return False
    log.warning("preemption: requeued SLURM job %s", job)
    return True
