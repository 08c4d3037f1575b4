"""ZeRO stages 0-3: per-rank model-state memory and traffic against the playbook's formulas, and speed.

Prints tables and writes ``benchmarks/results/zero.json``:

1. For each stage at N = 1, 2, 4 data-parallel ranks (fp32 on CPU, AdamW): per-rank bytes of
   parameters, gradients and optimizer states measured after an optimizer step
   (``model_state_bytes``) against the playbook's formulas in their fp32 form (params 4Ψ, grads
   4Ψ, Adam 8Ψ): stage 0 16Ψ, stage 1 4Ψ+4Ψ+8Ψ/N, stage 2 4Ψ+(4Ψ+8Ψ)/N, stage 3 16Ψ/N.
2. Traffic per optimizer step, traced on one rank (``CommTracer``) and counted in parameters the
   way the playbook counts it (an all-reduce is a reduce-scatter plus an all-gather, so counts
   twice): 2Ψ for stages 0-2, 3Ψ for stage 3 (all-gather in forward and again in backward, plus a
   reduce-scatter).
3. Tokens/s of our ZeRO-3 and Lightning's ``ModelParallelStrategy`` with FSDP2 applied the
   documented way (``configure_model``), same model, data and processes, as alternated pairs
   (``testing.timing.Alternation``: the median of the paired ratios with its 95% bootstrap interval,
   pairs added until it is within ±1.5% or the time budget is spent); and of our ZeRO-2 beside
   Lightning's ``FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")`` where Lightning allows it (GPUs only).

    python benchmarks/zero.py            # ~4 minutes on 2 CPU cores
    python benchmarks/zero.py --quick    # a smoke run for the test suite: stage 3 at N=2, ZeRO-3 vs FSDP2, 4 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch

torch.set_num_threads(1)

from lightning_ultrascale import LlamaModule, OptimConfig, UltraScaleDataModule, UltraScaleStrategy, ZeRO  # noqa: E402
from lightning_ultrascale.testing import run_workers  # noqa: E402
from lightning_ultrascale.testing.parity import QUIET_TRAINER  # noqa: E402
from lightning_ultrascale.testing.timing import Alternation, PairedRatio, fit_tokens_per_s  # noqa: E402
from lightning_ultrascale.testing.tracing import StepStateAndTraffic  # noqa: E402
from lightning_ultrascale.utils.memory import playbook_model_state_bytes  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "zero.json"
ADAMW = OptimConfig(name="adamw", lr=1e-3, warmup_steps=0)


def measure_worker(stage: int, world_size: int, seq_len: int) -> dict[str, Any]:
    measure = StepStateAndTraffic()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=UltraScaleStrategy(ZeRO(stage=stage)), max_steps=2,
        callbacks=[measure], **QUIET_TRAINER,
    )  # fmt: skip
    module = LlamaModule("llama_tiny", optim=ADAMW)
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=seq_len, micro_batch_size=1))
    assert measure.tracer is not None and measure.state is not None
    # Gradient and parameter traffic only: the loss logging's scalar all-reduce is not ZeRO's.
    records = [r for r in measure.tracer.records if r.payload_bytes > 64]
    elements = {
        op: sum(r.payload_bytes for r in records if r.op == op) // 4
        for op in ("all_reduce", "reduce_scatter", "all_gather")
    }
    state = {part: getattr(measure.state, part) for part in ("params", "grads", "optimizer_states")}
    return {"state": state, "elements": elements, "n_params": module.config.num_params()}


class FSDP2ByHand(LlamaModule):
    """FSDP2 applied the way Lightning documents it for ModelParallelStrategy: in configure_model."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.model is not None:
            return
        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def speed_worker(kind: str, world_size: int, steps: int, seq_len: int, micro_batch: int) -> float | str:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    module: LlamaModule = LlamaModule("llama_tiny", optim=ADAMW)
    if kind == "ultrascale_zero3":
        strategy: Any = UltraScaleStrategy(ZeRO(stage=3))
    elif kind == "ultrascale_zero2":
        strategy = UltraScaleStrategy(ZeRO(stage=2))
    elif kind == "lightning_model_parallel_fsdp2":
        strategy, module = (
            ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1),
            FSDP2ByHand("llama_tiny", optim=ADAMW),
        )
    else:
        strategy = FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")
    try:
        return fit_tokens_per_s(module, strategy, devices=world_size, steps=steps, seq_len=seq_len,
                                micro_batch=micro_batch, data_ranks=world_size)  # fmt: skip
    except ValueError as err:  # Lightning refuses some strategies on CPU: report it, measure nothing
        if "requires a GPU accelerator" not in str(err):
            raise
        return f"not measured: {type(err).__name__}: {err}"


