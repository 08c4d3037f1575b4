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
compiled   compiled blocks (``Compile``) against eager: llama_small and llama3_1b's step in        240 s
           alternated rounds, the paired ratio with its interval, MFU, compile seconds, graphs
fp8_gemm   bf16 ``mm`` and FP8 ``_scaled_mm`` (tensorwise, rowwise) TFLOP/s by GEMM shape: Llama 3     60 s
           70B's linears under TP8 (forward, dgrad, wgrad) and squares
fp8_step   llama3_1b steps with compiled blocks in bf16 and each torchao FP8 recipe, each in its    200 s
           own interpreter: ms, peak memory, losses (needs torchao: carry its wheel)
=========  ===================================================================================  =======

Each section runs in a process of its own with its own timeout (they sum to 970 s; a full run took about
250 s on an H200), so a crash or a hang loses that section only; the JSON keeps the tail of its output,
and is written after each section. It needs the GPU machine's image as it is (torch 2.11, triton,
lightning, transformers, pytest; torchao for ``fp8_step`` only) and this checkout, whose root it puts on
the path: the package imports hydra, omegaconf and torchao only where a command needs them, so no wheel
is carried (``tests/e2e/test_gpu_image.py`` runs the script with those three hidden).

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
    ms, peak, _ = _train_steps(name, seq, batch, steps=4 if cuda else 3)
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


def _train_steps(
    name: str, seq: int, batch: int, steps: int, plugins: list[Any] | None = None, compiled: bool = False
) -> tuple[float, int, list[float]]:
    """Median ms of the steps after the first, the peak of allocated memory (CUDA) and the losses."""
    import lightning as L
    import torch

    from lightning_ultrascale import Compile, LlamaModule, UltraScaleDataModule, UltraScaleStrategy
    from lightning_ultrascale.testing.parity import QUIET_TRAINER

    times: list[float] = []
    losses: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            _sync()
            times.append(time.perf_counter())

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
            losses.append(round(float(outputs["loss"]), 5))

    precision = {} if plugins else {"precision": "bf16-mixed"}
    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1,
        strategy=UltraScaleStrategy(*([Compile()] if compiled else [])), plugins=plugins or None, max_steps=steps,
        callbacks=[Clock()], **precision, **QUIET_TRAINER,
    )  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    data = UltraScaleDataModule(seq_len=seq, micro_batch_size=batch)
    trainer.fit(LlamaModule(name, kernels="reference"), datamodule=data)
    _sync()
    times.append(time.perf_counter())
    ms = statistics.median(b - a for a, b in itertools.pairwise(times[1:])) * 1e3
    return ms, torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0, losses


def compiled(cuda: bool) -> dict[str, Any]:
    """Compiled blocks (``Compile``, inductor) against eager: the model's bf16 step, alternated rounds."""
    shapes = {"llama_small": (256, 64), "llama3_1b": (2048, 4)} if cuda else {"llama_tiny": (64, 2)}
    return {name: _compiled_against_eager(name, seq, batch, cuda) for name, (seq, batch) in shapes.items()}


