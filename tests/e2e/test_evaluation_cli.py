"""lm-eval tasks and Hugging Face snapshots from the command line: ``+callbacks.eval`` and
``checkpoint.hf_every_n_steps`` on 2 CPU ranks; metrics and stalls in the CSV log, snapshots transformers loads."""

import csv
import json
import os

import torch
import torch.distributed.checkpoint as dcp
from eval_tasks import write_tasks

from lightning_ultrascale.cli.train import main as train_main
from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.models.llama import Llama
from lightning_ultrascale.testing.commands import run_command

EVAL = "lightning_ultrascale.training.evaluation.LMEvaluation"


def test_a_two_rank_run_evaluates_and_snapshots_every_n_steps_into_the_csv_log(tmp_path):
    run_dir, tasks = tmp_path / "run", write_tasks(tmp_path / "tasks")
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    overrides = [
        "trainer.max_steps=4", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
        "data.seq_len=64", "data.micro_batch_size=2", "data.global_batch_size=4", "parallel=zero3",
        "checkpoint.hf_every_n_steps=2", "checkpoint.hf_keep=2",
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
    # The snapshots' stall, per snapshot, in the CSV log and on the console.
    stalls = {int(r["step"]): float(r["hf_snapshot/stall_s"]) for r in rows if r.get("hf_snapshot/stall_s")}
    assert set(stalls) == {2, 4} and all(0 <= s < 60 for s in stalls.values()), stalls
    assert "HF snapshot step 4: training stalled" in out.stderr, out.stderr[-3000:]
    # Each snapshot loads in transformers, with its tokenizer; the last one is the run's final weights.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert sorted(p.name for p in (run_dir / "hf").glob("step_*")) == ["step_2", "step_4"]
    hf = AutoModelForCausalLM.from_pretrained(run_dir / "hf" / "step_4", local_files_only=True).eval()
    ids = AutoTokenizer.from_pretrained(run_dir / "hf" / "step_4")("Hello, snapshots", return_tensors="pt").input_ids
    ours = Llama(get_model_config("llama_tiny"))
    dcp.load({f"state_dict.model.{n}": t for n, t in ours.state_dict().items()},
             checkpoint_id=run_dir / "checkpoints" / "last.ckpt", no_dist=True)  # fmt: skip
    with torch.no_grad():
        want, got = ours.eval()(ids), hf(ids).logits
    assert (got - want).norm() / want.norm() < 1e-5


def test_snapshots_without_their_callback_are_refused_before_any_process_group(tmp_path):
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1"}
    overrides = ["callbacks=none", "checkpoint.hf_every_n_steps=5"]
    out = run_command(train_main, ["ultrascale-train", *overrides], env, world_size=1, cwd=tmp_path)
    assert out.returncode != 0
    assert "checkpoint.hf_every_n_steps=5, but no callback writes the snapshots" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
