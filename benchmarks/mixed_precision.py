"""Mixed precision as the playbook counts it: per-rank model state part by part, traffic, and step time.

Prints tables and writes ``benchmarks/results/mixed_precision.json``:

1. Model state per rank under ``bf16-mixed`` after an AdamW step (``strategy.model_state_bytes()``:
   parameters, gradients with the engines' buckets, optimizer states with the fp32 masters),
   for ZeRO 0-3 on 2 data ranks, with ``reduce_dtype`` fp32 and bf16, and ZeRO-1 x tp2 and ZeRO-2
   x pp2 on 4 ranks, against ``layout_model_state_bytes`` (the one formula: weights 2Ψ, gradients
   4Ψ fp32 main gradients or 2Ψ bf16, optimizer 12Ψ with the master; stage 3 FSDP2's fp32 form),
   part by part.
2. The bytes per parameter ZeRO-1/2 move per step (``CommTracer``): gradients in the reduce dtype
   (4 or 2), weights gathered in bf16 (2).
3. Tokens/s of bf16 ZeRO-1 and ZeRO-2 on 2 CPU processes, this checkout against the code of
   ``--before`` (a git revision, checked out in a temporary worktree: fp32 weights under
   autocast), in alternated rounds (``testing.timing.Alternation``) so that drift hits both alike:
   the median of the paired ratios with its 95% bootstrap interval.

    python benchmarks/mixed_precision.py --before 39142d8   # ~6-10 minutes on 2 CPU cores
    python benchmarks/mixed_precision.py --quick            # a smoke run for the test suite: 1 layout, no timing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch

torch.set_num_threads(1)

from lightning_ultrascale import (  # noqa: E402
    LlamaModule,
    OptimConfig,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.testing import run_workers  # noqa: E402
from lightning_ultrascale.testing.parity import QUIET_TRAINER  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "mixed_precision.json"
ADAMW = OptimConfig(name="adamw", lr=1e-3, warmup_steps=0)
PARTS = ("params", "grads", "optimizer_states")
#: (name, stage, reduce_dtype, tp, pp, world size)
LAYOUTS = [
    *((f"zero{s}-dp2-{rd}", s, rd, 1, 1, 2) for rd in ("fp32", "bf16") for s in (0, 1, 2)),
    ("zero3-dp2", 3, "fp32", 1, 1, 2),
    ("zero1-dp2-tp2", 1, "fp32", 2, 1, 4),
    ("zero2-dp2-pp2-bf16", 2, "bf16", 1, 2, 4),
]
QUICK_LAYOUTS = [LAYOUTS[5]]  # zero2-dp2-bf16


def measure_worker(stage: int, reduce_dtype: str, tp: int, pp: int, world: int, seq_len: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    # (imported here: the step-time workers import this script with the code of --before, which predates it)
    from lightning_ultrascale.testing.tracing import StepStateAndTraffic

    measure = StepStateAndTraffic()
    plugins: list[Any] = [ZeRO(stage=stage, reduce_dtype=reduce_dtype)]
    plugins += [TensorParallel(tp)] if tp > 1 else []
    plugins += [PipelineParallel(pp, "1f1b")] if pp > 1 else []
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=UltraScaleStrategy(*plugins), precision="bf16-mixed",
        max_steps=2, callbacks=[measure], **QUIET_TRAINER,
    )  # fmt: skip
    module = LlamaModule("llama_tiny", optim=ADAMW)
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=seq_len, micro_batch_size=2))
    assert measure.tracer is not None and measure.state is not None
    # This rank's parameters before ZeRO-3 splits them (tensor and pipeline parallelism apply).
    local = sum((p.to_local() if isinstance(p, DTensor) and stage < 3 else p).numel() for p in module.parameters())
    records = [r for r in measure.tracer.records if r.payload_bytes > 64]  # not the loss logging's scalars
    ops = ("all_reduce", "reduce_scatter", "all_gather")
    # ZeRO's traffic alone: tensor parallelism moves activations with the same collectives.
    traffic = {op: sum(r.payload_bytes for r in records if r.op == op) for op in ops} if tp == 1 else None
    state = {part: getattr(measure.state, part) for part in PARTS}
    return {"state": state, "psi": local, "traffic": traffic}


def memory_rows(layouts: list[tuple[str, int, str, int, int, int]], seq_len: int) -> list[dict[str, Any]]:
    # (imported here: the step-time workers also run the code of --before, which predates it)
    from lightning_ultrascale.utils.memory import layout_model_state_bytes

    rows = []
    for name, stage, reduce_dtype, tp, pp, world in layouts:
        r = run_workers(measure_worker, world, stage, reduce_dtype, tp, pp, world, seq_len, timeout_s=300)[0]
        dp = world // (tp * pp)
        formula = layout_model_state_bytes(r["psi"], stage, dp, "bf16-mixed", reduce_dtype)
        expected = {part: getattr(formula, part) for part in PARTS}
        rows.append(
            {
                "layout": name, "stage": stage, "reduce_dtype": reduce_dtype, "tp": tp, "pp": pp, "dp": dp,
                "psi": r["psi"], "measured_bytes": r["state"], "formula_bytes": expected,
                "ratios": {part: r["state"][part] / expected[part] for part in PARTS},
                "bytes_per_param_moved": {op: b / r["psi"] for op, b in (r["traffic"] or {}).items()} or None,
            }
        )  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- step time
def time_worker(stage: int, steps: int, seq_len: int) -> float:
    from lightning_ultrascale.testing.timing import StepTimer

    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(stage=stage)), precision="bf16-mixed",
        max_steps=steps, callbacks=[timer], **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=seq_len, micro_batch_size=4)
    trainer.fit(LlamaModule("llama_tiny", optim=ADAMW), datamodule=data)
    return 2 * 4 * seq_len * timer.steps_per_s()


def _timed(code: Path, stage: int, steps: int, seq_len: int) -> float:
    """Tokens/s of one run of ``code``'s package (a checkout), in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--time-worker", str(stage), str(steps), str(seq_len)]
    out = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True, timeout=600, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def step_times(before: str, steps: int, seq_len: int, rounds: dict[str, Any]) -> dict[str, Any]:
    # (imported here: the time workers import this script with the code of --before, which predates it)
    from lightning_ultrascale.testing.timing import Alternation

    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), before], check=True,
                       capture_output=True)  # fmt: skip
        try:
            samples: dict[str, list[float]] = {}
            paired: dict[str, Any] = {}
            for stage in (1, 2):  # alternated rounds: drift on a noisy machine hits both alike
                arms = {
                    label: partial(_timed, code, stage, steps, seq_len)
                    for label, code in (("before", old), ("after", ROOT))
                }
                alternation = Alternation(arms, baseline="before", **rounds)
                paired[f"zero{stage}_after_over_before"] = alternation.run()["after"].as_dict()
                samples |= {f"zero{stage}_{label}": values for label, values in alternation.samples.items()}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {key: ratio["median"] for key, ratio in paired.items()}
    return {"before": before, "tokens_per_s": medians, "samples": samples, "paired_ratios": paired, **ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="zero2-dp2-bf16 only, seq 32, no step timing (smoke test)")
    parser.add_argument("--before", help="git revision whose bf16 step time to compare (the last fp32-weights one)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--time-worker", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time_worker:
        stage, steps, seq_len = args.time_worker
        print(run_workers(time_worker, 2, stage, steps, seq_len, timeout_s=600)[0])
        return
    seq_len = 32 if args.quick else 128
    rows = memory_rows(QUICK_LAYOUTS if args.quick else LAYOUTS, seq_len)
    print("Model state per rank under bf16-mixed after an AdamW step, llama_tiny: measured / formula, part by part")
    header = f"{'layout':<22} {'Ψ':>8} {'params B':>10} {'grads B':>10} {'optim B':>10}"
    print(header + "   ratios p/g/o          moved B/Ψ: ar rs ag")
    for r in rows:
        m, q, t = r["measured_bytes"], r["ratios"], r["bytes_per_param_moved"]
        ratios = "/".join(f"{q[p]:.3f}" for p in PARTS)
        moved = " ".join(f"{t[op]:.2f}" for op in ("all_reduce", "reduce_scatter", "all_gather")) if t else "(tp)"
        print(
            f"{r['layout']:<22} {r['psi']:>8,} {m['params']:>10,} {m['grads']:>10,} {m['optimizer_states']:>10,}"
            f"   {ratios}   {moved}"
        )
    timing: dict[str, Any] | str = "not measured (--quick, or no --before revision given)"
    if args.before and not args.quick:
        timing = step_times(args.before, steps=20, seq_len=seq_len, rounds={"max_rounds": 12, "max_seconds": 600})
        print(f"\nTokens/s, bf16-mixed, 2 CPU processes, median of alternated rounds (before = {args.before})")
        for key, value in timing["tokens_per_s"].items():
            print(f"{key:<16} {value:>10,.0f}")
        for key, ratio in timing["paired_ratios"].items():
            print(
                f"{key}: {ratio['median']:.3f} "
                f"(95% CI {ratio['ci_low']:.3f}-{ratio['ci_high']:.3f}, {ratio['pairs']} pairs)"
            )
    payload = {
        "benchmark": "mixed_precision", "quick": args.quick, "device": "cpu", "memory_and_comm": rows,
        "step_time": timing, "gpu": "not measured (no GPU lent)",
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