def _compiled_against_eager(name: str, seq: int, batch: int, cuda: bool) -> dict[str, Any]:
    """Tokens/s of one model's step (forward, backward, fused AdamW; bf16 autocast), eager and compiled blocks.

    Both models live in one process and run in rounds, the order rotated (``testing.timing.Alternation``);
    the compiled one is warmed up first, so its compile is not timed (it is reported).
    """
    import torch

    from lightning_ultrascale import Compile
    from lightning_ultrascale.models import build_model, get_model_config
    from lightning_ultrascale.testing.timing import Alternation

    plugin, steps, fns = Compile(), 10 if cuda else 2, {}
    for kind in ("eager", "compiled"):
        net = build_model(name, device=_device(), seed=0)
        if kind == "compiled":
            plugin.apply(net)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-5, fused=cuda)
        tokens = torch.randint(0, net.config.vocab_size, (batch, seq), device=_device())

        def step(net: Any = net, optimizer: Any = optimizer, tokens: Any = tokens) -> None:
            with torch.autocast(_device().type, torch.bfloat16):
                loss = net(tokens, labels=tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(2):  # warm-up: the compile
            step()
        fns[kind] = step

    def tokens_per_s(step: Callable[[], None]) -> float:
        _sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
        return steps * seq * batch / (time.perf_counter() - start)

    arms = {kind: (lambda step=step: tokens_per_s(step)) for kind, step in fns.items()}
    fewest, most = (8, 16) if cuda else (2, 2)  # on a CPU a smoke check of the script: two rounds
    alternation = Alternation(arms, baseline="eager", min_rounds=fewest, max_rounds=most, max_seconds=45, log=None)
    ratio = alternation.run()["compiled"]
    eager, fast = (statistics.median(alternation.samples[kind]) for kind in ("eager", "compiled"))
    flops = get_model_config(name).flops_per_token(seq)
    return {
        "tokens": seq * batch, "steps_per_round": steps, "eager_tokens_per_s": round(eager),
        "compiled_tokens_per_s": round(fast), "paired_ratio": ratio.as_dict(),
        "compiled_mfu": round(fast * flops / PEAK_BF16, 4) if cuda else "not measured",
        "compile_s": round(plugin.stats.seconds, 1), "graphs": dict(plugin.stats.graphs),
    }  # fmt: skip


#: (tokens, in, out) of Llama 3 70B's linears under TP8 at 8192 tokens (torchtitan's published FP8 run), and squares.
FP8_SHAPES = {
    "wq": (8192, 8192, 1024), "wk_wv": (8192, 8192, 128), "wo": (8192, 1024, 8192),
    "w1_w3": (8192, 8192, 3584), "w2": (8192, 3584, 8192),
    **{f"square_{n}": (n, n, n) for n in (1024, 2048, 4096, 8192, 16384)},
}  # fmt: skip


def fp8_gemm(cuda: bool) -> dict[str, Any]:
    """TFLOP/s of bf16 ``mm`` and of FP8 ``_scaled_mm`` (tensorwise and rowwise scales) by GEMM shape.

    Each linear's three GEMMs: forward (tokens x in @ in x out), dgrad (tokens x out @ out x in) and
    wgrad (out x tokens @ tokens x in), as the planner prices them.
    """
    rows = {}
    for name, (t, k, n) in FP8_SHAPES.items():
        gemms = {"fwd": (t, k, n)}
        if not name.startswith("square"):
            gemms.update(dgrad=(t, n, k), wgrad=(n, t, k))
        rows[name] = {kind: _fp8_gemm_row(*shape) for kind, shape in gemms.items()}
    return rows


def _fp8_gemm_row(m: int, k: int, n: int) -> dict[str, Any]:
    import torch

    a, b = _randn(m, k), _randn(n, k)
    fa, fb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # row-major x column-major
    one = torch.ones((), device=_device())
    rows_a, cols_b = torch.ones(m, 1, device=_device()), torch.ones(1, n, device=_device())
    calls = {
        "bf16": lambda: a @ b.t(),
        "tensorwise": lambda: torch._scaled_mm(fa, fb, one, one, out_dtype=torch.bfloat16),
        "rowwise": lambda: torch._scaled_mm(fa, fb, rows_a, cols_b, out_dtype=torch.bfloat16),
    }
    out: dict[str, Any] = {"shape": [m, k, n]}
    for kind, call in calls.items():
        out[f"{kind}_tflops"] = round(2 * m * k * n / _repeated_ms(call) / 1e9, 1)
    return out


def _repeated_ms(fn: Callable[[], Any], calls: int = 20) -> float:
    """Mean milliseconds of ``fn`` over ``calls`` back-to-back calls (after three warm-ups), synchronised."""
    for _ in range(3):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    return (time.perf_counter() - start) * 1e3 / calls


def fp8_step(cuda: bool) -> dict[str, Any]:
    """Steps of ``llama3_1b`` through the Trainer with compiled blocks: bf16 and each torchao FP8 recipe.

    Each recipe trains in a fresh interpreter of its own, so its peak memory is its own (in one process,
    what dynamo and the allocator keep from an earlier run would count against the next).
    """
    if importlib.util.find_spec("torchao") is None:
        return {"why": "torchao is not installed (carry its wheel)"}
    out: dict[str, Any] = {}
    for recipe in FP8_STEP_RECIPES:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            command = [sys.executable, __file__, "--fp8-recipe", recipe, "--result", str(result)]
            try:
                run = subprocess.run(command, capture_output=True, text=True, timeout=120)
            except subprocess.TimeoutExpired as timeout:
                out[recipe] = {"error": "timed out after 120 s", "tail": _text(timeout.stdout)[-2000:]}
                continue
            if run.returncode != 0 or not result.exists():  # one recipe's failure is a finding; the others run
                out[recipe] = {"error": f"exit code {run.returncode}", "tail": (run.stdout + run.stderr)[-3000:]}
                continue
            out[recipe] = json.loads(result.read_text())
        print(recipe, json.dumps(out[recipe]), flush=True)  # kept in the section's tail if a later recipe hangs
    for recipe in FP8_STEP_RECIPES[1:]:
        if "ms" in out["bf16"] and "ms" in out[recipe]:
            out[recipe]["speedup_vs_bf16"] = round(out["bf16"]["ms"] / out[recipe]["ms"], 3)
    return out


FP8_STEP_RECIPES = ("bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp")


def _fp8_step_run(recipe: str) -> dict[str, Any]:
    import torch

    from lightning_ultrascale import FP8Precision

    cuda = torch.cuda.is_available()
    name, seq, batch = ("llama3_1b", 2048, 4) if cuda else ("llama_tiny", 64, 2)
    plugins = [] if recipe == "bf16" else [FP8Precision(recipe)]
    ms, peak, losses = _train_steps(name, seq, batch, steps=8 if cuda else 3, plugins=plugins, compiled=True)
    reserved = torch.cuda.max_memory_reserved() if cuda else 0
    return {"ms": round(ms, 1), "peak_memory_gib": round(peak / 2**30, 2),
            "peak_reserved_gib": round(reserved / 2**30, 2), "losses": losses}  # fmt: skip


def gpu_tier(cuda: bool) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "-rfEs", "--tb=short"]
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
    skipped = [line for line in stdout.splitlines() if line.startswith("SKIPPED")]  # with their reasons
    out: dict[str, Any] = {"returncode": returncode, "counts": counts, "failures": failures[:20], "skipped": skipped}
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
    "compiled": Section(compiled, 240, on_cpu=True),
    "fp8_gemm": Section(fp8_gemm, 60, on_cpu=False),
    "fp8_step": Section(fp8_step, 200, on_cpu=True),
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
    parser.add_argument("--fp8-recipe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.run_section:
        return _run_section(args.run_section, args.result)
    if args.fp8_recipe:  # one recipe of the fp8_step section, in an interpreter of its own
        Path(args.result).write_text(json.dumps(_fp8_step_run(args.fp8_recipe)))
        return None
    import torch

    import lightning_ultrascale  # noqa: F401  (an import error here is the whole check's, not one section's)

    cuda = torch.cuda.is_available()
    if not cuda:  # Triton runs its kernels in its interpreter (read when a kernel is defined)
        os.environ["TRITON_INTERPRET"] = "1"
    report = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (no CUDA device: every GPU figure not measured)",
        "torch": torch.__version__,
        "gpu_figures": "measured" if cuda else "not measured: no CUDA device (the figures are CPU smoke checks)",
        "sections": {},
    }
    print(f"gpu_check on {report['device']} (torch {report['torch']})")
    print(f"{'section':<10} {'status':<38} {'s':>6}  figures", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name in args.sections.split(","):
        result = report["sections"][name] = _section(name, cuda)
        print(f"{name:<10} {result['status']:<38} {result.get('seconds', math.nan):>6}  {_summary(result)}", flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")  # after each: a killed run keeps the rest


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
