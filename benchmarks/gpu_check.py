"""One-shot GPU check: the GPU tier and the figures a first GPU run owes, each section in its own process.

    python benchmarks/gpu_check.py                     # all sections; writes benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --sections step,moe --out /tmp/gpu_check.json

=========  ===================================================================================  =======
section    what it runs and measures                                                            timeout
=========  ===================================================================================  =======
gpu_tier   ``pytest -m gpu`` from the repository root: passed / failed / skipped                 180 s
cp_block   the context-parallel block kernel, forward + backward, against SDPA at 8k and 32k     60 s
           tokens (bf16, causal, 32 query heads on 8 kv heads): ms, TFLOP/s, relative errors
ring       ring attention (zig-zag) on a one-rank NCCL group at 8k tokens against the block      40 s
triton     our Triton RMSNorm, SwiGLU and RoPE against eager at Llama 3 8B sizes, fwd + bwd       40 s
fp8        blockwise FP8 against bf16 at 8192^3: the GEMM alone, and the linear with its          40 s
           quantisation, forward + backward (compute capability 9.x)
moe        the bf16 grouped GEMM of 8 experts against the per-expert loop, forward + backward    30 s
step       one bf16 training step of llama3_1b (4 x 2048 tokens): ms, MFU against 989 TFLOP/s,   80 s
           peak memory, against the planner's prediction for an H100
=========  ===================================================================================  =======

Each section runs in a process of its own with its own timeout (they sum to 470 s), so a crash or a
hang loses that section only; the JSON keeps the tail of its output. It needs the GPU machine's image
as it is (torch 2.11, triton, lightning, transformers, pytest) and this checkout, whose root it puts on
the path: the package imports hydra, omegaconf and torchao only where a command needs them, so no
wheel is carried (``tests/e2e/test_gpu_image.py`` runs the script with those three hidden).

Without CUDA every section but the tier runs at small sizes in under a minute (the suite runs them): Triton's
kernels in its interpreter, FP8's tensor-core calls under ``testing.cuda_contracts.emulate_cuda``. Those figures
are CPU smoke checks of the script itself; every GPU figure is "not measured".
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"
PEAK_BF16 = 989e12  # H100 SXM dense bf16


@dataclass(frozen=True)
class Section:
    run: Callable[[bool], dict[str, Any]]
    timeout_s: int
    on_cpu: bool  # whether its small CPU variant runs without CUDA


# ------------------------------------------------------------------------------------ helpers
def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn`` (after one warm-up call), synchronised; once on a CPU (a smoke check)."""
    import torch

    repeats = 5 if torch.cuda.is_available() else 1
    fn()
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def _error(x: Any, ref: Any) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _randn(*shape: int, dtype: Any = None) -> Any:
    import torch

    return torch.randn(*shape, device=_device(), dtype=dtype or torch.bfloat16)


# ------------------------------------------------------------------------------------ sections
def cp_block(cuda: bool) -> dict[str, Any]:
    heads, kv_heads, d = (32, 8, 128) if cuda else (4, 2, 64)
    return {str(seq): _block_against_sdpa(seq, heads, kv_heads, d) for seq in ((8192, 32768) if cuda else (256, 512))}


def _block_against_sdpa(seq: int, heads: int, kv_heads: int, d: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from lightning_ultrascale.parallel.context.attention import KERNELS

    forward, backward = KERNELS["flash"]
    q, k, v = _randn(1, heads, seq, d), _randn(1, kv_heads, seq, d), _randn(1, kv_heads, seq, d)
    dout, scale = _randn(1, heads, seq, d), d**-0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def ours() -> Any:
        out, lse = forward(q, k, v, True, scale)
        return out, backward(q, k, v, out, lse, dout, True, scale)

    def sdpa() -> Any:
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=True)
        return out, torch.autograd.grad(out, leaves, dout)

    (out, grads), (ref, ref_grads) = ours(), sdpa()
    flops = 3.5 * 2 * heads * seq * seq * d  # causal: half of 4 s^2 d per head forward; backward 2.5x
    ms = _ms(ours)
    return {
        "ms": ms, "sdpa_ms": _ms(sdpa), "tflops": round(flops / ms / 1e9, 2),
        "errors": [round(_error(a, b), 5) for a, b in zip((out, *grads), (ref, *ref_grads))],
    }  # fmt: skip


