"""Muon against AdamW on CPU: loss against tokens, the tokens Muon needs to reach AdamW's loss, its step time by
layout, and the planner's prediction of its model state.

Prints tables and writes ``benchmarks/results/muon.json`` (and ``muon_loss.png`` where matplotlib is
installed):

1. Loss against tokens, one process on the bundled corpus, 20 warm-up steps then cosine decay to a
   tenth: ``llama_tiny`` (the default job's model) in the default job's shape (sequences of 256
   tokens, global batch 16: 4,096 tokens a step, 200 steps), and ``llama_small`` in 100 steps of 16 x
   128 tokens (2,048 a step: its steps cost 4x the tiny model's on one core). Each optimizer gets its
   own learning rate from a sweep of four (``LRS``: AdamW 3e-4 to 1e-2, Muon 1e-3 to 3e-2, factors of
   ~3); the best is the lowest final loss (the mean of the last 10 steps, one step's loss swings with
   its batch); a best at a sweep's edge is flagged (``best_at_edge``). Then the tokens Muon's best run needs
   to reach AdamW's best final loss (its 10-step running mean, first at or below it).
2. Step time of Muon over AdamW's on ``llama_small`` (4 x 128 tokens a step) by layout (one process,
   ZeRO-1 dp2, ZeRO-3 dp2, tp2): paired alternated rounds (``Alternation``), the median ratio of
   tokens/s with its bootstrap interval. On CPU gloo has no all-to-all: DTensor's redistribution
   falls back to all-gather and chunk, so the sharded layouts move more bytes here than on NCCL.
3. Model state after one step, measured against the planner (``Workload(optimizer="muon")``) by
   layout: the bar is 2% (``tests/multiprocess/test_muon.py`` holds it too).

GPU figures (Newton-Schulz in bf16 at the tensor-core rate, NCCL all-to-all): not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # fork safety (run_workers): no OpenMP pool in the parent

import lightning as L
import torch

from lightning_ultrascale import LlamaModule, OptimConfig, UltraScaleDataModule
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.plan import Candidate, Workload, estimate
from lightning_ultrascale.testing.parity import QUIET_TRAINER
from lightning_ultrascale.testing.spawn import run_workers
from lightning_ultrascale.testing.timing import Alternation, fit_tokens_per_s
from lightning_ultrascale.utils.memory import model_state_bytes

RESULTS = Path(__file__).parent / "results" / "muon.json"
OPTIMIZERS = ("adamw", "muon")
#: each optimizer's learning-rate sweep: four rates a factor ~3 apart, AdamW's a step lower than Muon's (a first
#: sweep of 1e-3..1e-2 for both put AdamW's best on llama_small and Muon's on both models at its edge)
LRS = {"adamw": (3e-4, 1e-3, 3e-3, 1e-2), "muon": (1e-3, 3e-3, 1e-2, 3e-2)}
#: model -> (steps, sequence length, sequences a step) of its loss curves
CURVES = {"llama_tiny": (200, 256, 16), "llama_small": (100, 128, 16)}
#: the step-time rows: llama_small, 128-token sequences, 4 a step over the data ranks, 8 steps (6 timed)
SPEED_SEQ_LEN = 128
#: name -> the layout (the step-time and memory rows)
LAYOUTS = {
    "one process": {"zero": 0},
    "zero1 dp2": {"dp": 2, "zero": 1},
    "zero3 dp2": {"dp": 2, "zero": 3},
    "tp2": {"tp": 2, "zero": 0},
}
#: (model, layout, precision) of the memory rows: the step-time layouts plus mixed precision and experts
MEMORY_ROWS = [
    *(("llama_small", name, "32-true") for name in LAYOUTS),
    ("llama_small", "zero1 dp2", "bf16-mixed"),
    ("moe_tiny", "ep2 zero3", "32-true"),
]
MEMORY_LAYOUTS = {**LAYOUTS, "ep2 zero3": {"dp": 2, "ep": 2, "zero": 3}}


def _optim(name: str, lr: float, steps: int) -> OptimConfig:
    momentum = 0.95 if name == "muon" else 0.0
    return OptimConfig(name=name, lr=lr, momentum=momentum, warmup_steps=min(20, steps // 4))


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def curve_worker(model: str, optimizer: str, lr: float, steps: int, seq_len: int, batch: int) -> list[float]:
    L.seed_everything(0, verbose=False)
    record = _Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[record], **QUIET_TRAINER)
    data = UltraScaleDataModule(seq_len=seq_len, micro_batch_size=batch)
    trainer.fit(LlamaModule(model, optim=_optim(optimizer, lr, steps)), datamodule=data)
    return record.losses


def running_mean(losses: list[float], window: int = 10) -> list[float]:
    return [sum(losses[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(losses))]


def measure_curves(
    model: str, steps: int, seq_len: int, batch: int, lrs: dict[str, tuple[float, ...]]
) -> dict[str, Any]:
    runs = []
    for optimizer in OPTIMIZERS:
        for lr in lrs[optimizer]:
            losses = run_workers(curve_worker, 1, model, optimizer, lr, steps, seq_len, batch, timeout_s=3600)[0]
            runs.append({"optimizer": optimizer, "lr": lr, "final_loss": running_mean(losses)[-1], "losses": losses})
    best = {o: min((r for r in runs if r["optimizer"] == o), key=lambda r: r["final_loss"]) for o in OPTIMIZERS}
    target = best["adamw"]["final_loss"]
    reached = next((i + 1 for i, v in enumerate(running_mean(best["muon"]["losses"])) if v <= target), None)
    tokens_per_step = seq_len * batch
    return {
        "model": model,
        "steps": steps,
        "seq_len": seq_len,
        "batch": batch,
        "tokens_per_step": tokens_per_step,
        "runs": runs,
        "best_lr": {o: best[o]["lr"] for o in OPTIMIZERS},
        "best_at_edge": {o: len(lrs[o]) > 1 and best[o]["lr"] in (lrs[o][0], lrs[o][-1]) for o in OPTIMIZERS},
        "muon_tokens_to_adamw_final": None if reached is None else reached * tokens_per_step,
        "adamw_tokens": steps * tokens_per_step,
    }


def speed_worker(optimizer: str, candidate: Candidate, steps: int, seq_len: int) -> float:
    module = LlamaModule("llama_small", optim=_optim(optimizer, 3e-3, steps))
    return fit_tokens_per_s(
        module, candidate.strategy(), devices=candidate.world_size, steps=steps, seq_len=seq_len,
        micro_batch=candidate.batch_per_rank, data_ranks=candidate.dp,
    )  # fmt: skip


def _tokens_per_s(optimizer: str, layout: dict[str, int], steps: int, seq_len: int) -> float:
    candidate = Candidate.layout(micro_batch_size=4 // layout.get("dp", 1), **layout)
    return run_workers(speed_worker, candidate.world_size, optimizer, candidate, steps, seq_len, timeout_s=600)[0]


def measure_speed(steps: int, seq_len: int, quick: bool) -> list[dict[str, Any]]:
    rows = []
    layouts = {name: LAYOUTS[name] for name in ("zero1 dp2",)} if quick else LAYOUTS  # (a smoke run: one layout)
    for name, layout in layouts.items():
        arms = {o: partial(_tokens_per_s, o, layout, steps, seq_len) for o in OPTIMIZERS}
        alternation = Alternation(
            arms, baseline="adamw", min_rounds=1 if quick else 6, max_rounds=1 if quick else 12,
            max_seconds=0 if quick else 240, log=None,
        )  # fmt: skip
        ratio = alternation.run()["muon"]
        rows.append({"layout": name, "muon_over_adamw": ratio.as_dict(), "samples": alternation.samples})
        print(f"  {name:<14}{ratio.describe()}", flush=True)
    return rows


def model_state_worker(model: str, candidate: Candidate, precision: str) -> dict[str, int]:
    """Every rank's model state after one Muon step (parameters, gradients, optimizer states)."""
    trainer = L.Trainer(
        accelerator="cpu", devices=candidate.world_size, strategy=candidate.strategy(), max_steps=1,
        precision=precision, **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=64, micro_batch_size=candidate.batch_per_rank, seed=0)
    module = LlamaModule(model, optim=_optim("muon", 3e-3, 1))
    trainer.fit(module, datamodule=data)
    state = model_state_bytes(module, trainer.optimizers)
    return {"params": state.params, "grads": state.grads, "optimizer": state.optimizer_states}


