"""The planner's time model against step times measured on this machine (no GPU needed).

1. **A ``cpu`` profile from micro-benchmarks only** (never from step times), measured on two
   processes at once with one thread each, as the runs use the machine: fp32 GEMM throughput
   (the peak), streaming memory bandwidth, the unhidden cost of one eager op forward and backward
   (dispatch and autograd; on DTensors too), the fused attention kernel's efficiency, gloo's
   all-reduce bandwidth and latency between the two processes, and the training loop's own time
   per step (Lightning, data, logging: a one-block model of width 8, not a layout measured below).
2. **Step times of two-rank layouts** (data parallel, ZeRO-1/3, tp2, pp2 1F1B and ZBV, cp2, ep2,
   accumulation, recomputation; context parallelism also at a second sequence length), each trained
   in the real Lightning loop: the median wall time
   between optimizer steps after two warm-up steps, the faster of two passes over all layouts (the
   micro-benchmarks too: the best of two). The MoE run also
   records its routing: the busiest expert rank's rows over the mean (``expert_load``).
3. **The planner's prediction** of each (``estimate(...).step_time`` on the measured profile; the
   MoE layout with its measured ``Workload.expert_load``).

Side by side in one run; prints a table and writes ``benchmarks/results/cpu_time_model.json``,
which ``tests/unit/test_plan_time.py`` checks (and re-predicts with today's code).

    python benchmarks/cpu_time_model.py            # ~10 min on 2 cores (each run twice)
    python benchmarks/cpu_time_model.py --quick    # a smoke run for the test suite: one layout, one probe
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ultrascale import LlamaModule, OptimConfig, UltraScaleDataModule
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.models.llama import LlamaConfig
from lightning_ultrascale.plan import Candidate, Hardware, Workload, estimate, expert_load
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER
from lightning_ultrascale.utils.comm import wire_bytes

RESULTS = Path(__file__).parent / "results" / "cpu_time_model.json"
SEQ_LEN, STEPS, WARMUP = 256, 8, 2
#: passes over the layouts (and runs of the micro-benchmarks and host probes); the fastest counts:
#: a run that a neighbour slowed down does not (this machine: tp2 0.72 s once, 0.44-0.49 s
#: otherwise; memory bandwidth 25 GB/s once, 43-47 otherwise). Passes, not back-to-back repeats,
#: so that a slow minute cannot hit both measurements of one layout.
RUNS = 2
GEMM_WIDTHS = (32, 64, 128, 256, 512)
ADAMW = OptimConfig(name="adamw", lr=1e-4, warmup_steps=0)


def models() -> dict[str, LlamaConfig]:
    """Big enough that a step is compute, small enough for 2 cores: 4 blocks of width 256."""
    dense = replace(
        get_model_config("llama_tiny"), dim=256, n_heads=8, n_kv_heads=4, ffn_hidden_dim=768, name="llama_cpu"
    )
    moe = get_model_config("moe_tiny")
    moe = replace(moe, dim=256, n_heads=8, n_kv_heads=4, ffn_hidden_dim=768, moe=replace(moe.moe, moe_ffn_dim=256),
                  name="moe_cpu")  # fmt: skip
    return {"llama_cpu": dense, "moe_cpu": moe}


_ = dict
#: (model, layout of Candidate.layout, micro-steps per optimizer step); global batch = dp x batch per rank x acc.
LAYOUTS: list[tuple[str, dict[str, Any], int]] = [
    ("llama_cpu", _(dp=2, zero=0, micro_batch_size=4), 1),
    ("llama_cpu", _(dp=2, zero=1, micro_batch_size=4), 1),
    ("llama_cpu", _(dp=2, zero=3, micro_batch_size=4), 1),
    ("llama_cpu", _(tp=2, zero=0, micro_batch_size=8), 1),
    ("llama_cpu", _(pp=2, zero=0, schedule="1f1b", microbatches=4, micro_batch_size=2), 1),
    ("llama_cpu", _(pp=2, zero=0, schedule="zbv", microbatches=4, micro_batch_size=2), 1),
    ("llama_cpu", _(cp=2, zero=0, cp_method="zigzag_ring", micro_batch_size=8), 1),
    ("moe_cpu", _(dp=2, zero=1, ep=2, micro_batch_size=4), 1),
    ("llama_cpu", _(dp=2, zero=1, micro_batch_size=4), 2),
    ("llama_cpu", _(dp=2, zero=1, micro_batch_size=4, recompute="full"), 1),
    ("llama_cpu", _(dp=2, zero=2, micro_batch_size=4, recompute="selective_op"), 1),
]
#: Context parallelism at a second sequence length (and the all-to-all at both): where a ring's K/V traffic
#: outgrows the attention it overlaps (short sequences, many of them), ``(model, layout, accumulation, seq_len)``.
CONTEXT_LAYOUTS: list[tuple[str, dict[str, Any], int, int]] = [
    ("llama_cpu", _(cp=2, zero=0, cp_method="zigzag_ring", micro_batch_size=32), 1, 64),
    ("llama_cpu", _(cp=2, zero=0, cp_method="all_to_all", micro_batch_size=8), 1, SEQ_LEN),
    ("llama_cpu", _(cp=2, zero=0, cp_method="all_to_all", micro_batch_size=32), 1, 64),
]


# ----------------------------------------------------------------------------- 1. the profile
def _timed(fn: Any, repeat: int = 5) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _compute_rates() -> dict[str, float]:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    peak = 2 * 1024**3 / _timed(lambda: a @ b)
    widths = {}
    for w in GEMM_WIDTHS:  # 2048 rows (a micro batch's tokens) times a w x w weight
        x, y = torch.randn(2048, w), torch.randn(w, w)
        widths[f"gemm_{w}"] = 2 * 2048 * w * w / _timed(lambda x=x, y=y: x @ y) / peak
    x, y = torch.randn(2**24), torch.empty(2**24)
    bandwidth = 2 * x.nbytes / _timed(lambda: torch.add(x, 1.0, out=y))  # read x, write y
    leaf = torch.randn(16, requires_grad=True)
    overhead = _timed(lambda: _chain(leaf)) / 400
    q, k, v = (torch.randn(2, 8, 256, 32, requires_grad=True) for _ in range(3))

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = 3.5 * 2 * (2 * 256 * 256 / 2) * 8 * (32 + 32)  # as the planner counts it
    return {"peak": peak, "bandwidth": bandwidth, "overhead": overhead,
            "attention_efficiency": flops / _timed(attention) / peak, **widths}  # fmt: skip


def _chain(leaf: torch.Tensor) -> None:
    """100 multiply-adds forward (200 ops) and their backward (about as many)."""
    h = leaf
    for _ in range(100):
        h = h * 1.0001 + 0.0001
    h.sum().backward()


def _gloo_rates() -> dict[str, float]:
    big, small = torch.randn(2**22), torch.randn(1)
    dist.all_reduce(big)
    seconds = _timed(lambda: dist.all_reduce(big))
    latency = _timed(lambda: dist.all_reduce(small), repeat=50)
    return {"link": wire_bytes("all_reduce", big.nbytes, 2) / max(seconds - latency, 1e-9), "latency": latency}


def profile_worker() -> dict[str, float]:
    rates = _compute_rates()  # both processes at once: they share the memory bus, as the runs do
    dist.barrier()
    return rates | _gloo_rates()


def cpu_profile(runs: list[list[dict[str, float]]]) -> Hardware:
    """The ``cpu`` profile's rates: each figure the slower rank's (the ranks run side by side), the best run's."""
    low = {k: max(min(r[k] for r in rates) for rates in runs) for k in runs[0][0]}
    high = {k: min(max(r[k] for r in rates) for rates in runs) for k in runs[0][0]}
    return Hardware(
        "cpu", peak_flops=low["peak"], fp32_flops=low["peak"], memory_bytes=24 * 2**30, gpus_per_node=2,
        intra_node_bandwidth=low["link"], inter_node_bandwidth=low["link"], collective_base_latency=high["latency"],
        intra_node_latency=0.0, inter_node_latency=0.0, link_efficiency=1.0, network_efficiency=1.0,
        matmul_efficiency=1.0,
        memory_bandwidth=low["bandwidth"], memory_efficiency=1.0,
        attention_efficiency=min(1.0, low["attention_efficiency"]), op_overhead=high["overhead"], reserved_bytes=0,
        gemm_width_factors=tuple((w, min(1.0, low[f"gemm_{w}"])) for w in GEMM_WIDTHS),
    )  # fmt: skip


