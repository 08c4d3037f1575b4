"""lm-eval tasks from the command line: ``+callbacks.eval`` on 2 CPU ranks, metrics in the CSV log and in JSON."""

import csv
import json
import os

from eval_tasks import write_tasks

from lightning_ultrascale.cli.train import main as train_main
from lightning_ultrascale.testing.commands import run_command

EVAL = "lightning_ultrascale.training.evaluation.LMEvaluation"


def test_a_two_rank_run_evaluates_every_n_steps_into_the_csv_log_and_json(tmp_path):
    run_dir, tasks = tmp_path / "run", write_tasks(tmp_path / "tasks")
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    overrides = [
        "trainer.max_steps=4", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
        "data.seq_len=64", "data.micro_batch_size=2", "data.global_batch_size=4",
        f"+callbacks.eval={{_target_: {EVAL}, tasks: [tiny_choice, tiny_perplexity], every_n_steps: 2, "
        f"limit: 4, include_path: '{tasks}'}}",
    ]  # fmt: skip
    out = run_command(train_main, ["ultrascale-train", *overrides], env, world_size=2, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    steps = {int(r["step"]) for r in rows if r.get("eval/tiny_perplexity/byte_perplexity")}
    assert steps == {2, 4}, steps  # every 2 steps, the end's already done at 4
    assert all(0 <= float(r["eval/tiny_choice/acc"]) <= 1 for r in rows if r.get("eval/tiny_choice/acc"))
    saved = json.loads((run_dir / "eval" / "step_4.json").read_text())
    assert set(saved["results"]) == {"tiny_choice", "tiny_perplexity"}
