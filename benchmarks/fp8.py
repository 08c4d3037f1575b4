"""FP8 training on CPU: each recipe's loss curve against bf16, and ZeRO-3's FP8 all-gather bytes.

Prints tables and writes ``benchmarks/results/fp8.json`` (and ``fp8_loss.png`` where matplotlib
is installed), for llama_small (dim 256, 4 blocks, MLP 768: every block linear a multiple of 128
wide, so every recipe converts all 28 of them; embedding and head stay high precision) on the
bundled corpus:

1. Training curves: the same seed, data order and AdamW schedule (lr 3e-3, 20 warm-up steps,
   cosine decay), 200 steps of 4 x 64 tokens in one process, for bf16 (Lightning's
   ``bf16-mixed``: bf16 autocast over fp32 master weights) and each ``FP8Precision`` recipe on top
   of it (tensorwise, rowwise, rowwise_with_gw_hp through torchao, emulated on CPU; blockwise,
   ours). The final loss is the mean of the last 10 steps (one step's loss swings with its batch);
   the bar is within 2% of bf16's.
2. ZeRO-3 all-gather bytes per step on 2 forked gloo processes (``CommTracer``, forward and
   backward of one step): bf16-mixed against the tensorwise recipe with FP8 all-gather. Each FP8
   linear's weight moves 1 byte per parameter instead of 2; the norms and the root unit
   (embedding, head, final norm) stay bf16, so the total falls by exactly the FP8 weights' numel
   per gather (the check), and the block linears' share of it halves.
3. Step time on CPU, the same runs as part 1: emulated FP8 (quantise, dequantise, fp32 GEMM)
   is slower than bf16 here by design; it says nothing about GPUs. GPU tokens/s and MFU (the
   issue's goal: FP8 >= 1.3x bf16 on a ~1B Llama on one H100) need a GPU: not measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchao.float8  # noqa: F401  (imported before forking: each worker would import it again, ~1 s)

from lightning_ultrascale import FP8Precision, LlamaModule, OptimConfig, UltraScaleDataModule, UltraScaleStrategy, ZeRO
from lightning_ultrascale.testing.parity import QUIET_TRAINER
from lightning_ultrascale.testing.spawn import run_workers
from lightning_ultrascale.testing.tracing import StepCommTracer

RESULTS = Path(__file__).parent / "results" / "fp8.json"
RUNS = ("bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise")
QUICK_RUNS = RUNS[:2]
MODEL = "llama_small"


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def _plugins(run: str) -> dict[str, Any]:
    return {"precision": "bf16-mixed"} if run == "bf16" else {"plugins": [FP8Precision(run)]}


def train_worker(run: str, steps: int, seq_len: int, batch: int) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    record = _Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=[record], **_plugins(run), **QUIET_TRAINER
    )
    optim = OptimConfig(name="adamw", lr=3e-3, warmup_steps=min(20, steps // 4))
    data = UltraScaleDataModule(seq_len=seq_len, micro_batch_size=batch)
    trainer.fit(LlamaModule(MODEL, optim=optim), datamodule=data)
    precision = trainer.precision_plugin
    converted = len(precision.swap.conversion.converted) if isinstance(precision, FP8Precision) else 0
    return {"losses": record.losses, "step_s": sorted(record.times)[len(record.times) // 2], "converted": converted}


def gather_worker(run: str, seq_len: int) -> dict[str, int]:
    trace = StepCommTracer()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(stage=3)), max_steps=1, callbacks=[trace],
        **_plugins(run), **QUIET_TRAINER,
    )  # fmt: skip
    module = LlamaModule(MODEL)
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=seq_len, micro_batch_size=1))
    fp8_numel = 0
    if isinstance(trainer.precision_plugin, FP8Precision):
        conversion = trainer.precision_plugin.swap.conversion
        fp8_numel = sum(module.model.get_submodule(n).weight.numel() for n in conversion.converted)
    return {"all_gather_bytes": trace.tracer.total("all_gather"), "fp8_weight_numel": fp8_numel}


def final_loss(losses: list[float], window: int = 10) -> float:
    tail = losses[-window:]
    return sum(tail) / len(tail)


def measure_curves(runs: tuple[str, ...], steps: int, seq_len: int, batch: int) -> dict[str, dict[str, Any]]:
    return {run: run_workers(train_worker, 1, run, steps, seq_len, batch, timeout_s=3600)[0] for run in runs}


def measure_gathers(seq_len: int) -> dict[str, Any]:
    bf16 = run_workers(gather_worker, 2, "bf16", seq_len, timeout_s=600)[0]
    fp8 = run_workers(gather_worker, 2, "tensorwise", seq_len, timeout_s=600)[0]
    # Two gathers per step for every unit (forward, and backward after resharding).
    saved = 2 * fp8["fp8_weight_numel"]
    return {
        "bf16_bytes": bf16["all_gather_bytes"],
        "fp8_bytes": fp8["all_gather_bytes"],
        "fp8_weight_numel": fp8["fp8_weight_numel"],
        "expected_fp8_bytes": bf16["all_gather_bytes"] - saved,
        "linear_bytes_bf16": 2 * 2 * fp8["fp8_weight_numel"],
        "linear_bytes_fp8": 2 * fp8["fp8_weight_numel"],
    }


def plot(curves: dict[str, dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, result in curves.items():
        ax.plot(result["losses"], label=run, linewidth=1.2 if run == "bf16" else 0.9)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{MODEL} on CPU: FP8 recipes against bf16-mixed")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="bf16 and tensorwise, 2 steps of 2 x 16 tokens (smoke test)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    steps, seq_len, batch = (2, 16, 2) if args.quick else (200, 64, 4)
    torch.set_num_threads(1)  # fork safety (run_workers); each run gets the same one core

    curves = measure_curves(QUICK_RUNS if args.quick else RUNS, steps, seq_len, batch)
    gathers = measure_gathers(seq_len)
    reference = final_loss(curves["bf16"]["losses"])
    rows = []
    print(f"\nTraining {MODEL}, {steps} steps of {batch} x {seq_len} tokens (final: mean of the last 10 steps)")
    print(f"{'run':<20}{'linears FP8':>12}{'first':>9}{'final':>9}{'vs bf16':>10}{'step s (CPU)':>14}")
    for run, result in curves.items():
        final = final_loss(result["losses"])
        row = {
            "run": run,
            "converted_linears": result["converted"],
            "first_loss": result["losses"][0],
            "final_loss": final,
            "final_vs_bf16": final / reference - 1,
            "median_step_s": result["step_s"],
            "losses": result["losses"],
        }
        rows.append(row)
        print(
            f"{run:<20}{result['converted']:>12}{row['first_loss']:>9.4f}{final:>9.4f}"
            f"{row['final_vs_bf16']:>+10.2%}{result['step_s']:>14.3f}"
        )
    print("\nZeRO-3 all-gather bytes per step, 2 ranks (forward + backward)")
    print(f"  bf16-mixed           {gathers['bf16_bytes']:>12,}")
    print(f"  FP8 tensorwise       {gathers['fp8_bytes']:>12,}  (expected {gathers['expected_fp8_bytes']:,})")
    print(f"  block linears: bf16 {gathers['linear_bytes_bf16']:,} -> FP8 {gathers['linear_bytes_fp8']:,} (x0.5)")
    print("\nGPU tokens/s and MFU, bf16 against each recipe: not measured (no GPU)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_name(args.out.stem + "_loss.png")
    payload = {
        "benchmark": "fp8",
        "model": MODEL,
        "steps": steps,
        "seq_len": seq_len,
        "micro_batch_size": batch,
        "torch": torch.__version__,
        "curves": rows,
        "zero3_all_gather": gathers,
        "plot": png.name if plot(curves, png) else None,
        "gpu": "not measured",
    }
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