def tiny_models() -> dict[str, LlamaConfig]:
    """Models whose compute is nil (width 8, 8 tokens): their step time is host time alone."""
    small = {"dim": 8, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden_dim": 8}
    moe = get_model_config("moe_tiny")
    return {
        "tiny": replace(get_model_config("llama_tiny"), **small, n_layers=1, name="tiny"),
        "tiny4": replace(get_model_config("llama_tiny"), **small, n_layers=4, name="tiny4"),
        "tiny_moe": replace(moe, **small, n_layers=2, moe=replace(moe.moe, moe_ffn_dim=8), name="tiny_moe"),
    }


#: (technique, tiny model, its layout, the layout it is compared with, blocks x forwards a rank
#: runs in it): the host time per block and forward a technique adds, from nil-compute models
#: (an MoE model's one MoE block for "expert"; a pipeline's 2 blocks per rank x 4 microbatches).
HOST_PROBES: list[tuple[str, str, dict[str, Any], dict[str, Any], int]] = [
    ("tensor", "tiny", _(tp=2, zero=0), _(dp=2, zero=0), 1),
    ("fsdp", "tiny", _(dp=2, zero=3), _(dp=2, zero=0), 1),
    ("context", "tiny", _(cp=2, zero=0), _(dp=2, zero=0), 1),
    ("selective_op", "tiny", _(dp=2, zero=0, recompute="selective_op"), _(dp=2, zero=0), 1),
    ("expert", "tiny_moe", _(dp=2, zero=0, ep=2), _(dp=2, zero=0), 1),
    *(
        (f"pipeline_{s}", "tiny4", _(pp=2, zero=0, schedule=s, microbatches=4), _(dp=2, zero=0, micro_batch_size=2), 8)
        for s in ("1f1b", "interleaved_1f1b", "zbv")
    ),
]


def host_worker(model: str, layout: dict[str, Any], steps: int = 20) -> float:
    """Seconds per step of a nil-compute model: the loop's and the layout's host time."""
    clock, candidate = StepClock(), Candidate.layout(**layout)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=candidate.strategy(), max_steps=steps, callbacks=[clock],
                        **QUIET_TRAINER)  # fmt: skip
    module = LlamaModule(tiny_models()[model], optim=ADAMW)
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=8, micro_batch_size=candidate.batch_per_rank))
    return statistics.median(b - a for a, b in zip(clock.stamps[WARMUP:], clock.stamps[WARMUP + 1 :]))


