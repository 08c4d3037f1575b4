"""Fused kernels on CPU: numerics of every fast path, the fused loss's peak memory, compile's speed.

Prints tables and writes ``benchmarks/results/kernels.json``:

1. Numerics: each op of each kernel set against the pure-torch reference, forward and backward,
   fp32 and bf16, on awkward shapes (largest element error over the reference's largest value).
   Triton kernels (ours, Liger's) run in Triton's interpreter here (``TRITON_INTERPRET=1``, set
   by this script when there is no GPU); Liger's RMSNorm and SwiGLU do not run in it.
2. Linear cross-entropy peak memory (``peak_bytes``: torch's ``MemTracker``, forward + backward) with the logits
   materialised against our chunked fused loss, at head shapes of a small and a Llama-3-vocabulary
   model. The bar: lower by at least the fp32 logits' bytes.
3. CPU time of the reference ops eager against ``torch.compile``, forward + backward, in alternated
   rounds (``testing.timing.Alternation``; each arm the median of 5 calls a round): the speed-up is
   the median of the rounds' paired ratios with its 95% bootstrap interval. Triton and Liger kernels'
   speed needs a GPU: not measured (the issue's goal there: >= 1.5x eager).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

from torch import Tensor

from lightning_ultrascale.kernels import fused_linear_cross_entropy, get_kernels, reference
from lightning_ultrascale.testing.timing import Alternation
from lightning_ultrascale.utils.memory import peak_bytes

RESULTS = Path(__file__).parent / "results" / "kernels.json"
SETS = ("compile", "triton", "liger")
UNINTERPRETABLE = {("liger", "rms_norm"), ("liger", "swiglu")}


def _inputs(op: str, scale: int) -> tuple[list[Tensor], dict[str, Any]]:
    """Awkward shapes (odd hidden sizes, strided views); ``scale`` grows them for timing."""
    if op == "rms_norm":
        return [torch.randn(4 * scale, 5, 129 * scale), 1 + 0.1 * torch.randn(129 * scale)], {}
    if op == "swiglu":
        return [torch.randn(4 * scale, 7, 133 * scale), torch.randn(4 * scale, 7, 133 * scale)], {}
    q = torch.randn(2 * scale, 13, 4, 34).transpose(1, 2)
    k = torch.randn(2 * scale, 13, 2, 34).transpose(1, 2)
    freqs = torch.randn(2 * scale, 13, 17)
    angles = torch.cat((freqs, freqs), -1)[:, None]
    return [q, k], {"cos": angles.cos(), "sin": angles.sin()}


def _call(kernels: Any, op: str, xs: list[Tensor], extra: dict[str, Any]) -> tuple[Tensor, ...]:
    if op == "rms_norm":
        return (kernels.rms_norm(xs[0], xs[1], 1e-5),)
    if op == "swiglu":
        return (kernels.swiglu(xs[0], xs[1]),)
    return tuple(kernels.rope(xs[0], xs[1], extra["cos"], extra["sin"]))


def _run(kernels: Any, op: str, inputs: list[Tensor], extra: dict[str, Any], dtype: torch.dtype) -> list[Tensor]:
    """Outputs and input gradients (fixed incoming gradients) of one op."""
    xs = [x.detach().to(dtype).clone().requires_grad_() for x in inputs]
    out = _call(kernels, op, xs, extra)
    torch.manual_seed(1)  # the same incoming gradients, whatever each path's output strides
    torch.autograd.backward(out, [torch.randn(o.shape, dtype=o.dtype) for o in out])
    return [o.detach() for o in out] + [x.grad for x in xs if x.grad is not None]


def _error(x: Tensor, ref: Tensor) -> float:
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def measure_numerics(sets: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    ref_kernels = get_kernels("reference")
    for op in ("rms_norm", "swiglu", "rope"):
        torch.manual_seed(0)
        inputs, extra = _inputs(op, 1)
        for dtype in (torch.float32, torch.bfloat16):
            ref = _run(ref_kernels, op, inputs, extra, dtype)
            for name in sets:
                row: dict[str, Any] = {"op": op, "kernels": name, "dtype": str(dtype).removeprefix("torch.")}
                if (name, op) in UNINTERPRETABLE and not torch.cuda.is_available():
                    row["max_error"] = None  # not run: needs a GPU
                else:
                    got = _run(get_kernels(name), op, inputs, extra, dtype)
                    row["max_error"] = max(_error(g, r) for g, r in zip(got, ref))
                rows.append(row)
    return rows


def _peak(loss_fn: Callable[[Tensor, Tensor, Tensor], Tensor], tokens: int, dim: int, vocab: int) -> int:
    torch.manual_seed(0)
    h = torch.randn(tokens, dim, requires_grad=True)
    weight = (torch.randn(vocab, dim) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    return peak_bytes(lambda: loss_fn(h, weight, labels).backward(), h, weight)


def measure_loss_memory(shapes: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    rows = []
    for tokens, dim, vocab in shapes:
        materialised = _peak(reference.linear_cross_entropy, tokens, dim, vocab)
        fused = _peak(fused_linear_cross_entropy, tokens, dim, vocab)
        logits = tokens * vocab * 4
        rows.append(
            {
                "tokens": tokens,
                "dim": dim,
                "vocab": vocab,
                "logits_bytes": logits,
                "materialised_peak_bytes": materialised,
                "fused_peak_bytes": fused,
                "saved_over_logits": (materialised - fused) / logits,
            }
        )
    return rows


def _calls_per_s(fn: Callable[[], Any], repeats: int) -> Callable[[], float]:
    """A measurement for :class:`Alternation`: the median time of ``repeats`` calls of ``fn``, as calls per second."""

    def measure() -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1.0 / statistics.median(times)

    return measure


def measure_cpu_speed(scale: int, repeats: int) -> list[dict[str, Any]]:
    """Each op eager against compiled, in alternated rounds (each a median of ``repeats`` calls per arm)."""
    rows = []
    sets = {"eager": get_kernels("reference"), "compile": get_kernels("compile")}
    for op in ("rms_norm", "swiglu", "rope"):
        inputs, extra = _inputs(op, scale)
        calls = {name: partial(_run, kernels, op, inputs, extra, torch.float32) for name, kernels in sets.items()}
        for call in calls.values():
            call()  # warm-up (compilation)
        arms = {name: _calls_per_s(call, repeats) for name, call in calls.items()}
        alternation = Alternation(arms, baseline="eager", max_rounds=30, log=None)
        speedup = alternation.run()["compile"]
        eager_s, compile_s = (1.0 / statistics.median(alternation.samples[k]) for k in ("eager", "compile"))
        rows.append({
            "op": op, "elements": inputs[0].numel(), "eager_s": eager_s, "compile_s": compile_s,
            "speedup": speedup.as_dict(),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, no torch.compile (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = [(256, 64, 4000)] if args.quick else [(2048, 256, 32000), (2048, 512, 128256)]
    # --quick leaves out torch.compile, whose cold compiles take most of a minute on CPU.
    sets = tuple(s for s in SETS if s != "compile") if args.quick else SETS

    numerics = measure_numerics(sets)
    print("\nFast path vs reference, forward + backward (largest error / largest reference value)")
    print(f"{'op':<10}{'dtype':<10}" + "".join(f"{name:>12}" for name in sets))
    for i in range(0, len(numerics), len(sets)):
        group = numerics[i : i + len(sets)]
        cells = "".join(f"{'GPU only' if r['max_error'] is None else format(r['max_error'], '.1e'):>12}" for r in group)
        print(f"{group[0]['op']:<10}{group[0]['dtype']:<10}{cells}")

    memory = measure_loss_memory(shapes)
    print("\nLinear cross-entropy, peak memory of forward + backward (MemTracker)")
    print(f"{'tokens x dim x vocab':<24}{'logits':>12}{'materialised':>14}{'fused':>12}{'saved/logits':>14}")
    for r in memory:
        shape = f"{r['tokens']} x {r['dim']} x {r['vocab']}"
        print(
            f"{shape:<24}{r['logits_bytes'] / 2**20:>10.0f}MB{r['materialised_peak_bytes'] / 2**20:>12.0f}MB"
            f"{r['fused_peak_bytes'] / 2**20:>10.0f}MB{r['saved_over_logits']:>13.2f}x"
        )

    speed = [] if args.quick else measure_cpu_speed(scale=16, repeats=5)
    title = "\nCPU time, forward + backward, fp32, one thread (alternated rounds, median of paired ratios)"
    print(title + (": not run with --quick" if args.quick else ""))
    if speed:
        print(f"{'op':<10}{'elements':>10}{'eager ms':>10}{'compile ms':>12}{'speed-up':>10}{'95% interval':>15}")
    for r in speed:
        up = r["speedup"]
        print(
            f"{r['op']:<10}{r['elements']:>10}{r['eager_s'] * 1e3:>10.2f}{r['compile_s'] * 1e3:>12.2f}"
            f"{up['median']:>9.2f}x{up['ci_low']:>9.2f}-{up['ci_high']:.2f} ({up['pairs']} rounds)"
        )
    print("\nGPU speed of triton and liger kernels vs eager: not measured (no GPU)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "kernels",
        "torch": torch.__version__,
        "numerics": numerics,
        "loss_memory": memory,
        "cpu_speed": speed,
        "gpu": "not measured",
    }
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
