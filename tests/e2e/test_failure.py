"""A rank that raises brings the whole job down, promptly, with its own message (no silent hang);
a hung collective is named, with the ranks that never arrived or skipped it."""

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_ultrascale import LlamaModule, UltraScaleDataModule, UltraScaleStrategy
from lightning_ultrascale.core import forensics
from lightning_ultrascale.core.watchdog import Watchdog
from lightning_ultrascale.testing.commands import run_command
from lightning_ultrascale.testing.spawn import ForkWithThreadsWarning, WorkerError, run_workers


class Boom(LlamaModule):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 2:
            raise RuntimeError("rank 1 exploded on purpose")
        return super().training_step(batch, batch_idx)


def _boom() -> None:
    trainer = L.Trainer(strategy=UltraScaleStrategy(), accelerator="cpu", devices=2, max_steps=50, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(Boom("llama_tiny"), datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=2))


def test_a_failing_rank_ends_the_job_with_its_own_message(tmp_path):
    # Both ranks forked as torchrun starts them (testing.commands; the hang test below goes through
    # Lightning's own launcher); the collective timeout is 10 minutes, so finishing within 120 s
    # proves the job did not wait for it. Run in tmp_path: the run directory may get the collectives'
    # report (when rank 0 saw the failure in a collective), which must not land in the checkout.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = run_command(_boom, ["boom"], env, world_size=2, timeout_s=120, cwd=tmp_path)
    assert out.returncode != 0 and out.returncode != -9, out.stderr[-3000:]  # (-9: killed at the timeout)
    assert "RuntimeError: rank 1 exploded on purpose" in out.stderr