def host_times(gpu: Hardware, runs: int = RUNS, steps: int = 20, probes: list[Any] = HOST_PROBES) -> Hardware:
    """``gpu`` with its ``step_overhead`` and ``host_overheads``: what the tiny runs take beyond what
    the planner already prices on ``gpu`` (their collectives' latency, their few ops)."""

    def excess(model: str, layout: dict[str, Any], on: Hardware) -> float:
        measured = min(max(run_workers(host_worker, 2, model, layout, steps, timeout_s=300)) for _ in range(runs))
        return measured - _predict(tiny_models()[model], layout, 1, on, seq_len=8)

    gpu = replace(gpu, step_overhead=max(0.0, excess("tiny", _(dp=2, zero=0), gpu)))
    bases: dict[str, float] = {}
    overheads = []
    for technique, model, layout, base, units in probes:
        if model not in bases:
            bases[model] = excess(model, base, gpu)
        overheads.append((technique, max(0.0, excess(model, layout, gpu) - bases[model]) / units))
    return replace(gpu, host_overheads=tuple(overheads))


# ----------------------------------------------------------------------------- 2. the runs
class StepClock(L.Callback):
    """Wall time at every optimizer step, and (an MoE model) that step's global tokens per expert."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.loads: list[torch.Tensor] = []
        self._step = -1

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.stamps.append(time.perf_counter())
            if getattr(module, "expert_stats", None) is not None:
                self.loads.append(module.expert_stats.loads.clone())


def run_worker(
    model: str, layout: dict[str, Any], accumulation: int, steps: int = STEPS, seq_len: int = SEQ_LEN
) -> tuple[float, float]:
    """The median step time after the warm-up, and the timed steps' mean :func:`expert_load` (1.0 dense)."""
    candidate = Candidate.layout(**layout)
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=candidate.strategy(), max_steps=steps,
        accumulate_grad_batches=accumulation, callbacks=[clock], **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=seq_len, micro_batch_size=candidate.batch_per_rank)
    trainer.fit(LlamaModule(models()[model], optim=ADAMW), datamodule=data)
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])][WARMUP:]
    # the routing of the timed steps (loads[i] is step i's, the step that ends at stamps[i])
    loads = [expert_load(x, candidate.ep) for x in clock.loads[WARMUP + 1 :]] if candidate.ep > 1 else [1.0]
    return statistics.median(steps), statistics.mean(loads)


