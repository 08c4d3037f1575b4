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
   documented way (``configure_model``), same model, data and processes, on ``llama_tiny`` and
   ``llama_small``, eager and with compiled blocks (ours: the ``Compile`` plugin; Lightning's: the
   same ``Compile().apply`` before ``fully_shard``), as alternated pairs
   (``testing.timing.Alternation``: the median of the paired ratios with its 95% bootstrap interval,
   pairs added until it is within ±1.5% or the cell's time budget is spent); and of our ZeRO-2 beside
   Lightning's ``FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")`` where Lightning allows it (GPUs only).

    python benchmarks/zero.py            # ~16 minutes on 2 CPU cores
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

from lightning_ultrascale import (  # noqa: E402
    Compile,
    LlamaModule,
    OptimConfig,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.testing import run_workers  # noqa: E402
from lightning_ultrascale.testing.parity import QUIET_TRAINER  # noqa: E402
from lightning_ultrascale.testing.timing import Alternation, fit_tokens_per_s  # noqa: E402
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
    """FSDP2 applied the way Lightning documents it for ModelParallelStrategy: in configure_model
    (``compiled``: the blocks ``Compile`` would compile, compiled first, as our strategy orders it)."""

    def __init__(self, *args: Any, compiled: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compiled = compiled

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.model is not None:
            return
        super().configure_model()
        if self.compiled:
            Compile().apply(self.model)
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


#: model -> (sequence length, micro-batch per rank, steps per run) of the speed cells.
SHAPES = {"llama_tiny": (128, 4, 20), "llama_small": (128, 4, 12)}


def speed_worker(
    kind: str, model: str, compiled: bool, world_size: int, steps: int, seq_len: int, micro: int
) -> float | str:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    module: LlamaModule = LlamaModule(model, optim=ADAMW)
    if kind in ("ultrascale_zero3", "ultrascale_zero2"):
        zero = ZeRO(stage=3 if kind == "ultrascale_zero3" else 2)
        strategy: Any = UltraScaleStrategy(zero, Compile()) if compiled else UltraScaleStrategy(zero)
    elif kind == "lightning_model_parallel_fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
        module = FSDP2ByHand(model, optim=ADAMW, compiled=compiled)
    else:
        strategy = FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")
    try:
        return fit_tokens_per_s(module, strategy, devices=world_size, steps=steps, seq_len=seq_len,
                                micro_batch=micro, data_ranks=world_size)  # fmt: skip
    except ValueError as err:  # Lightning refuses some strategies on CPU: report it, measure nothing
        if "requires a GPU accelerator" not in str(err):
            raise
        return f"not measured: {type(err).__name__}: {err}"


def _measure(kind: str, model: str, compiled: bool, world: int, shape: tuple[int, int, int]) -> float | str:
    seq_len, micro, steps = shape
    return run_workers(speed_worker, world, kind, model, compiled, world, steps, seq_len, micro, timeout_s=600)[0]


#: (ours, Lightning's) pairs timed side by side: the ratio is ours over Lightning's.
PAIRS = {
    "zero3_over_lightning_fsdp2": ("ultrascale_zero3", "lightning_model_parallel_fsdp2"),
    "zero2_over_lightning_shard_grad_op": ("ultrascale_zero2", "lightning_fsdp_shard_grad_op"),
}


def _cells(quick: bool) -> list[tuple[str, str, bool, tuple[int, int, int]]]:
    """(pair, model, compiled, shape) of each comparison: ZeRO-2's only once (Lightning refuses it on CPU)."""
    if quick:
        return [(pair, "llama_tiny", False, (32, 4, 4)) for pair in PAIRS]
    zero3 = [("zero3_over_lightning_fsdp2", m, c, SHAPES[m]) for m in SHAPES for c in (False, True)]
    return [*zero3, ("zero2_over_lightning_shard_grad_op", "llama_tiny", False, SHAPES["llama_tiny"])]


def _speed(quick: bool, world: int) -> list[dict[str, Any]]:
    """One row per cell: each strategy's median tokens/s (or why it measured nothing) and the paired ratio."""
    rounds = {"min_rounds": 1, "max_rounds": 1} if quick else {"min_rounds": 8, "max_rounds": 30, "max_seconds": 200}
    rows = []
    for pair, model, compiled, shape in _cells(quick):
        ours, theirs = PAIRS[pair]
        print(f"{pair}, {model}, {'compiled' if compiled else 'eager'}:", flush=True)
        arms = {kind: partial(_measure, kind, model, compiled, world, shape) for kind in (theirs, ours)}
        alternation = Alternation(arms, baseline=theirs, **rounds)
        paired = alternation.run().get(ours)
        tokens = {
            kind: statistics.median(alternation.samples[kind])
            if alternation.samples.get(kind)
            else alternation.not_measured.get(kind, "not measured")
            for kind in (ours, theirs)
        }
        rows.append({
            "pair": pair, "model": model, "compiled": compiled, "world_size": world,
            "tokens_per_step": world * shape[1] * shape[0], "steps_per_run": shape[2], "tokens_per_s": tokens,
            "paired_ratio": paired.as_dict() if paired is not None else alternation.not_measured[theirs],
            "samples": {kind: alternation.samples.get(kind, []) for kind in (ours, theirs)},
        })  # fmt: skip
    return rows


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
    speed = _speed(args.quick, world)

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
    print(f"\nTokens/s, {world} CPU processes, alternated pairs of runs (medians); ratio = ours / Lightning's")
    print(
        f"{'pair':<36} {'model':<12} {'blocks':<9} {'ours':>9} {'theirs':>9} {'ratio':>6} {'95% CI':>13} {'pairs':>5}"
    )
    for r in speed:
        ours, theirs = (r["tokens_per_s"][kind] for kind in PAIRS[r["pair"]])
        blocks = "compiled" if r["compiled"] else "eager"
        head = f"{r['pair']:<36} {r['model']:<12} {blocks:<9}"
        p = r["paired_ratio"]
        if isinstance(p, str):
            print(f"{head} {p[:100]}")
            continue
        ci = "-" if p["ci_low"] is None else f"{p['ci_low']:.3f}-{p['ci_high']:.3f}"
        verdict = "  (straddles 1.0)" if p["straddles_1"] else ""
        print(f"{head} {ours:>9,.0f} {theirs:>9,.0f} {p['median']:>6.3f} {ci:>13} {p['pairs']:>5}{verdict}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "zero",
        "quick": args.quick,
        "device": "cpu",
        "memory_and_comm": rows,
        "speed": speed,
    }
    args.out.write_text(json.dumps(payload, indent=2, default=str))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
