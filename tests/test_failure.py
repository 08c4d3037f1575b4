"""A rank that raises brings the whole job down, promptly, with its own message (no silent hang)."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import lightning as L
    from lightning_ultrascale import LlamaModule, UltraScaleDataModule, UltraScaleStrategy

    class Boom(LlamaModule):
        def training_step(self, batch, batch_idx):
            if self.global_rank == 1 and batch_idx == 2:
                raise RuntimeError("rank 1 exploded on purpose")
            return super().training_step(batch, batch_idx)

    if __name__ == "__main__":
        trainer = L.Trainer(strategy=UltraScaleStrategy(), accelerator="cpu", devices=2, max_steps=50,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            limit_val_batches=0)
        trainer.fit(Boom("llama_tiny"), datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=2))
    """
)


def test_a_failing_rank_ends_the_job_with_its_own_message(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Through Lightning's own launcher (devices=2 starts a second process); the collective timeout
    # is 10 minutes, so finishing within 120 s proves the job did not wait for it.
    out = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
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
        strategy = UltraScaleStrategy(timeout=timedelta(seconds=10))
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
    pid, hung_at = (tmp_path / "hung.txt").read_text().split()
    deadline = float(hung_at) + 10 + 10  # the collective timeout, plus ten seconds
    while _alive(int(pid)) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(int(pid)), "the hung rank outlived the job"
    assert out.returncode != 0
    # Rank 0 timed out waiting for it, and names it; the hung rank says why it ended.
    assert "ranks that did not fail with it (hung, or waiting for it in a collective): 1" in out.stderr
    assert "[rank 1] lightning_ultrascale watchdog: ending this rank: rank 0 failed" in out.stderr
