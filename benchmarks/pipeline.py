"""Pipeline schedules: measured bubble against the simulator and the formulas, and speed.

Prints a table and writes ``benchmarks/results/pipeline.json``. For each of the seven schedules
at pp=2 (one forked gloo process per CPU core), the same model, batch and m = 8 microbatches, run
in alternated rounds (every schedule once a round, the order rotated: ``testing.timing.Alternation``)
until each schedule's paired ratio to 1F1B is resolved to +-1.5% or the rounds run out (the 1-minute
load average before and after is recorded: other processes sharing the cores inflate both compute
and idle time):

1. Measured bubble, the playbook's ``r_bubble = (step - compute) / compute`` of a rank. ``step`` is
   the wall time inside ``PipelineStep.run`` (the pipeline's step runner) (torch's ``schedule.step`` and the loss
   broadcast that ends it on every rank at once, as the simulator's makespan ends), ``compute`` the
   wall time inside this rank's stages' ``forward_one_chunk``, ``backward_one_chunk`` and
   ``backward_weight_one_chunk``; the rest is waiting for a neighbour, p2p and Python. Mean over
   the steps after the first (shape inference), then over the ranks.
2. The simulator's bubble (:func:`simulate`) and the literature's (:func:`bubble_formula`) with the
   op costs measured in the same run: ``F``, and ``B`` / ``W`` where the schedule splits the
   backward (otherwise the full backward ``BW``, halved into B and W: only their sum matters
   there). Both assume p2p = 0 and equal stages.
3. Tokens/s (tokens per optimizer step over the mean step time, optimizer included; mean over the
   rounds) and the ratio to 1F1B: the median of the rounds' paired ratios with its 95% bootstrap
   interval (``vs_1f1b``; ``straddles_1`` where the rounds cannot tell the schedule from 1F1B).

The model is llama_tiny widened (dim 384, ffn 1536; 64 and 128 in --quick) with ``2 pp`` blocks, split by explicit
``split_points`` so every stage has the same blocks: one per virtual stage at v=2, two per stage
at v=1; every rank computes the same two blocks whatever the schedule. The embedding and the
head (vocabulary 320) cost a few percent of a block. On the first stage torch skips the input
gradient (B ~ 0) and does the whole backward in W (``backward_weight_one_chunk``), so the mean
``B`` and ``W`` over stages are not each stage's: the JSON keeps the per-stage means.

    python benchmarks/pipeline.py            # 4-10 minutes on 2 idle CPU cores (6-12 rounds)
    python benchmarks/pipeline.py --quick    # a smoke run for the test suite: 1f1b and zbv, tiny, 3 steps
    python benchmarks/pipeline.py --pp 4     # more processes than cores: time-sliced, see the warning
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch

torch.set_num_threads(1)

import torch.distributed.pipelining  # noqa: E402  (imported before forking: testing/spawn.py)

from lightning_ultrascale import LlamaModule, PipelineParallel, UltraScaleDataModule, UltraScaleStrategy  # noqa: E402
from lightning_ultrascale.models import get_model_config  # noqa: E402
from lightning_ultrascale.parallel.pipeline.schedules import SCHEDULES, resolve_virtual_stages  # noqa: E402
from lightning_ultrascale.parallel.pipeline.simulator import OpCosts, bubble_formula, simulate  # noqa: E402
from lightning_ultrascale.testing import run_workers  # noqa: E402
from lightning_ultrascale.testing.parity import QUIET_TRAINER  # noqa: E402
from lightning_ultrascale.testing.timing import Alternation, StepTimer  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "pipeline.json"
KIND_OF = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}


def model_config(pp: int, dim: int, ffn: int) -> Any:
    # 2 pp blocks: one per stage at v=2, two at v=1, so the stages are equal under every schedule.
    return dataclasses.replace(
        get_model_config("llama_tiny"), dim=dim, ffn_hidden_dim=ffn, n_layers=2 * pp, name=f"llama_tiny_d{dim}"
    )


def split_points(schedule: str, pp: int, n_layers: int) -> list[str]:
    n_stages = pp * resolve_virtual_stages(schedule, None)
    per_stage = n_layers // n_stages
    return [f"layers.{s * per_stage}" for s in range(1, n_stages)]


class ComputeClock:
    """Per schedule run: its wall time, and each compute op of this rank's stages as (stage, kind, seconds)."""

    def __init__(self, plugin: PipelineParallel) -> None:
        assert plugin.step_runner is not None
        self.runner = plugin.step_runner
        self.steps: list[dict[str, Any]] = []
        self._ops: list[tuple[int, str, float]] = []
        self._run_step = self.runner.run
        self.runner.run = self._timed_step  # type: ignore[method-assign]

    def _timed_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.steps:
            self._wrap_stages()  # the torch schedule exists once the strategy has materialised the model
        self._ops = []
        start = time.perf_counter()
        loss = self._run_step(*args, **kwargs)
        self.steps.append({"wall": time.perf_counter() - start, "ops": self._ops})
        return loss

    def _wrap_stages(self) -> None:
        schedule = self.runner._torch_schedule()
        for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(stage.stage_index, name, getattr(stage, name)))

    def _timed(self, stage: int, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            kind = KIND_OF.get(name) or ("BW" if kwargs.get("full_backward", True) else "B")
            start = time.perf_counter()
            out = method(*args, **kwargs)
            self._ops.append((stage, kind, time.perf_counter() - start))
            return out

        return timed


def worker(schedule: str, pp: int, m: int, steps: int, seq_len: int, dim: int, ffn: int) -> dict[str, Any]:
    config = model_config(pp, dim, ffn)
    plugin = PipelineParallel(pp, schedule, microbatches=m, split_points=split_points(schedule, pp, config.n_layers))
    clock, timer = ComputeClock(plugin), StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=pp, strategy=UltraScaleStrategy(plugin), max_steps=steps, callbacks=[timer],
        **QUIET_TRAINER,
    )  # fmt: skip
    # One sample per microbatch; every pp rank works on the same batch.
    trainer.fit(LlamaModule(config), datamodule=UltraScaleDataModule(seq_len=seq_len, micro_batch_size=m))
    # Warm-up 1: the first step infers shapes; the next ones are as steady as any later one.
    return {"steps": clock.steps, "tokens_per_s": m * seq_len * timer.steps_per_s(warmup=1)}