def ring(cuda: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_ultrascale.parallel.context.attention import KERNELS, ring_attention
    from lightning_ultrascale.testing.spawn import free_port

    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        heads, kv_heads, d, seq = (32, 8, 128, 8192) if cuda else (4, 2, 64, 256)
        q, k, v = (_randn(1, n, seq, d).requires_grad_() for n in (heads, kv_heads, kv_heads))
        dout = _randn(1, heads, seq, d)

        def step() -> Any:
            out = ring_attention(q, k, v, dist.group.WORLD, "zigzag_ring")
            out.backward(dout)
            return out

        block, _ = KERNELS["flash"][0](q.detach(), k.detach(), v.detach(), True, d**-0.5)
        return {"backend": dist.get_backend(), "ms": _ms(step), "error": round(_error(step(), block), 5)}
    finally:
        dist.destroy_process_group()


def triton(cuda: bool) -> dict[str, Any]:
    from lightning_ultrascale.kernels import reference, triton_ops

    tokens, dim, hidden, heads = (8192, 4096, 14336, 32) if cuda else (16, 128, 128, 2)  # CPU: the interpreter
    x, w = _randn(tokens, dim).requires_grad_(), _randn(dim).requires_grad_()
    gate, up = _randn(tokens, hidden).requires_grad_(), _randn(tokens, hidden).requires_grad_()
    q, cos, sin = _randn(1, heads, tokens, 128).requires_grad_(), _randn(1, 1, tokens, 128), _randn(1, 1, tokens, 128)
    cases = {
        "rms_norm": (lambda f: f(x, w, 1e-5), triton_ops.rms_norm, reference.rms_norm),
        "swiglu": (lambda f: f(gate, up), triton_ops.swiglu, reference.swiglu),
        "rope": (lambda f: f(q, q, cos, sin)[0], triton_ops.rope, reference.rope),
    }
    return {name: _against_eager(*case) for name, case in cases.items()}


def _against_eager(call: Callable[[Any], Any], fast: Any, ref: Any) -> dict[str, Any]:
    return {
        "ms": _ms(lambda: call(fast).float().sum().backward()),
        "eager_ms": _ms(lambda: call(ref).float().sum().backward()),
        "error": round(_error(call(fast), call(ref)), 5),
    }


def fp8(cuda: bool) -> dict[str, Any]:
    from lightning_ultrascale.testing.cuda_contracts import emulate_cuda

    if cuda:
        return _fp8(8192)
    with emulate_cuda("H100"):  # CPU: the tensor-core path's calls, each checked and computed by a shim
        return _fp8(256)


def _fp8(n: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from lightning_ultrascale.fp8.linear import _mm, blockwise_fp8_linear, quantize_input
    from lightning_ultrascale.kernels.quantize import quantize

    x, w, dy = _randn(n, n), _randn(n, n, dtype=torch.float32) * 0.02, _randn(n, n)
    qx, qw, wb = quantize_input(x)[0], quantize(w, "block"), w.to(torch.bfloat16)
    gemm, gemm_bf16 = _ms(lambda: _mm(qx, qw, False, torch.bfloat16)), _ms(lambda: x @ wb.t())
    xg, wg, wbg = x.clone().requires_grad_(), w.clone().requires_grad_(), wb.clone().requires_grad_()
    linear = _ms(lambda: blockwise_fp8_linear(xg, wg, emulate=False).backward(dy))
    linear_bf16 = _ms(lambda: F.linear(xg, wbg).backward(dy))
    return {
        "gemm_ms": gemm, "gemm_bf16_ms": gemm_bf16, "gemm_tflops": round(2 * n**3 / gemm / 1e9, 1),
        "linear_fwd_bwd_ms": linear, "linear_bf16_fwd_bwd_ms": linear_bf16,
        "error": round(_error(_mm(qx, qw, False, torch.bfloat16), x @ wb.t()), 5),
    }  # fmt: skip


def moe(cuda: bool) -> dict[str, Any]:
    import torch

    from lightning_ultrascale.models.common.moe import GroupedExperts

    experts, tokens, dim, hidden = (8, 16384, 4096, 14336) if cuda else (8, 512, 64, 128)
    layers = [
        GroupedExperts(experts, dim, hidden, kind).to(_device(), torch.bfloat16) for kind in ("grouped_mm", "loop")
    ]
    for p in layers[0].parameters():
        torch.nn.init.normal_(p, std=0.02)
    layers[1].load_state_dict(layers[0].state_dict())
    counts = torch.full((experts,), tokens // experts, device=_device())
    x = _randn(tokens, dim).requires_grad_()
    outs = [layer(x, counts) for layer in layers]
    ms = [_ms(lambda layer=layer: layer(x, counts).float().sum().backward()) for layer in layers]
    flops = 3 * 3 * 2 * tokens * dim * hidden  # three GEMMs, forward and twice that backward
    return {"grouped_ms": ms[0], "loop_ms": ms[1], "grouped_tflops": round(flops / ms[0] / 1e9, 1),
            "error": round(_error(outs[0], outs[1]), 5)}  # fmt: skip


def step(cuda: bool) -> dict[str, Any]:
    import torch

    from lightning_ultrascale.models import build_model, get_model_config
    from lightning_ultrascale.plan import Candidate, Workload, estimate, get_hardware

    name, seq, batch = ("llama3_1b", 2048, 4) if cuda else ("llama_tiny", 64, 2)
    ms, peak = _train_steps(name, seq, batch, steps=4 if cuda else 3)
    tflops = get_model_config(name).flops_per_token(seq) * seq * batch / ms / 1e9
    workload = Workload(get_model_config(name), seq, batch)
    [predicted] = estimate(workload, Candidate.layout(micro_batch_size=batch), build_model(name, device="meta"),
                           get_hardware("h100"))  # fmt: skip
    return {
        "model": name, "tokens": seq * batch, "ms": round(ms, 1), "tflops": round(tflops, 2),
        "mfu": round(tflops * 1e12 / PEAK_BF16, 4) if cuda else "not measured",
        "peak_memory_gib": round(peak / 2**30, 2) if cuda else "not measured",
        "predicted_h100_ms": round(predicted.step_time * 1e3, 3),
        "predicted_h100_memory_gib": round(sum(predicted.memory.values()) / 2**30, 2),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }  # fmt: skip


def _train_steps(name: str, seq: int, batch: int, steps: int) -> tuple[float, int]:
    """Median ms of the steps after the first, and the peak of allocated memory (CUDA)."""
    import lightning as L
    import torch

    from lightning_ultrascale import LlamaModule, UltraScaleDataModule, UltraScaleStrategy
    from lightning_ultrascale.testing.parity import QUIET_TRAINER

    times: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            _sync()
            times.append(time.perf_counter())

    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1, strategy=UltraScaleStrategy(),
        precision="bf16-mixed", max_steps=steps, callbacks=[Clock()], **QUIET_TRAINER,
    )  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    data = UltraScaleDataModule(seq_len=seq, micro_batch_size=batch)
    trainer.fit(LlamaModule(name, kernels="reference"), datamodule=data)
    _sync()
    times.append(time.perf_counter())
    ms = statistics.median(b - a for a, b in itertools.pairwise(times[1:])) * 1e3
    return ms, torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def gpu_tier(cuda: bool) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rfE", "--tb=short"]
    if importlib.util.find_spec("pytest_timeout"):  # a hung test fails alone, with every thread's stack
        command += ["--timeout=60", "--timeout-method=thread"]
    try:
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=170)
        stdout, returncode = run.stdout, run.returncode
    except subprocess.TimeoutExpired as timeout:  # keep what it printed: the last test named is the one that hung
        stdout, returncode = _text(timeout.stdout) + "\n[timed out after 170 s]", -9
    counts = {}
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    for part in last.strip("= ").split(", "):
        number, _, what = part.partition(" ")
        if number.isdigit():
            counts[what.split(" ")[0]] = int(number)
    failures = [line for line in stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    out: dict[str, Any] = {"returncode": returncode, "counts": counts, "failures": failures[:20]}
    if returncode != 0:  # the tracebacks, for whoever fixes it without the GPU
        out["tail"] = stdout[-12000:]
    return out


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


SECTIONS = {
    "gpu_tier": Section(gpu_tier, 180, on_cpu=False),
    "cp_block": Section(cp_block, 60, on_cpu=True),
    "ring": Section(ring, 40, on_cpu=True),
    "triton": Section(triton, 40, on_cpu=True),
    "fp8": Section(fp8, 40, on_cpu=True),
    "moe": Section(moe, 30, on_cpu=True),
    "step": Section(step, 80, on_cpu=True),
}


# ------------------------------------------------------------------------------------ driver
def _run_section(name: str, result_path: str) -> None:
    """Inside the section's own process: run it, write its figures as JSON."""
    import torch

    cuda = torch.cuda.is_available()
    if name == "fp8" and cuda and torch.cuda.get_device_capability()[0] != 9:
        out: dict[str, Any] = {"status": "not measured", "why": "blockwise FP8 GEMMs need compute capability 9.x"}
    else:
        out = {"status": "ok", "results": SECTIONS[name].run(cuda)}
    Path(result_path).write_text(json.dumps(out))


#: Each section runs in a process forked from a server that imported torch and the package once (a fresh
#: interpreter per section paid those imports again); the server never touches CUDA, so its children may.
_PROCESSES = mp.get_context("forkserver")
_PROCESSES.set_forkserver_preload(["torch", "lightning", "lightning_ultrascale"])


def _section_process(name: str, result_path: str, output_path: str) -> None:
    with open(output_path, "w") as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
        _run_section(name, result_path)


def _section(name: str, cuda: bool) -> dict[str, Any]:
    section = SECTIONS[name]
    if not cuda and not section.on_cpu:
        return {"status": "not measured", "why": "no CUDA device"}
    with tempfile.TemporaryDirectory() as tmp:
        result, output = Path(tmp) / "result.json", Path(tmp) / "output.txt"
        start = time.perf_counter()
        process = _PROCESSES.Process(target=_section_process, args=(name, str(result), str(output)))
        process.start()
        process.join(section.timeout_s)
        tail = output.read_text(errors="replace")[-8000:] if output.exists() else ""
        if process.is_alive():
            process.kill()
            process.join()
            return {"status": "timeout", "seconds": section.timeout_s, "tail": tail[-2000:]}
        seconds = round(time.perf_counter() - start, 1)
        if process.exitcode != 0 or not result.exists():
            return {"status": "failed", "seconds": seconds, "tail": tail}
        out: dict[str, Any] = json.loads(result.read_text())
        if not cuda:
            out["status"] = "cpu smoke (GPU figures not measured)"
        return {**out, "seconds": seconds}


def _summary(result: dict[str, Any]) -> str:
    figures = result.get("results") or {"why": result.get("why") or result.get("tail", "")[-200:]}
    text = json.dumps(figures)
    return text if len(text) <= 100 else text[:97] + "..."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated; default: all")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--run-section", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.run_section:
        return _run_section(args.run_section, args.result)
    import torch

    import lightning_ultrascale  # noqa: F401  (an import error here is the whole check's, not one section's)

    cuda = torch.cuda.is_available()
    if not cuda:  # Triton runs its kernels in its interpreter (read when a kernel is defined)
        os.environ["TRITON_INTERPRET"] = "1"
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (no CUDA device: every GPU figure not measured)",
        "torch": torch.__version__,
        "gpu_figures": "measured" if cuda else "not measured: no CUDA device (the figures are CPU smoke checks)",
        "sections": {name: _section(name, cuda) for name in args.sections.split(",")},
    }
    print(f"gpu_check on {report['device']} (torch {report['torch']})")
    print(f"{'section':<10} {'status':<38} {'s':>6}  figures")
    for name, result in report["sections"].items():
        print(f"{name:<10} {result['status']:<38} {result.get('seconds', math.nan):>6}  {_summary(result)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