# ----------------------------------------------------------------------------- 3. predictions
def predict(
    model: str, layout: dict[str, Any], accumulation: int, gpu: Hardware, load: float = 1.0, seq_len: int = SEQ_LEN
) -> float:
    return _predict(models()[model], layout, accumulation, gpu, seq_len, load)


def _predict(
    cfg: LlamaConfig, layout: dict[str, Any], accumulation: int, gpu: Hardware, seq_len: int = SEQ_LEN,
    load: float = 1.0,
) -> float:  # fmt: skip
    candidate = Candidate.layout(**layout)
    global_batch = candidate.batch_per_rank * candidate.dp * accumulation
    workload = Workload(cfg, seq_len, global_batch, precision="32-true", expert_load=load)
    costs = estimate(workload, candidate, build_model(cfg, device="meta"), gpu)
    return max(c.step_time for c in costs)


def label(layout: dict[str, Any], accumulation: int) -> str:
    return Candidate.layout(**layout).label() + (f" acc{accumulation}" if accumulation > 1 else "")


def measure(
    layouts: list[tuple[str, dict[str, Any], int]], runs: int = RUNS, steps: int = STEPS, seq_len: int = SEQ_LEN
) -> list[tuple[float, float]]:
    """(step time, expert load) of each layout: the faster of :data:`RUNS` passes over all of them.

    A pass's step time is the slower rank's; the loads are global (the same on every rank).
    """
    passes = []
    for n in range(runs):
        passes.append([])
        for model, layout, acc in layouts:
            ranks = run_workers(run_worker, 2, model, layout, acc, steps, seq_len, timeout_s=600)
            passes[-1].append((max(r[0] for r in ranks), ranks[0][1]))
            print(f"  pass {n + 1}: {model} {label(layout, acc)} {passes[-1][-1][0]:.3f} s", flush=True)
    return [min(runs) for runs in zip(*passes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="one layout at seq 32, one host probe, 2 timed steps (smoke test)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    # A smoke test: one layout and the fsdp probe (its base is the loop's own), one short pass.
    layouts, probes = (LAYOUTS[:1], HOST_PROBES[1:2]) if args.quick else (LAYOUTS, HOST_PROBES)
    runs, host_steps, steps, seq_len = (1, WARMUP + 2, WARMUP + 2, 32) if args.quick else (RUNS, 20, STEPS, SEQ_LEN)
    gpu = host_times(
        cpu_profile([run_workers(profile_worker, 2, timeout_s=300) for _ in range(runs)]), runs, host_steps, probes
    )
    print(f"cpu profile: {gpu.peak_flops / 1e9:.1f} GFLOP/s, {gpu.memory_bandwidth / 1e9:.1f} GB/s, "
          f"{gpu.op_overhead * 1e6:.1f} us/op, loop {gpu.step_overhead * 1e3:.1f} ms/step, "
          f"attention {gpu.attention_efficiency:.2f}, host ms per block: "
          f"{', '.join(f'{k} {v * 1e3:.2f}' for k, v in gpu.host_overheads)}, gloo "
          f"{gpu.intra_node_bandwidth / 1e9:.2f} GB/s + {gpu.collective_base_latency * 1e6:.0f} us/call")  # fmt: skip
    print(f"{'layout':<58} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    rows = []
    runs_at = [(layouts, seq_len)] + ([] if args.quick else [([c[:3]], c[3]) for c in CONTEXT_LAYOUTS])
    for group, seq in runs_at:
        for (model, layout, acc), (measured, load) in zip(group, measure(group, runs, steps, seq)):
            predicted = predict(model, layout, acc, gpu, load, seq)
            name = label(layout, acc) + (f" seq{seq}" if seq != SEQ_LEN else "")
            rows.append({"model": model, "layout": layout, "accumulation": acc, "seq_len": seq, "label": name,
                         "expert_load": load, "measured_s": measured, "predicted_s": predicted,
                         "error": predicted / measured - 1})  # fmt: skip
            print(f"{model + ' ' + name:<58} {measured:>10.3f} {predicted:>11.3f} {rows[-1]['error']:>+7.1%}")
    errors = [abs(r["error"]) for r in rows]
    summary = {"layouts": len(rows), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors)}
    print(f"\nmedian |error| {summary['median_abs_error']:.1%}, worst {summary['max_abs_error']:.1%}")
    payload = {"benchmark": "cpu_time_model", "quick": args.quick, "profile": asdict(gpu), "rows": rows,
               "summary": summary}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