def compare_memory(model: str, layout: dict[str, int], precision: str) -> dict[str, Any]:
    """Measured against predicted model state, rank by rank, and AdamW's prediction for the same layout."""
    candidate = Candidate.layout(micro_batch_size=2, **layout)
    measured = run_workers(model_state_worker, candidate.world_size, model, candidate, precision, timeout_s=600)
    batch = candidate.batch_per_rank * candidate.dp
    workload = Workload(get_model_config(model), 64, batch, precision=precision, optimizer="muon")
    meta = build_model(model, device="meta")
    predicted = [c.model_state for c in estimate(workload, candidate, meta, ranks=list(range(candidate.world_size)))]
    adamw = estimate(replace(workload, optimizer="adamw"), candidate, meta, ranks=[0])[0].model_state
    error = max(abs(p[k] / m[k] - 1) for m, p in zip(measured, predicted) for k in ("params", "grads", "optimizer"))
    return {"measured": measured, "predicted": predicted, "adamw_predicted_rank0": adamw, "max_error": error}


def plot(curves: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.2), squeeze=False)
    for ax, curve in zip(axes[0], curves):
        tokens = curve["tokens_per_step"]
        for run in curve["runs"]:
            best = curve["best_lr"][run["optimizer"]] == run["lr"]
            x = [(i + 1) * tokens / 1e6 for i in range(len(run["losses"]))]
            ax.plot(x, running_mean(run["losses"]), linewidth=1.4 if best else 0.6, alpha=1.0 if best else 0.45,
                    color="tab:red" if run["optimizer"] == "muon" else "tab:blue",
                    label=f"{run['optimizer']} lr {run['lr']:g}{' (best)' if best else ''}")  # fmt: skip
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("training loss (10-step mean)")
        ax.set_title(f"{curve['model']} on CPU: Muon against AdamW")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one model, 4 steps, one round (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    quick_lrs = {o: (3e-3,) for o in OPTIMIZERS}
    shapes, lrs = ({"llama_tiny": (4, 32, 2)}, quick_lrs) if args.quick else (CURVES, LRS)

    began = time.perf_counter()
    curves = [measure_curves(m, *shape, lrs) for m, shape in shapes.items()]
    print("\nLoss against tokens (final: mean of the last 10 steps)")
    print(f"{'model':<12}{'optimizer':<11}{'lr':>8}{'final':>9}")
    for curve in curves:
        for run in curve["runs"]:
            best = " best" if curve["best_lr"][run["optimizer"]] == run["lr"] else ""
            best += " (at the sweep's edge)" if best and curve["best_at_edge"][run["optimizer"]] else ""
            print(f"{curve['model']:<12}{run['optimizer']:<11}{run['lr']:>8g}{run['final_loss']:>9.4f}{best}")
        reached = curve["muon_tokens_to_adamw_final"]
        if reached:
            print(f"  {curve['model']}: Muon reaches AdamW's final loss after {reached:,} tokens "
                  f"({reached / curve['adamw_tokens']:.0%} of AdamW's)")  # fmt: skip
        else:
            print(f"  {curve['model']}: Muon does not reach AdamW's final loss in {curve['adamw_tokens']:,} tokens")

    print("\nStep time: Muon's tokens/s over AdamW's, llama_small (median of paired rounds, 95% interval)")
    speed = measure_speed(6 if args.quick else 8, 64 if args.quick else SPEED_SEQ_LEN, args.quick)

    print("\nModel state after one step: planner against measured (max error over ranks and parts)")
    memory = []
    for model, name, precision in MEMORY_ROWS[:2] if args.quick else MEMORY_ROWS:
        row = {"model": model, "layout": name, "precision": precision}
        row |= compare_memory(model, MEMORY_LAYOUTS[name], precision)
        memory.append(row)
        muon_opt, adamw_opt = row["predicted"][0]["optimizer"], row["adamw_predicted_rank0"]["optimizer"]
        print(f"  {model:<12}{name:<12}{precision:<11} error {row['max_error']:.2%}; optimizer state "
              f"{muon_opt:,} B (AdamW's {adamw_opt:,})")  # fmt: skip
    print("\nGPU step time and Newton-Schulz at the tensor-core rate: not measured (no GPU)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_name(args.out.stem + "_loss.png")
    payload = {
        "benchmark": "muon",
        "quick": args.quick,
        "torch": torch.__version__,
        "curves": curves,
        "speed": speed,
        "memory": memory,
        "plot": png.name if plot(curves, png) else None,
        "gpu": "not measured",
        "seconds": round(time.perf_counter() - began),
    }
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