def summarise(schedule: str, pp: int, m: int, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Bubble per rank and op costs (ms) over the runs' steps after the first; simulator and formula on those costs."""
    ratios: dict[int, list[float]] = defaultdict(list)
    by_kind: dict[str, list[float]] = defaultdict(list)
    by_stage: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for ranks in runs:
        for rank, result in enumerate(ranks):
            for step in result["steps"][1:]:  # the first step infers shapes
                compute = sum(t for _, _, t in step["ops"])
                ratios[rank].append((step["wall"] - compute) / compute)
                for stage, kind, t in step["ops"]:
                    by_kind[kind].append(1e3 * t)
                    by_stage[stage][kind].append(1e3 * t)
    bubbles = [statistics.mean(ratios[rank]) for rank in sorted(ratios)]
    ms = {kind: statistics.mean(ts) for kind, ts in by_kind.items()}
    if "B" in ms:  # a split backward: B and W as measured (a schedule may also run some full BW ops)
        b, w = ms["B"], ms["W"]
    else:  # only B + W matters to these schedules' simulation and formula
        b = w = ms["BW"] / 2
    costs = OpCosts(forward=ms["F"], backward_input=b, backward_weight=w)
    v = resolve_virtual_stages(schedule, None)
    return {
        "schedule": schedule,
        "v": v,
        "m": m,
        "measured_bubble": statistics.mean(bubbles),
        "measured_bubble_per_rank": bubbles,
        "simulator_bubble": simulate(schedule, pp, m, v, costs).bubble_ratio,
        "formula_bubble": bubble_formula(schedule, pp, m, v, costs),
        "op_ms": ms,
        "op_ms_per_stage": {
            s: {k: statistics.mean(ts) for k, ts in kinds.items()} for s, kinds in sorted(by_stage.items())
        },
        "tokens_per_s": statistics.mean(r["tokens_per_s"] for ranks in runs for r in ranks),
    }


def _interval(paired: dict[str, Any] | None) -> str:
    if paired is None or paired["ci_low"] is None:
        return "-"
    return f"{paired['ci_low']:.3f}-{paired['ci_high']:.3f}" + ("*" if paired["straddles_1"] else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1f1b and zbv, a tiny model, seq 32, 3 steps (smoke test)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks, one process each (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    pp, m = args.pp, 8
    seq_len, dim, ffn, steps = (32, 64, 128, 3) if args.quick else (128, 384, 1536, 8)
    cores = os.cpu_count() or 1
    machine = f"CPU, {cores} cores, gloo, one thread per process"
    if pp > cores:
        caveat = (
            f"pp={pp} processes on {cores} cores time-slice: idle time is partly another rank's compute, so the "
            "measured bubbles are not the schedules'"
        )
        print(f"WARNING: {caveat}\n")
    else:
        caveat = (
            f"pp > {cores} not measured: its processes would time-slice {cores} cores (--pp runs it, with a warning)"
        )

    load_before = os.getloadavg()
    schedules = ("1f1b", "zbv") if args.quick else SCHEDULES
    runs: dict[str, list[Any]] = {schedule: [] for schedule in schedules}

    def arm(schedule: str) -> Callable[[], float]:
        def run() -> float:
            ranks = run_workers(worker, pp, schedule, pp, m, steps, seq_len, dim, ffn, timeout_s=300)
            runs[schedule].append(ranks)
            return statistics.mean(r["tokens_per_s"] for r in ranks)

        return run

    # Alternated rounds, so drift on a shared machine hits every schedule alike; --quick: one round, no interval.
    rounds = {"min_rounds": 1, "max_rounds": 1} if args.quick else {"max_rounds": 12, "max_seconds": 600}
    alternation = Alternation({s: arm(s) for s in schedules}, baseline="1f1b", **rounds)
    ratios = alternation.run()
    rows = [summarise(schedule, pp, m, schedule_runs) for schedule, schedule_runs in runs.items()]
    for row in rows:
        paired = ratios.get(row["schedule"])
        row["tokens_per_s_vs_1f1b"] = paired.median if paired is not None else 1.0
        row["vs_1f1b"] = paired.as_dict() if paired is not None else None
    repeats = len(runs["1f1b"])

    load_after = os.getloadavg()
    config = model_config(pp, dim, ffn)
    print(
        f"Pipeline bubble r = idle / compute per rank, pp={pp}, {config.n_layers} blocks (dim {dim}, ffn {ffn}), "
        f"seq {seq_len}, m={m} microbatches of 1 sample; {repeats} alternated round(s) of {steps} steps per schedule, "
        f"first step left out; {machine}; 1-min load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    columns = ("measured", "simulator", "formula", "tokens/s", "vs 1f1b", "95% interval")
    print(f"{'schedule':<17} {'v':>2} {'m':>2} " + " ".join(f"{c:>9}" for c in columns))
    for r in rows:
        print(
            f"{r['schedule']:<17} {r['v']:>2} {r['m']:>2} {r['measured_bubble']:>9.3f} {r['simulator_bubble']:>9.3f} "
            f"{r['formula_bubble']:>9.3f} {r['tokens_per_s']:>9,.0f} {r['tokens_per_s_vs_1f1b']:>9.3f} "
            f"{_interval(r['vs_1f1b']):>12}"
        )
    print("(* the interval holds 1.0: these rounds cannot tell the schedule's speed from 1F1B's)")
    print(caveat)
    print("\nMeasured op costs, ms (mean over stages; F forward, B input grad, W weight grad, BW both)")
    for r in rows:
        print(f"{r['schedule']:<17} " + "  ".join(f"{k} {v:6.2f}" for k, v in sorted(r["op_ms"].items())))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "pipeline",
        "quick": args.quick,
        "device": "cpu",
        "machine": machine,
        "load_average_1min": {"before": load_before[0], "after": load_after[0]},
        "caveat": caveat,
        "torch": torch.__version__,
        "pp": pp,
        "microbatches": m,
        "seq_len": seq_len,
        "steps": steps,
        "repeats": repeats,
        "model": dataclasses.asdict(config),
        "schedules": rows,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
