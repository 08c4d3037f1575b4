"""Where a training step's time goes: ours against Lightning's own strategies, phase by phase.

Prints a table and writes ``benchmarks/results/step_profile.json``. Each layout trains ``llama_tiny`` and
``llama_small`` (AdamW, seq 128, 8 sequences per step) on 2 CPU processes; rank 0 reports the median
over the steps after the warm-up of:

- the phases, as Lightning times them (its ``SimpleProfiler``, wall clock): ``step`` (one batch
  start to the next), ``forward`` (the
  strategy's ``training_step``: forward and loss), ``backward`` (with the gradient hooks that run in
  it), ``optimizer`` (``optimizer_step`` less forward and backward: the optimizer's update and what
  runs around it: gradient reduction left after backward, the non-finite guard, the ranks'
  agreement, clipping), ``loop`` (the rest of a batch: data, the batch-end hooks, logging);
- the collectives, from ``torch.profiler`` in a second run (its own overhead kept out of the
  phases): how many of each collective op the main thread issued per step and the milliseconds it
  spent in them (issuing, and for a blocking one waiting). Collectives issued from C++ (DDP's
  reducer) do not show; the control collectives of our strategy (one per healthy step) are counted
  by ``tests/multiprocess/test_host_syncs.py``;
- the hooks of the batch loop that took more than 0.1 ms per step (Python overhead in callbacks
  and hooks).

Layouts: our ``DataParallel`` against Lightning's ``ddp``; our ``ZeRO(stage=3)`` against Lightning's
``ModelParallelStrategy`` with FSDP2 applied by hand (``benchmarks/zero.py``'s ``FSDP2ByHand``);
our ``TensorParallel(2)`` alone (Lightning has no tensor-parallel strategy that takes a plain model).
Each run is repeated ``--rounds`` times, alternated, and each figure is the median over them: the
phases of two arms are compared side by side, not across runs at different times.

    python benchmarks/step_profile.py            # ~5 minutes on 2 CPU cores
    python benchmarks/step_profile.py --quick    # a smoke run for the test suite (figures mean nothing)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch

torch.set_num_threads(1)

from lightning.pytorch.profilers import SimpleProfiler  # noqa: E402

from lightning_ultrascale import (  # noqa: E402
    DataParallel,
    LlamaModule,
    OptimConfig,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.testing import run_workers  # noqa: E402
from lightning_ultrascale.testing.parity import QUIET_TRAINER  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from zero import FSDP2ByHand  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "step_profile.json"
ADAMW = OptimConfig(name="adamw", lr=1e-3, warmup_steps=0)
MODELS, SEQ_LEN, MICRO, WORLD = ("llama_tiny", "llama_small"), 128, 4, 2
#: layout -> (ours, Lightning's or None): the arms profiled side by side.
LAYOUTS = {"dp2": ("ultrascale_dp", "lightning_ddp"), "zero3 dp2": ("ultrascale_zero3", "lightning_fsdp2"),
           "tp2": ("ultrascale_tp2", None)}  # fmt: skip


class _Durations(SimpleProfiler):
    """Lightning's SimpleProfiler, kept in memory: no summary written or logged."""

    def summary(self) -> str:
        return ""


class _BatchStarts(L.Callback):
    """When each training batch starts: one start to the next is the whole batch, hooks and data included."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.times.append(time.perf_counter())


class _Window(L.Callback):
    """``torch.profiler`` around the steps ``first`` to ``last`` (inclusive), on every rank."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last, self.profile = first, last, None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.first:
            self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profile.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.last + 1 and self.profile is not None:
            self.profile.__exit__(None, None, None)


def _arm(kind: str, model: str) -> tuple[L.LightningModule, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    if kind == "lightning_fsdp2":
        return FSDP2ByHand(model, optim=ADAMW), ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    strategies = {
        "ultrascale_dp": lambda: UltraScaleStrategy(DataParallel()),
        "ultrascale_zero3": lambda: UltraScaleStrategy(ZeRO(stage=3)),
        "ultrascale_tp2": lambda: UltraScaleStrategy(TensorParallel(2)),
        "lightning_ddp": lambda: "ddp",
    }
    return LlamaModule(model, optim=ADAMW), strategies[kind]()


def _fit(kind: str, model: str, steps: int, callbacks: list[L.Callback], profiler: Any = None) -> None:
    module, strategy = _arm(kind, model)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, callbacks=callbacks,
                        profiler=profiler, **QUIET_TRAINER)  # fmt: skip
    data_ranks = 1 if kind == "ultrascale_tp2" else WORLD
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=MICRO * WORLD // data_ranks))


