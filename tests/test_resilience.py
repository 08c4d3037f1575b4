"""Runs that survive a cluster (lightning_ultrascale/resilience.py): ``ckpt_path=auto`` finds the newest complete
checkpoint; SIGUSR1 / SIGTERM stop every rank at one step after a save, requeue under SLURM, and the run
resumes bit-identically. CLI runs: 2 processes, ~15 s each (five runs, ~80 s in all)."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cluster_helpers import read_losses

from lightning_ultrascale.resilience import Preemption, newest_checkpoint, resolve_ckpt_path

TESTS = Path(__file__).parent
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


def _train(run_dir: Path, steps: int, *extra: str, env: dict | None = None, named_by_slurm: bool = False):
    """A 2-process CLI run in ``run_dir`` (``named_by_slurm``: the directory comes from SLURM_JOB_ID instead)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    losses = f"+callbacks.losses={{_target_: cluster_helpers.LossLog, path: {run_dir / 'losses.jsonl'}}}"
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    environment.pop("ULTRASCALE_RUN_DIR", None)
    if not named_by_slurm:
        environment["ULTRASCALE_RUN_DIR"] = str(run_dir)
    cmd = [*TRAIN, f"trainer.max_steps={steps}", *FAST, losses, *extra]
    cwd = run_dir.parent.parent if named_by_slurm else run_dir.parent
    out = subprocess.run(cmd, env=environment, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    _train(run_dir, 6)
    return read_losses(str(run_dir / "losses.jsonl"))


def _signals(at: dict[int, int], signum: str, when: dict[int, str]) -> str:
    return f"+callbacks.signal={{_target_: cluster_helpers.SignalAt, at: {at}, signum: {signum}, when: {when}}}"


def test_sigusr1_under_slurm_saves_requeues_and_the_requeued_run_resumes_bit_identically(tmp_path, uninterrupted):
    # A fake SLURM job (its id: the run directory and the requeue) and a fake scontrol recording its call.
    bin_dir, record = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    (bin_dir / "scontrol").chmod(stat.S_IRWXU)
    env = {"SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    run_dir = tmp_path / "outputs" / "slurm-4242"  # what cli.train.run_dir names it, in the job's directory
    # rank 1 in step 3's forward, rank 0 after step 4: every rank stops after step 3.
    signals = _signals({0: 4, 1: 2}, "SIGUSR1", {0: "end", 1: "start"})
    _train(run_dir, 6, signals, env=env, named_by_slurm=True)
    logs = (run_dir / "train.log").read_text() + (run_dir / "train_ddp_process_1.log").read_text()
    assert "preempted (SIGUSR1): saving a checkpoint at step 3" in logs  # rank 1's; rank 0 learns it
    assert "preempted (a signal on another rank): saving a checkpoint at step 3" in logs
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.ckpt"]
    assert record.read_text().split() == ["requeue", "4242"]
    assert newest_checkpoint(run_dir / "checkpoints")[1] == 3
    assert max(read_losses(str(run_dir / "losses.jsonl"))) == 3
    # The requeued job: the same id, so the same run directory; ckpt_path=auto resumes.
    _train(run_dir, 6, env=env, named_by_slurm=True)
    assert "ckpt_path=auto: resuming from" in (run_dir / "train.log").read_text()
    assert read_losses(str(run_dir / "losses.jsonl")) == uninterrupted


def test_sigterm_stops_every_rank_at_one_step_and_auto_resumes_bit_identically(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    # Rank 0 alone, after step 2's check (callbacks run in order, Preemption's first): both stop after step 3.
    _train(run_dir, 6, _signals({0: 2}, "SIGTERM", {0: "end"}))
    logs = (run_dir / "train.log").read_text() + (run_dir / "train_ddp_process_1.log").read_text()
    assert "preempted (SIGTERM)" in logs and "preempted (a signal on another rank)" in logs
    assert max(read_losses(str(run_dir / "losses.jsonl"))) == 3
    _train(run_dir, 6)
    assert "ckpt_path=auto: resuming from" in (run_dir / "train.log").read_text()
    assert read_losses(str(run_dir / "losses.jsonl")) == uninterrupted
