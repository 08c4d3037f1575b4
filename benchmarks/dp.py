"""Data parallelism: gradient traffic vs the ring all-reduce formula, and speed vs Lightning's ``ddp``.

Prints two tables and writes ``benchmarks/results/dp.json``:

1. Communication per optimizer step, traced (``CommTracer``) around backward on every rank: the
   bytes handed to all-reduce over the ``dp_cp`` dim (must be Ψ, the gradient bytes) and the
   per-rank ring traffic 2Ψ(N-1)/N that this implies, against the playbook's formula.
2. Tokens/s of ``UltraScaleStrategy(DataParallel())`` and Lightning's built-in ``ddp`` on the same
   model, data and process count, on ``llama_tiny`` and ``llama_small``, eager and with compiled
   blocks (ours: the ``Compile`` plugin; Lightning's: the same ``Compile().apply`` on its model in
   ``configure_model``), as alternated pairs (``testing.timing.Alternation``: these machines are
   noisy, only a ratio measured side by side means anything): the median of the paired ratios with
   its 95% bootstrap interval, pairs added until the interval is within ±1.5% or the cell's time
   budget is spent; the table says when the interval straddles 1.0.

    python benchmarks/dp.py            # full run (~15 minutes on 2 CPU cores)
    python benchmarks/dp.py --quick    # smoke run for the suite: N=2, llama_tiny eager, 4 steps (figures mean nothing)
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

from lightning_ultrascale import Compile, DataParallel, LlamaModule, UltraScaleDataModule, UltraScaleStrategy  # noqa: E402
from lightning_ultrascale.testing import run_workers  # noqa: E402
from lightning_ultrascale.testing.parity import QUIET_TRAINER  # noqa: E402
from lightning_ultrascale.testing.timing import Alternation, fit_tokens_per_s  # noqa: E402
from lightning_ultrascale.utils.comm import CommTracer  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "dp.json"


class TraceBackward(L.Callback):
    """Trace the collectives of each backward pass (where DP reduces gradients)."""

    def __init__(self) -> None:
        self.tracer: CommTracer | None = None
        self.per_step: list[dict[str, int]] = []

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.tracer = CommTracer(trainer.strategy.mesh.root)
        self.tracer.__enter__()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.tracer is not None
        self.tracer.__exit__(None, None, None)
        self.per_step.append(
            {
                "calls": sum(r.op == "all_reduce" for r in self.tracer.records),
                "payload": self.tracer.total(op="all_reduce", kind="payload"),
                "wire": self.tracer.total(op="all_reduce", kind="wire"),
                "dims": sorted({r.dim for r in self.tracer.records}),
            }
        )


def _trainer(strategy: Any, world_size: int, steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        **QUIET_TRAINER,
    )


def comm_worker(world_size: int, seq_len: int, micro_batch: int) -> dict[str, Any]:
    tracer = TraceBackward()
    module = LlamaModule("llama_tiny")
    trainer = _trainer(UltraScaleStrategy(DataParallel()), world_size, 2, [tracer])
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=seq_len, micro_batch_size=micro_batch))
    n_params = sum(p.numel() for p in module.parameters())
    return {"n_params": n_params, "param_bytes": n_params * 4, "steps": tracer.per_step}


#: model -> (sequence length, micro-batch per rank, steps per run) of the speed cells.
SHAPES = {"llama_tiny": (256, 8, 20), "llama_small": (128, 4, 12)}


class CompiledLlama(LlamaModule):
    """Lightning's arm with compiled blocks: the blocks ``Compile`` would compile, compiled by hand."""

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            Compile().apply(self.model)


def speed_worker(kind: str, model: str, compiled: bool, world_size: int, steps: int, seq_len: int, micro: int) -> float:
    if kind == "ultrascale":
        plugins = [DataParallel(), Compile()] if compiled else [DataParallel()]
        module, strategy = LlamaModule(model), UltraScaleStrategy(*plugins)
    else:
        module, strategy = (CompiledLlama(model) if compiled else LlamaModule(model)), "ddp"
    return fit_tokens_per_s(module, strategy, devices=world_size, steps=steps, seq_len=seq_len,
                            micro_batch=micro, data_ranks=world_size)  # fmt: skip


