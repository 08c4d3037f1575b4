"""Compiled transformer blocks (``parallel.compile=true``): speed against eager, and parity in every layout.

Prints three tables and writes ``benchmarks/results/compile.json``:

1. Tokens/s of inductor-compiled blocks against eager ones, on ``llama_tiny`` and ``llama_small``,
   one process and ZeRO-3 over 2 processes, as alternated pairs (``testing.timing.Alternation``):
   the median of the paired ratios compiled / eager with its 95% bootstrap interval. Each run is a
   fresh process: it traces again and loads the compiled code from inductor's cache (the first run
   builds it); the warm-up steps it leaves out hold the compile. Compile seconds and graphs come
   from ``Compile.stats``.
2. Where an eager and a compiled step's time goes, on one process (``torch.profiler``): the GEMMs and
   the attention kernels, which compiling does not change, and the rest (the element-wise work that
   inductor fuses, and eager mode's per-op overhead), as the step's wall time minus those two.
3. Every layout of ``lightning_ultrascale.testing.layouts`` trained 3 SGD steps with inductor-compiled
   blocks against one eager process: the worst relative error of the losses, the gradients of every
   step and the final parameters, and the graphs each region kind compiled (one each: a block
   compiled once, reused by every block and step). (The suite trains the same matrix through ``aot_eager``, and
   through inductor the layouts whose graphs differ most, at 1e-5.)

    python benchmarks/compile.py            # full run (~25 minutes on 2 CPU cores)
    python benchmarks/compile.py --quick    # a smoke run for the test suite: 2 layouts through aot_eager, no speed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)

from lightning_ultrascale import Compile, LlamaModule, OptimConfig, UltraScaleDataModule, UltraScaleStrategy, ZeRO  # noqa: E402
from lightning_ultrascale.models import build_model  # noqa: E402
from lightning_ultrascale.testing import run_workers  # noqa: E402
from lightning_ultrascale.testing.layouts import LAYOUTS  # noqa: E402
from lightning_ultrascale.testing.parity import RunRecord, record_run, relative_error  # noqa: E402
from lightning_ultrascale.testing.timing import Alternation, fit_tokens_per_s  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "compile.json"
SGD = OptimConfig(name="sgd", lr=0.1, weight_decay=0.0, warmup_steps=0, min_lr_ratio=1.0)
#: model -> (sequence length, micro-batch): llama_small's steps take about 0.2 s on one core.
SHAPES = {"llama_tiny": (256, 8), "llama_small": (128, 4)}
COMPILE_STATS: dict[str, list[dict[str, Any]]] = {}


def speed_worker(model: str, world: int, compiled: bool, steps: int) -> tuple[float, float, int]:
    """Tokens/s of one run, the seconds its backend compiled and the graphs it compiled."""
    seq_len, micro = SHAPES[model]
    compile_plugin = Compile() if compiled else Compile(enabled=False)
    plugins = [ZeRO(stage=3)] if world > 1 else []
    strategy = UltraScaleStrategy(*plugins, compile_plugin)
    tokens = fit_tokens_per_s(LlamaModule(model, optim=SGD), strategy, devices=world, steps=steps, seq_len=seq_len,
                              micro_batch=micro, data_ranks=world)  # fmt: skip
    return tokens, compile_plugin.stats.seconds, compile_plugin.stats.total


def _measure(model: str, world: int, compiled: bool, steps: int, key: str) -> float:
    tokens, seconds, graphs = run_workers(speed_worker, world, model, world, compiled, steps, timeout_s=600)[0]
    if compiled:
        COMPILE_STATS.setdefault(key, []).append({"seconds": seconds, "graphs": graphs})
    return tokens


def _speed(steps: int, max_seconds: float) -> list[dict[str, Any]]:
    rows = []
    for model in SHAPES:
        for world in (1, 2):
            key = f"{model} {'one process' if world == 1 else 'zero3 dp2'}"
            arms = {
                kind: partial(_measure, model, world, kind == "compiled", steps, key) for kind in ("eager", "compiled")
            }
            alternation = Alternation(arms, baseline="eager", min_rounds=8, max_rounds=30, max_seconds=max_seconds)
            ratio = alternation.run()["compiled"]
            stats = COMPILE_STATS[key]
            rows.append({
                "model": model, "layout": key.split(" ", 1)[1], "world_size": world, "steps_per_run": steps,
                "tokens_per_step": world * SHAPES[model][0] * SHAPES[model][1],
                "eager_tokens_per_s": statistics.median(alternation.samples["eager"]),
                "compiled_tokens_per_s": statistics.median(alternation.samples["compiled"]),
                "paired_ratio": ratio.as_dict(),
                "first_compile_s": stats[0]["seconds"],
                "cached_compile_s": statistics.median(s["seconds"] for s in stats[1:]) if len(stats) > 1 else None,
                "graphs_per_run": sorted({s["graphs"] for s in stats}),
            })  # fmt: skip
    return rows


GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})


def _step_fn(model: str, compiled: bool) -> Any:
    seq_len, micro = SHAPES[model]
    net = build_model(model, seed=0)
    if compiled:
        Compile().apply(net)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, net.config.vocab_size, (micro, seq_len), generator=gen) for _ in range(2))

    def step() -> None:
        net.zero_grad(set_to_none=True)
        net(tokens, labels=labels).backward()

    for _ in range(3):  # warm-up: the compile
        step()
    return step


def _kernel_ms(step: Any, steps: int = 5) -> tuple[float, float]:
    """Milliseconds per step in GEMMs and in attention kernels (their own time, forward and backward)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    attention = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
    return gemm / 1e3 / steps, attention / 1e3 / steps