def phases_worker(kind: str, model: str, steps: int, warmup: int) -> dict[str, Any]:
    """Median milliseconds per step of each phase and of each hook of the batch loop, after ``warmup`` steps."""
    profiler, starts = _Durations(), _BatchStarts()
    _fit(kind, model, steps, [starts], profiler)
    per_step = {
        action: [1e3 * d for d in durations[warmup:]]
        for action, durations in profiler.recorded_durations.items()
        if len(durations) == steps
    }

    def one(suffix: str) -> list[float]:
        return next(v for action, v in per_step.items() if action.endswith(suffix))

    forward, backward, optimizer_step = one(".training_step"), one(".backward"), one(".optimizer_step")
    step = [1e3 * (b - a) for a, b in itertools.pairwise(starts.times[warmup:])]
    phases = {
        "step": step,
        "forward": forward,
        "backward": backward,
        "optimizer": [o - f - b for o, f, b in zip(optimizer_step, forward, backward)],
        "loop": [s - o for s, o in zip(step, optimizer_step)],
    }
    inner = {"run_training_batch", ".training_step", ".backward", ".optimizer_step"}
    hooks = {
        action: statistics.median(v)
        for action, v in per_step.items()
        if not any(action.endswith(s) for s in inner) and statistics.median(v) > 0.1
    }
    return {"phases": {k: statistics.median(v) for k, v in phases.items()}, "hooks": hooks}


def comm_worker(kind: str, model: str, steps: int, warmup: int) -> dict[str, Any]:
    """Per step, on this rank's main thread: each collective op's count and milliseconds."""
    window = _Window(warmup, steps - 2)
    _fit(kind, model, steps, [window])
    assert window.profile is not None
    profiled = steps - 1 - warmup
    ops: dict[str, dict[str, float]] = {}
    for event in window.profile.events():
        if not event.name.startswith("c10d::") or event.name == "c10d::barrier":
            continue
        row = ops.setdefault(event.name, {"per_step": 0.0, "ms_per_step": 0.0})
        row["per_step"] += 1 / profiled
        row["ms_per_step"] += event.cpu_time_total / 1e3 / profiled
    return ops


def _rounds(arms: list[str], model: str, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """Each arm's phases (median over ``rounds`` alternated runs), hooks and collectives."""
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for r in range(rounds):
        for kind in arms if r % 2 == 0 else arms[::-1]:
            runs[kind].append(run_workers(phases_worker, WORLD, kind, model, steps, warmup, timeout_s=600)[0])
    out: dict[str, Any] = {}
    for kind, results in runs.items():
        phases = {k: statistics.median(r["phases"][k] for r in results) for k in results[0]["phases"]}
        hooks = {k: statistics.median(r["hooks"].get(k, 0.0) for r in results) for k in results[-1]["hooks"]}
        comm = run_workers(comm_worker, WORLD, kind, model, steps, warmup, timeout_s=600)[0]
        out[kind] = {"phases_ms": phases, "hooks_ms": hooks, "collectives": comm}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="our dp2 only, 6 steps, one round (smoke test)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    steps, warmup, rounds = (6, 2, 1) if args.quick else (14, 4, args.rounds)
    # --quick: our dp2 arm only (the JSON's schema, in seconds)
    layouts = {"dp2": ["ultrascale_dp"]} if args.quick else {k: [a for a in v if a] for k, v in LAYOUTS.items()}
    rows = []
    for model in MODELS[:1] if args.quick else MODELS:
        for layout, arms in layouts.items():
            print(f"{model}, {layout}:", flush=True)
            for kind, result in _rounds(arms, model, rounds, steps, warmup).items():
                rows.append({"model": model, "layout": layout, "arm": kind, "rounds": rounds, "steps": steps,
                             "warmup": warmup, **result})  # fmt: skip

    print(f"\nMilliseconds per step, {WORLD} CPU processes, median of {rounds} rounds (phases: Lightning's")
    print("SimpleProfiler; collectives: torch.profiler, this rank's main thread, in a run of their own)")
    head = ("model", "layout", "arm", "step", "forward", "backward", "optimizer", "loop", "collectives (per step, ms)")
    print("{:<12} {:<10} {:<18} {:>7} {:>8} {:>8} {:>9} {:>6}  {}".format(*head))
    for row in rows:
        p = row["phases_ms"]
        comm = ", ".join(f"{k.removeprefix('c10d::')} {v['per_step']:.1f} {v['ms_per_step']:.1f}"
                         for k, v in sorted(row["collectives"].items()))  # fmt: skip
        print(f"{row['model']:<12} {row['layout']:<10} {row['arm']:<18} {p['step']:>7.1f} {p['forward']:>8.1f} "
              f"{p['backward']:>8.1f} {p['optimizer']:>9.1f} {p['loop']:>6.1f}  {comm}")  # fmt: skip
    print("\nHooks of the batch loop above 0.1 ms per step")
    for row in rows:
        hooks = ", ".join(f"{k} {v:.1f}" for k, v in sorted(row["hooks_ms"].items(), key=lambda kv: -kv[1]))
        print(f"{row['model']:<12} {row['layout']:<10} {row['arm']:<18} {hooks}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "step_profile", "quick": args.quick, "device": "cpu", "rows": rows}
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