HANG = textwrap.dedent(
    """
    import os, time
    from datetime import timedelta
    import lightning as L
    from lightning_ultrascale import LlamaModule, UltraScaleDataModule, UltraScaleStrategy

    class Hangs(LlamaModule):
        def training_step(self, batch, batch_idx):
            if self.global_rank == 1 and batch_idx == 2:
                with open("hung.txt", "w") as f:
                    f.write(f"{os.getpid()} {time.time()}")
                while True:
                    time.sleep(0.1)  # alive, in Python, in no collective
            return super().training_step(batch, batch_idx)

    if __name__ == "__main__":
        strategy = UltraScaleStrategy(timeout=timedelta(seconds=20))
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=50, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0)
        trainer.fit(Hangs("llama_tiny"), datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=2))
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended, only its exit status waits to be read


def test_a_rank_hung_outside_any_collective_is_ended_with_the_job(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    # A 20 s timeout, not 10: on a loaded machine (three lanes on two cores) rank 1 once never reached its
    # hang (its log was not kept then; it is now, below); its start-up alone takes seconds there.
    assert (tmp_path / "hung.txt").exists(), f"rank 1 never reached its hang:\n{out.stderr[-3000:]}"
    pid, hung_at = (tmp_path / "hung.txt").read_text().split()
    deadline = float(hung_at) + 20 + 10  # the collective timeout, plus ten seconds
    while _alive(int(pid)) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(int(pid)), "the hung rank outlived the job"
    assert out.returncode != 0
    # Rank 0 timed out waiting for it, and names it; the hung rank says why it ended.
    assert "ranks that did not fail with it (hung, or waiting for it in a collective): 1" in out.stderr
    assert "[rank 1] lightning_ultrascale watchdog: ending this rank: rank 0 failed" in out.stderr
    # And names the collective rank 1 never came to, in the log and in the run directory (the Trainer's default).
    assert re.search(r"collective timed out: \w+ #\d+ on world \(ranks 0-1\).*: rank 1 never arrived", out.stderr)
    report = json.loads((tmp_path / forensics.REPORT_FILE).read_text())
    assert [(a["rank"], a["why"]) for a in report["absent"]] == [(1, "never arrived")]


# ------------------------------------------------------------------ who a hung collective waits for
COLLECTIVE_TIMEOUT_S = 3


def _second_all_reduce(report_dir: str, rank_1_does: str) -> None:
    """Two all-reduces on a group; rank 1 sleeps before the second, or goes on to a world broadcast instead."""
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    dog = Watchdog(store, rank, dist.get_world_size(), report_dir=report_dir).start()
    Path(report_dir, f"pid{rank}").write_text(str(os.getpid()))
    # The timeout on a group of its own: WORLD (run_workers' timeout) stays usable for the skipping rank.
    group = dist.new_group(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    t = torch.ones(1024)
    dist.all_reduce(t, group=group)
    if rank == 1 and rank_1_does == "sleeps":
        time.sleep(60)  # in Python, in no collective
    if rank == 1 and rank_1_does == "skips":
        dist.broadcast(t, src=0)  # rank 0 never comes: it waits in the all-reduce
    try:
        dist.all_reduce(t, group=group)
    except RuntimeError as err:
        Path(report_dir, "message.txt").write_text(dog.fail(err))


def _hang(tmp_path: Path, rank_1_does: str) -> tuple[str, dict]:
    """Run the two ranks; return rank 0's failure message and the report, once both ranks are gone."""
    started = time.monotonic()
    # The watchdog ends rank 1 (exit code 1) once rank 0 has failed; the helper would kill it (-9) only later.
    with pytest.raises(WorkerError, match=r"rank 1 died without reporting \(exit code 1\)"):
        run_workers(_second_all_reduce, 2, str(tmp_path), rank_1_does, timeout_s=60)
    assert time.monotonic() - started < COLLECTIVE_TIMEOUT_S + 10
    for rank in range(2):
        assert not _alive(int((tmp_path / f"pid{rank}").read_text()))
    report = json.loads((tmp_path / forensics.REPORT_FILE).read_text())
    return (tmp_path / "message.txt").read_text(), report


def test_a_rank_that_never_arrives_is_named_with_the_collective_it_left_waiting(tmp_path, capfd):
    message, report = _hang(tmp_path, "sleeps")
    expected = (
        r"collective timed out: all_reduce #2 on group \d+ \(ranks 0-1\), 4.0 KiB fp32: rank 1 never arrived "
        r"\(its last collective: all_reduce #1 on group \d+, 4.0 KiB fp32, finished\)"
    )
    assert re.search(expected, message), message
    assert re.fullmatch(expected, report["error"])
    assert [(a["rank"], a["why"]) for a in report["absent"]] == [(1, "never arrived")]
    assert (report["collective"]["op"], report["collective"]["seq"]) == ("all_reduce", 2)
    # Every rank that can speak says where it is, the absent one from its watchdog thread while it sleeps.
    assert "[rank 1] collectives: in no collective; finished last: all_reduce #1" in capfd.readouterr().err


def test_a_rank_that_skipped_a_collective_is_named_with_the_one_it_is_in(tmp_path, capfd):
    message, report = _hang(tmp_path, "skips")
    expected = (
        r"collective timed out: all_reduce #2 on group \d+ \(ranks 0-1\), 4.0 KiB fp32: "
        r"rank 1 skipped it \(it is in broadcast #\d+ on world, 4.0 KiB fp32\)"
    )
    assert re.search(expected, message), message
    assert [(a["rank"], a["why"], a["in"]["op"]) for a in report["absent"]] == [(1, "skipped", "broadcast")]
    assert "[rank 1] collectives: in broadcast #" in capfd.readouterr().err


def _record(op: str, group: str, seq: int, state: str = "finished") -> dict:
    label = "world" if group == "0" else "dp"
    return {"op": op, "group": group, "label": label, "seq": seq, "p2p": False, "bytes": 4 << 20, "dtype": "fp32",
            "sizes": [[1 << 20]], "state": state}  # fmt: skip


def _rank(rank: int, *records: dict, failed: str | None = None) -> dict:
    return {"rank": rank, "failed": failed, "records": list(records), "groups": {"0": [0, 1, 2, 3], "3": [0, 1, 2, 3]}}


def test_the_hung_collective_is_the_first_one_that_members_of_its_group_lack():
    # Ranks 0 and 1 are in all_reduce #42 on dp; rank 2 sleeps after #41; rank 3 went on to a broadcast on world.
    before = [_record("all_reduce", "0", 42), _record("all_reduce", "3", 41)]
    states = {
        0: _rank(0, *before, _record("all_reduce", "3", 42), failed="Timed out waiting 600000ms"),
        1: _rank(1, *before, _record("all_reduce", "3", 42, "in flight")),
        2: _rank(2, *before),
        3: _rank(3, *before, _record("broadcast", "0", 43, "in flight")),
    }
    line, found = forensics.diagnose(states, reporter=0)
    assert line == (
        "all_reduce #42 on dp (ranks 0-3), 4.0 MiB fp32: "
        "rank 2 never arrived (its last collective: all_reduce #41 on dp, 4.0 MiB fp32, finished); "
        "rank 3 skipped it (it is in broadcast #43 on world, 4.0 MiB fp32)"
    )
    assert [a["rank"] for a in found["absent"]] == [2, 3]
    # A rank that cannot answer is named as such; a rank in the same call with other tensors disagrees.
    states[2], states[3] = None, _rank(3, *before, _record("broadcast", "3", 42, "in flight"))
    line, _ = forensics.diagnose(states, reporter=0)
    assert "rank 2 did not answer" in line
    assert "rank 3 called broadcast #42 on dp, 4.0 MiB fp32 instead" in line
    # Every member in it (a failure that is no hang): nothing to name.
    states = {r: _rank(r, *before, _record("all_reduce", "3", 42, "in flight")) for r in range(4)}
    assert forensics.diagnose(states, reporter=0) is None


# ----------------------------------------------------------------------------- the test harness itself
def _abort_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os.abort()  # as malloc does when it finds its heap corrupted


def test_a_worker_that_crashes_natively_reports_its_python_stack():
    with pytest.raises(WorkerError, match=r"rank 1 died without reporting \(exit code -6\)") as died:
        run_workers(_abort_on_rank_1, 2, timeout_s=60)
    assert "Fatal Python error: Aborted" in str(died.value) and "_abort_on_rank_1" in str(died.value), died.value


def test_forking_a_parent_with_a_thread_running_warns_with_the_known_sources():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        message = r"parent that runs 1 thread\(s\) besides its main one.*TOKENIZERS_PARALLELISM"
        with pytest.warns(ForkWithThreadsWarning, match=message) as warned:
            assert run_workers(dist.get_rank, 2) == [0, 1]
        assert {w.filename for w in warned} == {__file__}  # blamed on the line that forked, not on a helper
    finally:
        stop.set()
        thread.join()