def _profile(model: str, rounds: int = 10, steps: int = 5) -> dict[str, Any]:
    """An eager and a compiled step of ``model`` on one process: wall time (alternated rounds), GEMMs, attention."""
    fns = {kind: _step_fn(model, kind == "compiled") for kind in ("eager", "compiled")}
    walls: dict[str, list[float]] = {kind: [] for kind in fns}
    for _ in range(rounds):
        for kind, step in fns.items():
            began = time.perf_counter()
            for _ in range(steps):
                step()
            walls[kind].append((time.perf_counter() - began) * 1e3 / steps)
    row: dict[str, Any] = {"model": model, "tokens_per_step": SHAPES[model][0] * SHAPES[model][1]}
    for kind, step in fns.items():
        wall = statistics.median(walls[kind])
        gemm, attention = _kernel_ms(step)
        row[kind] = {"step_ms": wall, "gemm_ms": gemm, "attention_ms": attention, "other_ms": wall - gemm - attention}
    return row


def _profiled(model: str, **kwargs: Any) -> dict[str, Any]:
    # In a process of its own: this one forks every other run, and a process that compiled hands its
    # dynamo caches and inductor's compile workers to the processes it forks.
    return run_workers(_profile, 1, model, timeout_s=600, **kwargs)[0]


def _run(name: str, backend: str | None, steps: int) -> RunRecord:
    layout = LAYOUTS[name]
    seq_len, micro = 64, 8 // layout.dp
    plugins = [*layout.plugins(), Compile(backend=backend)] if backend else None
    return record_run(
        lambda: LlamaModule(layout.model, optim=SGD),
        lambda: UltraScaleDataModule(seq_len=seq_len, micro_batch_size=micro, seed=0),
        steps=steps,
        strategy=(lambda: UltraScaleStrategy(*plugins)) if plugins is not None else None,
        world_size=layout.world_size,
        timeout_s=600,
    )


def _parity(names: list[str], backend: str, steps: int) -> list[dict[str, Any]]:
    references = {
        model: _run(name, None, steps)
        for name, model in (("one-process", "llama_tiny"), ("moe-one-process", "moe_tiny"))
    }
    rows = []
    for name in names:
        began = time.perf_counter()
        run, ref = _run(name, backend, steps), references[LAYOUTS[name].model]
        grads = [relative_error(g[n], r[n]) for g, r in zip(run.grads, ref.grads) for n in r]
        rows.append({
            "layout": name, "backend": backend, "world_size": LAYOUTS[name].world_size, "steps": steps,
            "loss_error": max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses)),
            "grad_error": max(grads),
            "param_error": max(relative_error(run.params[n], ref.params[n]) for n in ref.params),
            "graphs": run.compiled_graphs,
            "seconds": time.perf_counter() - began,
        })  # fmt: skip
        print(f"  {name}: {rows[-1]['grad_error']:.1e} ({rows[-1]['seconds']:.0f} s)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 layouts through aot_eager, 2 steps, no speed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    if args.quick:
        parity = _parity(["one-process", "tp2-sp"], "aot_eager", 2)
        speed: Any = "not measured (--quick: cold compiles take most of a minute on CPU)"
        profile = [_profiled("llama_tiny", rounds=1, steps=1)]
    else:
        parity = _parity(list(LAYOUTS), "inductor", 3)
        profile = [_profiled(model) for model in SHAPES]
        speed = _speed(steps=12, max_seconds=240)

    print(f"\nCompiled blocks against one eager process ({parity[0]['backend']}, {parity[0]['steps']} SGD steps)")
    print(f"{'layout':<30} {'ranks':>5} {'loss':>8} {'grads':>8} {'params':>8} {'graphs':>6} {'seconds':>8}")
    for r in parity:
        graphs = "+".join(str(n) for n in r["graphs"].values())
        print(f"{r['layout']:<30} {r['world_size']:>5} {r['loss_error']:>8.1e} {r['grad_error']:>8.1e} "
              f"{r['param_error']:>8.1e} {graphs:>6} {r['seconds']:>8.0f}")  # fmt: skip
    print("\nWhere a step's time goes, one process (ms per step; other = wall - GEMMs - attention)")
    print(f"{'model':<12} {'':<9} {'step':>7} {'GEMMs':>7} {'attention':>9} {'other':>7}")
    for r in profile:
        for kind in ("eager", "compiled"):
            t = r[kind]
            figures = f"{t['step_ms']:>7.1f} {t['gemm_ms']:>7.1f} {t['attention_ms']:>9.1f} {t['other_ms']:>7.1f}"
            print(f"{r['model']:<12} {kind:<9} {figures}")
    if isinstance(speed, str):
        print(f"\nSpeed: {speed}")
    else:
        print("\nTokens/s, inductor-compiled blocks / eager (alternated pairs, fresh processes)")
        head = ("model", "layout", "eager", "compiled", "ratio", "95% CI", "pairs", "compile s")
        print("{:<12} {:<12} {:>9} {:>9} {:>6} {:>13} {:>5} {:>9}".format(*head))
        for r in speed:
            p = r["paired_ratio"]
            ci = f"{p['ci_low']:.3f}-{p['ci_high']:.3f}"
            print(
                f"{r['model']:<12} {r['layout']:<12} {r['eager_tokens_per_s']:>9,.0f} "
                f"{r['compiled_tokens_per_s']:>9,.0f} {p['median']:>6.3f} {ci:>13} {p['pairs']:>5} "
                f"{r['first_compile_s']:>9.1f}"
            )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "compile",
        "quick": args.quick,
        "device": "cpu",
        "parity": parity,
        "profile": profile,
        "speed": speed,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