def _measure(kind: str, world: int, steps: int, seq_len: int) -> float | str:
    return run_workers(speed_worker, world, kind, world, steps, seq_len, 4, timeout_s=600)[0]


#: (ours, Lightning's) pairs timed side by side: the ratio is ours over Lightning's.
PAIRS = {
    "zero3_over_lightning_fsdp2": ("ultrascale_zero3", "lightning_model_parallel_fsdp2"),
    "zero2_over_lightning_shard_grad_op": ("ultrascale_zero2", "lightning_fsdp_shard_grad_op"),
}


def _speed(quick: bool, world: int, seq_len: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Per pair: its paired ratio (or why it measured nothing); per strategy: median tokens/s, and samples."""
    steps = 4 if quick else 20
    rounds = {"min_rounds": 1, "max_rounds": 1} if quick else {"min_rounds": 8, "max_rounds": 40, "max_seconds": 270}
    ratios: dict[str, Any] = {}
    speed: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    for name, (ours, theirs) in PAIRS.items():
        arms = {kind: partial(_measure, kind, world, steps, seq_len) for kind in (theirs, ours)}
        alternation = Alternation(arms, baseline=theirs, **rounds)
        paired = alternation.run().get(ours)
        ratios[name] = paired if paired is not None else f"{name}: {alternation.not_measured[theirs]}"
        for kind in (ours, theirs):
            values = alternation.samples.get(kind)
            speed[kind] = statistics.median(values) if values else alternation.not_measured.get(kind, "not measured")
            samples[kind] = values or []
    return ratios, speed, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="stage 3 at N=2, ZeRO-3 against FSDP2 only, 4 steps (smoke test)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    seq_len = 32 if args.quick else 128
    cells = [(3, 2)] if args.quick else [(stage, n) for stage in (0, 1, 2, 3) for n in (1, 2, 4)]

    rows = []
    for stage, n in cells:
        r = run_workers(measure_worker, n, stage, n, seq_len, timeout_s=300)[0]
        psi = r["n_params"]
        formula = playbook_model_state_bytes(psi, stage=stage, dp=n, k_optimizer=8, mixed_precision=False)
        measured = r["state"]
        e = r["elements"]
        volume = 2 * e["all_reduce"] + e["reduce_scatter"] + e["all_gather"]
        expected_volume = 0 if n == 1 else (3 if stage == 3 else 2) * psi
        rows.append(
            {
                "stage": stage,
                "N": n,
                "psi": psi,
                "measured_bytes": measured,
                "formula_bytes": {
                    "params": formula.params,
                    "grads": formula.grads,
                    "optimizer_states": formula.optimizer_states,
                },
                "measured_total": sum(measured.values()),
                "formula_total": formula.total,
                "memory_ratio": sum(measured.values()) / formula.total,
                "comm_elements": e,
                "comm_volume_params": volume,
                "formula_volume_params": expected_volume,
                "comm_ratio": volume / expected_volume if expected_volume else None,
            }
        )

    world = 2
    ratios, speed, samples = _speed(args.quick, world, seq_len)

    print("Model state per rank after an AdamW step, fp32, llama_tiny (measured / playbook formula)")
    header = f"{'stage':>5} {'N':>2} {'params B':>11} {'grads B':>11} {'optim B':>11} {'total B':>11}"
    print(header + f" {'formula B':>11} {'ratio':>6}  {'comm Ψ':>6}")
    for row in rows:
        m = row["measured_bytes"]
        comm = f"{row['comm_volume_params'] / row['psi']:.3f}" if row["N"] > 1 else "-"
        print(
            f"{row['stage']:>5} {row['N']:>2} {m['params']:>11,} {m['grads']:>11,} {m['optimizer_states']:>11,} "
            f"{row['measured_total']:>11,} {row['formula_total']:>11,.0f} {row['memory_ratio']:>6.3f}  {comm:>6}"
        )
    print(f"\nTokens/s, {world} CPU processes, medians of the alternated runs")
    for kind, value in speed.items():
        print(f"{kind:<34} {value:>10,.0f}" if isinstance(value, float) else f"{kind:<34} {value[:90]}")
    for paired in ratios.values():
        print(paired.describe() if isinstance(paired, PairedRatio) else paired[:120])

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "zero",
        "quick": args.quick,
        "device": "cpu",
        "memory_and_comm": rows,
        "speed": speed,
        "ratios": {k: v.as_dict() if isinstance(v, PairedRatio) else v for k, v in ratios.items()},
        "samples": samples,
    }
    args.out.write_text(json.dumps(payload, indent=2, default=str))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
