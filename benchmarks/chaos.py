"""Chaos: a torchrun job whose ranks are SIGKILLed again and again finishes with an uninterrupted run's losses.

``torchrun.sh`` of the recipes (torchrun's elastic agent, c10d rendezvous, ``--max-restarts``) runs the
default job on 4 CPU processes (tp2 x ZeRO-3 over dp2, checkpoints every 2 steps). Kills are drawn
from a seeded generator (:func:`lightning_ultrascale.testing.chaos.draw_kills`): ``k`` of them, at
drawn steps on drawn ranks, the first 50 ms into a checkpoint save. After each kill the agent stops
the worker group and starts it again; every new rank finds the newest complete checkpoint itself
(``ckpt_path=auto``: a save the kill interrupted is a ``.partial`` directory, skipped) and goes on.

Checked, and written to ``benchmarks/results/chaos.json``: every step's loss, each time it was
computed (before a kill, and again after each resume), equals the uninterrupted run's bit for bit;
the job ends at its last step after ``k`` restarts; no process of the job outlives it.

    python benchmarks/chaos.py             # 3 kills, 12 steps: ~3 minutes on 2 CPU cores
    python benchmarks/chaos.py --quick     # the same, written where --out says (the suite checks the JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "lightning_ultrascale" / "recipes" / "torchrun.sh"
CHAOS = "lightning_ultrascale.testing.chaos"
LAYOUT = ["parallel=zero3", "parallel.tp=2"]
STEPS, EVERY = 12, 2
FAST = ["data.seq_len=64", "data.micro_batch_size=2", "data.global_batch_size=4", "trainer.limit_val_batches=0",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"]  # fmt: skip
FAST.append(f"checkpoint.every_n_steps={EVERY}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(workdir: Path, name: str, extra: list[str], restarts: int) -> dict[str, Any]:
    """One torchrun job through the recipes' torchrun.sh: its wall time, exit code, log and losses."""
    marker = f"{name}-{uuid.uuid4().hex[:8]}"  # in every rank's command line: finds any process left behind
    run_dir = workdir / "outputs" / f"torchrun-{marker}"
    losses = run_dir.parent / f"{marker}.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "ULTRASCALE_RUN_DIR"}
    path = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # (torchrun: the environment's own)
    env.update(NNODES="1", NPROC_PER_NODE="4", MASTER_PORT=str(_free_port()), MAX_RESTARTS=str(restarts),
               RUN_ID=marker, OMP_NUM_THREADS="1", PATH=path)  # fmt: skip
    args = [
        f"trainer.max_steps={STEPS}",
        *FAST,
        *LAYOUT,
        f"+callbacks.losses={{_target_: {CHAOS}.StepLossLog, path: {losses}}}",
    ]
    start = time.perf_counter()
    out = subprocess.run(["bash", str(SCRIPT), *args, *extra], env=env, cwd=workdir, capture_output=True, text=True,
                         timeout=1800)  # fmt: skip
    wall = time.perf_counter() - start
    time.sleep(2)  # what the agent stopped has had time to go
    starts = []  # where each start of the worker group began: its ranks all log it (train.log, shared)
    for line in (run_dir / "train.log").read_text().splitlines() if (run_dir / "train.log").is_file() else []:
        if "ckpt_path=auto:" in line:
            starts.append(int(line.rsplit("(step ", 1)[1].rstrip(")")) if "resuming from" in line else 0)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    from lightning_ultrascale.testing.chaos import read_losses

    return {"returncode": out.returncode, "wall_s": round(wall, 1), "left_behind": len(left), "log": out.stderr,
            "started_at_step": [starts[i] for i in range(0, len(starts), 4)],
            "run_dir": run_dir, "lines": read_losses(losses, last=False) if losses.is_file() else []}  # fmt: skip


def run(seed: int, kills: int) -> dict[str, Any]:
    from lightning_ultrascale.testing.chaos import draw_kills

    plan = draw_kills(seed, kills, STEPS, 4, saves=list(range(EVERY, STEPS - 1, EVERY)))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        whole = _job(workdir, "whole", [], restarts=0)
        assert whole["returncode"] == 0, whole["log"][-3000:]
        reference = dict(whole["lines"])
        state = workdir / "kills.json"
        kills_arg = ", ".join(f"{{step: {k['step']}, rank: {k['rank']}, during: {k['during']}}}" for k in plan)
        monkey = f"+callbacks.chaos={{_target_: {CHAOS}.ChaosMonkey, kills: [{kills_arg}], state: {state}}}"
        chaos = _job(workdir, "chaos", [monkey], restarts=kills + 2)
        done = json.loads(state.read_text()) if state.is_file() else []
        partial = sorted(p.name for p in (chaos["run_dir"] / "checkpoints").glob("*.partial"))
    compared = [(step, loss, reference.get(step)) for step, loss in chaos["lines"]]
    return {
        "layout": " ".join(LAYOUT) + " (4 processes: tp2 x ZeRO-3 over dp2)",
        "launcher": "recipes/torchrun.sh (torchrun's elastic agent, c10d rendezvous, --max-restarts)",
        "steps": STEPS,
        "checkpoint_every": EVERY,
        "seed": seed,
        "kills": plan,
        "kills_done": len(done),
        "restarts": len(chaos["started_at_step"]) - 1,
        # Each start of the worker group, from the step of the newest complete checkpoint (0: none yet).
        "started_at_step": chaos["started_at_step"],
        "partial_saves_left_by_kills": partial,
        "returncode": chaos["returncode"],
        "last_step": max((s for s, _ in chaos["lines"]), default=0),
        "loss_lines": len(compared),
        "steps_computed_twice": len(compared) - len({s for s, _, _ in compared}),
        "bit_identical": bool(compared) and all(loss == ref for _, loss, ref in compared),
        "mismatches": [{"step": s, "loss": a, "uninterrupted": b} for s, a, b in compared if a != b][:5],
        "left_behind": chaos["left_behind"] + whole["left_behind"],
        "wall_s": {"uninterrupted": whole["wall_s"], "chaos": chaos["wall_s"]},
        "log_tail": chaos["log"][-4000:] if chaos["returncode"] else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the same run (a chaos run has no smaller version)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos.json"))
    args = parser.parse_args()
    result = run(args.seed, args.kills)
    print(f"{'kill':>4} {'step':>4} {'rank':>4} {'during':>6}")
    for i, kill in enumerate(result["kills"]):
        print(f"{i:>4} {kill['step']:>4} {kill['rank']:>4} {kill['during']:>6}")
    print(
        f"restarts {result['restarts']} (started at steps {result['started_at_step']}), "
        f"exit {result['returncode']}, last step {result['last_step']}, "
        f"{result['loss_lines']} losses ({result['steps_computed_twice']} recomputed after resumes), "
        f"bit-identical: {result['bit_identical']}, processes left behind: {result['left_behind']}, "
        f"wall {result['wall_s']['chaos']} s (uninterrupted {result['wall_s']['uninterrupted']} s)"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