def _measure(kind: str, model: str, compiled: bool, world: int, steps: int, seq_len: int, micro: int) -> float:
    return run_workers(speed_worker, world, kind, model, compiled, world, steps, seq_len, micro, timeout_s=600)[0]


def _speed(quick: bool, world: int) -> list[dict[str, Any]]:
    """One row per (model, eager or compiled): both strategies' median tokens/s and the paired ratio."""
    if quick:
        cells, rounds = [("llama_tiny", False, (32, 2, 4))], {"min_rounds": 1, "max_rounds": 1}
    else:
        cells = [(m, c, SHAPES[m]) for m in SHAPES for c in (False, True)]
        rounds = {"min_rounds": 8, "max_rounds": 30, "max_seconds": 200}
    rows = []
    for model, compiled, (seq_len, micro, steps) in cells:
        print(f"{model}, {'compiled' if compiled else 'eager'}:", flush=True)
        arms = {
            kind: partial(_measure, kind, model, compiled, world, steps, seq_len, micro)
            for kind in ("ddp", "ultrascale")
        }
        alternation = Alternation(arms, baseline="ddp", **rounds)
        ratio = alternation.run()["ultrascale"]
        ours, theirs = (statistics.median(alternation.samples[k]) for k in ("ultrascale", "ddp"))
        rows.append({
            "model": model, "compiled": compiled, "world_size": world, "tokens_per_step": world * micro * seq_len,
            "steps_per_run": steps, "ultrascale_tokens_per_s": ours, "ddp_tokens_per_s": theirs,
            "paired_ratio": ratio.as_dict(), "samples": alternation.samples,
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N=2 only, 4 steps, one repeat (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    seq_len, micro_batch = (32, 2) if args.quick else (256, 8)

    comm_rows = []
    for n in (2,) if args.quick else (2, 4):
        r = run_workers(comm_worker, n, n, seq_len, micro_batch, timeout_s=300)[0]
        step = r["steps"][-1]
        formula = 2 * r["param_bytes"] * (n - 1) / n
        comm_rows.append(
            {
                "N": n,
                "params": r["n_params"],
                "grad_bytes": r["param_bytes"],
                "all_reduce_calls": step["calls"],
                "all_reduce_payload_bytes": step["payload"],
                "wire_bytes_per_rank": step["wire"],
                "formula_2psi_(n-1)/n": formula,
                "ratio": step["wire"] / formula,
                "dims": step["dims"],
            }
        )

    world = 2
    speed = _speed(args.quick, world)

    print("Gradient all-reduce per optimizer step (fp32, llama_tiny), traced on rank 0")
    print(f"{'N':>2} {'params':>9} {'calls':>5} {'payload B':>10} {'wire B/rank':>12} {'2Ψ(N-1)/N':>12} {'ratio':>7}")
    for c in comm_rows:
        print(
            f"{c['N']:>2} {c['params']:>9,} {c['all_reduce_calls']:>5} {c['all_reduce_payload_bytes']:>10,} "
            f"{c['wire_bytes_per_rank']:>12,.0f} {c['formula_2psi_(n-1)/n']:>12,.0f} {c['ratio']:>7.4f}"
        )
    print(f"\nTokens/s, {world} CPU processes, alternated pairs of runs (medians); ratio = ours / Lightning ddp")
    print(f"{'model':<12} {'blocks':<9} {'ours':>9} {'ddp':>9} {'ratio':>6} {'95% CI':>13} {'pairs':>5}")
    for r in speed:
        p = r["paired_ratio"]
        ci = "-" if p["ci_low"] is None else f"{p['ci_low']:.3f}-{p['ci_high']:.3f}"
        blocks = "compiled" if r["compiled"] else "eager"
        verdict = "  (straddles 1.0)" if p["straddles_1"] else ""
        print(f"{r['model']:<12} {blocks:<9} {r['ultrascale_tokens_per_s']:>9,.0f} {r['ddp_tokens_per_s']:>9,.0f} "
              f"{p['median']:>6.3f} {ci:>13} {p['pairs']:>5}{verdict}")  # fmt: skip

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "dp", "quick": args.quick, "device": "cpu", "comm": comm_rows, "speed": speed}
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
