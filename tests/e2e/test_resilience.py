"""Runs that survive a cluster (lightning_ultrascale/training/resilience.py): ``ckpt_path=auto`` finds the
newest complete checkpoint; SIGUSR1 / SIGTERM stop every rank at one step after a save, requeue under SLURM, and the run
resumes bit-identically. CLI runs: 2 forked processes each (five runs)."""

import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from lightning_ultrascale.cli.train import main as train_main
from lightning_ultrascale.testing.chaos import read_losses
from lightning_ultrascale.testing.commands import run_command
from lightning_ultrascale.testing.spawn import free_port
from lightning_ultrascale.training.resilience import Preemption, newest_checkpoint, resolve_ckpt_path

CHAOS = "lightning_ultrascale.testing.chaos"
TRAIN = [sys.executable, "-m", "lightning_ultrascale.cli.train"]
FAST = ["data.seq_len=64", "data.micro_batch_size=2", "data.global_batch_size=4", "trainer.limit_val_batches=0",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"]  # fmt: skip


def _checkpoint(path: Path, step: int, complete: bool = True) -> None:
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    if complete:
        torch.save({"global_step": step}, path / "meta.pt")


def test_the_newest_complete_checkpoint_is_found_by_step(tmp_path):
    assert newest_checkpoint(tmp_path) is None
    _checkpoint(tmp_path / "step=2.ckpt", 2)
    _checkpoint(tmp_path / "last.ckpt", 4)
    _checkpoint(tmp_path / "step=6.ckpt.partial", 6)  # a save that did not finish
    _checkpoint(tmp_path / "step=8.ckpt", 8, complete=False)  # no meta.pt: torn
    assert newest_checkpoint(tmp_path) == (tmp_path / "last.ckpt", 4)
    _checkpoint(tmp_path / "step=5.ckpt.old", 5)  # a crash between a save's two renames: step=5.ckpt gone
    assert newest_checkpoint(tmp_path) == (tmp_path / "step=5.ckpt.old", 5)
    _checkpoint(tmp_path / "step=5.ckpt", 7)  # the save finished after all: .old is stale
    assert newest_checkpoint(tmp_path) == (tmp_path / "step=5.ckpt", 7)
    assert resolve_ckpt_path("auto", tmp_path / "none") is None
    assert resolve_ckpt_path("some/path", tmp_path) == "some/path"


def test_a_bad_signal_name_is_refused_with_the_valid_ones():
    with pytest.raises(Exception, match=r"preemption.signals=\['SIGINT'\]: SIGINT is unknown; valid: SIGUSR1, SIGTERM"):
        Preemption(signals=["SIGINT"])


def _train(run_dir: Path, steps: int, *extra: str, env: dict | None = None, srun: bool = False) -> None:
    """A 2-process CLI run in ``run_dir``, its ranks forked as torchrun starts them (testing.commands), or
    (``srun``) as srun starts a job's tasks, with SLURM's variables (the run directory then comes from
    SLURM_JOB_ID). Signals reach each rank's own process either way."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    losses = f"+callbacks.losses={{_target_: {CHAOS}.StepLossLog, path: {run_dir / 'losses.jsonl'}}}"
    base = {k: v for k, v in os.environ.items() if k != "ULTRASCALE_RUN_DIR" and not k.startswith("SLURM_")}
    base.update({"OMP_NUM_THREADS": "1", **(env or {})})
    argv = ["ultrascale-train", f"trainer.max_steps={steps}", *FAST, losses, *extra]
    if not srun:
        base["ULTRASCALE_RUN_DIR"] = str(run_dir)
        out = run_command(train_main, argv, base, world_size=2, cwd=run_dir.parent)
        assert out.returncode == 0, out.stderr[-3000:]
        return
    slurm = {"SLURM_JOB_NAME": "ultrascale", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0",
             "SLURM_JOB_NUM_NODES": "1", "SLURM_NODELIST": "127.0.0.1", "MASTER_ADDR": "127.0.0.1"}  # fmt: skip
    base.update(slurm, MASTER_PORT=str(free_port()))
    out = run_command(
        train_main, [*argv, "cluster=slurm"], base, world_size=2, cwd=run_dir.parent.parent,
        rank_env=lambda r: {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    _train(run_dir, 6)
    return read_losses(str(run_dir / "losses.jsonl"))


def _signals(at: dict[int, int], signum: str, when: dict[int, str]) -> str:
    return f"+callbacks.signal={{_target_: {CHAOS}.SignalAt, at: {at}, signum: {signum}, when: {when}}}"


def test_sigusr1_under_slurm_saves_requeues_and_the_requeued_run_resumes_bit_identically(tmp_path, uninterrupted):
    # A fake SLURM job, its tasks started as srun starts them (Lightning's own requeue, which saves inside
    # the signal handler, is off), and a fake scontrol recording its call.
    bin_dir, record = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    (bin_dir / "scontrol").chmod(stat.S_IRWXU)
    env = {"SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    run_dir = tmp_path / "outputs" / "slurm-4242"  # what cli.train.run_dir names it, in the job's directory
    # rank 1 in step 3's forward, rank 0 after step 4: every rank stops after step 3.
    signals = _signals({0: 4, 1: 2}, "SIGUSR1", {0: "end", 1: "start"})
    _train(run_dir, 6, signals, env=env, srun=True)
    logs = "".join(p.read_text() for p in run_dir.glob("*.log"))
    assert "preempted (SIGUSR1): saving a checkpoint at step 3" in logs  # rank 1's; rank 0 learns it
    assert "preempted (a signal on another rank): saving a checkpoint at step 3" in logs
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.ckpt"]
    assert record.read_text().split() == ["requeue", "4242"]
    assert newest_checkpoint(run_dir / "checkpoints")[1] == 3
    assert max(read_losses(str(run_dir / "losses.jsonl"))) == 3
    # The requeued job: the same id, so the same run directory; ckpt_path=auto resumes.
    _train(run_dir, 6, env=env, srun=True)
    assert "ckpt_path=auto: resuming from" in (run_dir / "train.log").read_text()
    assert read_losses(str(run_dir / "losses.jsonl")) == uninterrupted


def test_sigterm_stops_every_rank_at_one_step_and_auto_resumes_bit_identically(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    # Rank 0 alone, after step 2's check (callbacks run in order, Preemption's first): both stop after step 3.
    _train(run_dir, 6, _signals({0: 2}, "SIGTERM", {0: "end"}))
    logs = "".join(p.read_text() for p in run_dir.glob("*.log"))
    assert "preempted (SIGTERM)" in logs and "preempted (a signal on another rank)" in logs
    assert max(read_losses(str(run_dir / "losses.jsonl"))) == 3
    _train(run_dir, 6)
    assert "ckpt_path=auto: resuming from" in (run_dir / "train.log").read_text()
    assert read_losses(str(run_dir / "losses.jsonl")) == uninterrupted
