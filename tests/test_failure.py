"""A rank that raises brings the whole job down, promptly, with its own message (no silent hang)."""

import os
import subprocess
import sys
import textwrap

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
