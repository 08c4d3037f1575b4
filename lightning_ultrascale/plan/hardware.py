"""Hardware profiles the planner times a layout on: peak FLOP/s, memory and the two link speeds.

Figures are the vendors' datasheet numbers (dense bf16 Tensor Core FLOP/s, HBM capacity, NVLink
bandwidth per direction, one 400 Gb/s InfiniBand NIC per GPU); ``*_efficiency`` scales them to
what training really reaches (busbw measured by nccl-tests on H100 clusters is ~75-80% of the
NVLink figure; large bf16 GEMMs reach ~75% of peak). Other GPUs: build a :class:`Hardware`, or a
dict with the same keys (``ultrascale-plan --gpu h100,memory_gib=96`` builds one).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_ultrascale.errors import ConfigError

__all__ = ["GPUS", "Hardware", "get_hardware"]


@dataclass(frozen=True)
class Hardware:
    """One GPU model and its cluster links.

    Example:
        >>> h100 = get_hardware("h100")
        >>> f"{h100.peak_flops / 1e12:.0f} TFLOP/s, {h100.memory_bytes / 2**30:.0f} GiB"
        '989 TFLOP/s, 80 GiB'
    """

    name: str
    peak_flops: float  # dense bf16 FLOP/s of one GPU
    memory_bytes: int  # HBM per GPU
    #: dense FLOP/s of fp32 matmuls, which the strategy runs as TF32 on CUDA (``tf32=True``, its
    #: default); ``None``: half of ``peak_flops`` (what TF32 tensor cores give on H100 and A100).
    fp32_flops: float | None = None
    gpus_per_node: int = 8
    intra_node_bandwidth: float = 450e9  # bytes/s per GPU per direction (NVLink)
    inter_node_bandwidth: float = 50e9  # bytes/s per GPU per direction (one 400 Gb/s NIC)
    #: a collective call's latency beyond its bytes, as NCCL's own tuning model prices it (``src/graph/tuning.cc``,
    #: ring and tree algorithms, Simple protocol, the one large messages run): a fixed cost per call, plus a cost per
    #: step of the ring (or level of the tree) over NVLink and over the network (:meth:`collective_latency`)
    collective_base_latency: float = 8.4e-6
    intra_node_latency: float = 3.4e-6  # seconds per NVLink step
    inter_node_latency: float = 14e-6  # seconds per network step
    link_efficiency: float = 0.8  # achieved / nominal NVLink bandwidth of large collectives (nccl-tests busbw)
    #: the same across nodes: NCCL's ring over InfiniBand reaches ~90% of the NIC's line rate
    #: (nccl-tests all_reduce busbw of 8-node DGX A100/H100 clusters)
    network_efficiency: float = 0.9
    matmul_efficiency: float = 0.75  # achieved / peak FLOP/s of a large (compute-bound) GEMM
    #: a GEMM's efficiency relative to ``matmul_efficiency`` by its narrowest inner or output
    #: width: ``((width, factor), ...)`` ascending, interpolated on log width, 1 beyond the last
    #: (empty: no loss; a CPU's is measured, ``benchmarks/cpu_time_model.py``)
    gemm_width_factors: tuple[tuple[int, float], ...] = ()
    #: FP8 tensor cores (Hopper, Ada): FP8 GEMMs' efficiency relative to bf16's at the same shape (FP8's
    #: peak is twice bf16's), by scaling (``"tensorwise"``, ``"rowwise"``, ``"blockwise"``) and the GEMM's
    #: narrowest dim: ``((scaling, ((width, efficiency), ...)), ...)``, widths ascending, interpolated on log
    #: width, flat beyond the ends. Empty: no FP8 tensor cores (the FP8 recipes emulate: no speed-up).
    #: Measured with ``benchmarks/gpu_check.py`` (:func:`lightning_ultrascale.plan.fp8.efficiency_table`).
    fp8_gemm_efficiency: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    #: HBM bandwidth (bytes/s): memory-bound kernels (norms, RoPE, SwiGLU, residual adds, the
    #: loss's softmax), the optimizer step, and GEMMs too narrow to be compute-bound (roofline).
    memory_bandwidth: float = 3.35e12
    memory_efficiency: float = 0.8  # achieved / nominal bandwidth of a streaming kernel
    #: achieved / peak FLOP/s of the fused attention kernel, forward and backward (FlashAttention-2:
    #: 50-70% of A100's peak in its paper; lower on H100, where FlashAttention-3 reaches 75%)
    attention_efficiency: float = 0.5
    #: seconds of host time per kernel that the device does not hide (0 on a GPU whose kernels
    #: outlast their launch; an eager CPU pays its dispatch and autograd bookkeeping on every op)
    op_overhead: float = 0.0
    #: host seconds per block and forward (with its backward) that a technique adds and the device
    #: does not hide, by the name its plugin prices it under (``"tensor"``: every op on DTensors;
    #: ``"fsdp"``: FSDP2's hooks; ``"context"``, ``"expert"``, ``"selective_op"``). Empty on GPUs;
    #: measured on a CPU (``benchmarks/cpu_time_model.py``)
    host_overheads: tuple[tuple[str, float], ...] = ()
    #: host seconds per micro-step outside the model's ops that the device does not hide (the
    #: training loop, data, logging; 0 on a GPU, where they overlap the queued kernels)
    step_overhead: float = 0.0
    #: HBM the planner leaves free: CUDA context, NCCL buffers, allocator fragmentation.
    reserved_bytes: int = 6 * 2**30
    #: the backend reports a point-to-point send complete before anyone waits for it (NCCL: its
    #: kernel has run), so a pipeline stage frees a sent input gradient at once; gloo does not:
    #: the multi-stage schedules' sent gradients then live until the step ends
    #: (``parallel/pipeline/buffers.py``)
    sends_polled: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            unchecked = ("gemm_width_factors", "host_overheads", "sends_polled", "fp8_gemm_efficiency")
            if (f.name == "fp32_flops" and value is None) or f.name in unchecked:
                continue
            if f.name != "name" and not (isinstance(value, (int, float)) and value > 0):
                if not (f.name in _MAY_BE_ZERO and value == 0):
                    raise ConfigError(f"gpu.{f.name}={value!r} must be a positive number")

    def host_overhead(self, technique: str) -> float:
        """:attr:`host_overheads` of ``technique`` (0 where not listed)."""
        return dict(self.host_overheads).get(technique, 0.0)

    def gemm_factor(self, width: float) -> float:
        """:attr:`gemm_width_factors` at ``width`` (log-linear between the measured widths).

        Example:
            >>> cpu = {"name": "cpu", "peak_flops": 1e11, "memory_bytes": 1}
            >>> get_hardware(cpu | {"gemm_width_factors": ((64, 0.5), (256, 1.0))}).gemm_factor(128)
            0.75
        """
        return _interpolated(self.gemm_width_factors, width, beyond=1.0)

    def fp8_speedup(self, scaling: str, width: float) -> float:
        """How many times faster than bf16 a GEMM of narrowest dim ``width`` runs with FP8 ``scaling``.

        Example:
            >>> h100 = get_hardware("h100")
            >>> round(h100.fp8_speedup("tensorwise", 8192), 2), round(h100.fp8_speedup("tensorwise", 128), 2)
            (1.94, 0.94)
            >>> get_hardware("a100").fp8_speedup("tensorwise", 8192)  # no FP8 tensor cores: emulated
            1.0
        """
        table = dict(self.fp8_gemm_efficiency).get(scaling)
        return 1.0 if not table else 2 * _interpolated(table, width, beyond=table[-1][1])

    def collective_latency(self, op: str, size: int, nodes: int = 1) -> float:
        """Seconds one call of ``op`` over ``size`` ranks on ``nodes`` nodes takes beyond its bytes (NCCL's model).

        A ring all-gather or reduce-scatter makes ``size - 1`` steps, ``nodes - 1`` of them across the network
        (an all-reduce twice as many); an all-reduce across nodes takes the tree where it is shorter (NCCL picks
        the faster: ``2 x (ranks a node - 1)`` NVLink steps and ``2 log2(nodes)`` network ones). A send, and an
        all-to-all (every peer at once), take one step. Plus the fixed cost of every call.

        Example:
            >>> h100 = get_hardware("h100")
            >>> round(h100.collective_latency("all_gather", 8) * 1e6, 1)  # 8.4 + 7 x 3.4 us
            32.2
            >>> round(h100.collective_latency("all_gather", 512, nodes=64) * 1e3, 2)  # a ring over 64 nodes
            2.41
            >>> round(h100.collective_latency("all_reduce", 512, nodes=64) * 1e6)  # the tree's 2 x (7 + 6) steps
            224
        """
        if size <= 1:
            return 0.0
        hop = self.inter_node_latency if nodes > 1 else self.intra_node_latency
        if op not in ("all_gather", "reduce_scatter", "all_reduce"):
            return self.collective_base_latency + hop
        twice = 2 if op == "all_reduce" else 1
        steps, network = twice * (size - 1), twice * (nodes - 1)
        ring = (steps - network) * self.intra_node_latency + network * self.inter_node_latency
        if op == "all_reduce" and nodes > 1:
            tree = 2 * ((size // nodes - 1) * self.intra_node_latency + math.log2(nodes) * self.inter_node_latency)
            ring = min(ring, tree)
        return self.collective_base_latency + ring

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes

    def peak_for(self, precision: str) -> float:
        """The matmul peak a run of Lightning ``precision`` computes at: bf16, or fp32 as TF32.

        Example:
            >>> h100 = get_hardware("h100")
            >>> h100.peak_for("bf16-mixed") / 1e12, h100.peak_for("32-true") / 1e12
            (989.0, 494.5)
        """
        if precision.startswith("bf16"):
            return self.peak_flops
        return self.fp32_flops if self.fp32_flops is not None else self.peak_flops / 2


def _interpolated(table: tuple[tuple[int, float], ...], width: float, beyond: float) -> float:
    """``table``'s value at ``width``: log-linear between its widths, its first below them, ``beyond`` above."""
    if not table or width >= table[-1][0]:
        return beyond if table else 1.0
    if width <= table[0][0]:
        return table[0][1]
    for (w0, f0), (w1, f1) in itertools.pairwise(table):
        if w0 <= width <= w1:
            return f0 + (f1 - f0) * math.log(width / w0) / math.log(w1 / w0)
    return beyond


_MAY_BE_ZERO = (
    "reserved_bytes",
    "op_overhead",
    "step_overhead",
    "collective_base_latency",
    "intra_node_latency",
    "inter_node_latency",
)

#: Fitted on one published run (see ``GPUS["h100"]``); every other figure is a datasheet's.
H100_MATMUL_EFFICIENCY = 0.60
#: FP8 GEMMs' efficiency relative to bf16's on Hopper, measured on one H200 (its tensor cores are the
#: H100's) by ``benchmarks/gpu_check.py`` (2026-11-28, torch 2.11): ``_scaled_mm`` against bf16 ``mm``
#: at Llama 3 70B's TP8 shapes and squares (``benchmarks/results/gpu_check.json``; a test recomputes
#: it with :func:`lightning_ultrascale.plan.fp8.efficiency_table`). Not fitted to any training run.
HOPPER_FP8 = (
    ("tensorwise", ((128, 0.471), (1024, 0.775), (3584, 0.917), (4096, 0.917), (8192, 0.971), (16384, 0.941))),
    ("rowwise", ((128, 0.46), (1024, 0.801), (3584, 0.894), (4096, 0.886), (8192, 0.886), (16384, 0.743))),
    ("blockwise", ((128, 0.471), (8192, 0.692))),
)

GPUS: dict[str, Hardware] = {
    # H100 SXM5 80GB: 989 TFLOP/s dense bf16 (494.5 TF32), NVLink 4 (900 GB/s both directions), NDR IB per GPU,
    # HBM3 3.35 TB/s. matmul_efficiency is FITTED, on NVIDIA's Llama 3.1 8B run on 8 H100s alone
    # (benchmarks/published_runs.py; judged on the other runs): the 989 TFLOP/s peak is at boost
    # clock, which a loaded H100 does not hold.
    "h100": Hardware(
        "h100", peak_flops=989e12, memory_bytes=80 * 2**30, fp32_flops=494.5e12,
        matmul_efficiency=H100_MATMUL_EFFICIENCY, fp8_gemm_efficiency=HOPPER_FP8,
    ),
    # H200 SXM 141GB: the H100's compute and links with more and faster HBM (HBM3e 4.8 TB/s).
    "h200": Hardware(
        "h200", peak_flops=989e12, memory_bytes=141 * 2**30, fp32_flops=494.5e12, memory_bandwidth=4.8e12,
        matmul_efficiency=H100_MATMUL_EFFICIENCY, fp8_gemm_efficiency=HOPPER_FP8,
    ),
    # A100 SXM4 80GB: 312 TFLOP/s bf16 (156 TF32), NVLink 3 (600 GB/s both directions), 200 Gb/s HDR IB,
    # HBM2e 2.04 TB/s.
    "a100": Hardware(
        "a100",
        peak_flops=312e12,
        memory_bytes=80 * 2**30,
        intra_node_bandwidth=300e9,
        inter_node_bandwidth=25e9,
        fp32_flops=156e12,
        memory_bandwidth=2.039e12,
    ),
    # Two processes of one thread on a 2-core x86 machine with gloo (the CI machine these figures were
    # measured on by benchmarks/cpu_time_model.py's micro-benchmarks, rounded; re-measure yours with
    # it). What `parallel=auto` plans a CPU job with.
    "cpu": Hardware(
        "cpu", peak_flops=104e9, fp32_flops=104e9, memory_bytes=24 * 2**30, gpus_per_node=2,
        intra_node_bandwidth=1.5e9, inter_node_bandwidth=1.5e9, collective_base_latency=140e-6,
        intra_node_latency=0.0, inter_node_latency=0.0,
        link_efficiency=1.0, network_efficiency=1.0, matmul_efficiency=1.0,
        gemm_width_factors=((32, 0.71), (64, 1.0), (256, 1.0), (512, 0.97)), memory_bandwidth=47e9,
        memory_efficiency=1.0, attention_efficiency=0.41, op_overhead=2.5e-6, step_overhead=4.6e-3, reserved_bytes=0,
        host_overheads=(
            ("tensor", 22e-3), ("fsdp", 7.8e-3), ("context", 6.5e-3), ("selective_op", 6.5e-3), ("expert", 3.5e-3),
            ("pipeline_1f1b", 0.0), ("pipeline_interleaved_1f1b", 0.78e-3), ("pipeline_zbv", 0.87e-3),
        ),
        sends_polled=False,
    ),
}  # fmt: skip


def get_hardware(gpu: str | Mapping[str, Any] | Hardware) -> Hardware:
    """A built-in profile by name, or one described by a mapping of :class:`Hardware`'s fields.

    Example:
        >>> get_hardware({"name": "mi300x", "peak_flops": 1307e12, "memory_bytes": 192 * 2**30}).gpus_per_node
        8
        >>> get_hardware("b300")
        Traceback (most recent call last):
        ...
        lightning_ultrascale.errors.ConfigError: gpu=b300 is not a built-in profile; valid: h100, h200, a100, ...
    """
    if isinstance(gpu, Hardware):
        return gpu
    if isinstance(gpu, Mapping):
        known = {f.name for f in fields(Hardware)}
        unknown = sorted(set(gpu) - known)
        if unknown:
            raise ConfigError(f"gpu keys {', '.join(unknown)} are unknown; valid: {', '.join(sorted(known))}")
        try:
            return Hardware(**dict(gpu))
        except TypeError as err:
            raise ConfigError(f"gpu={dict(gpu)} needs name, peak_flops and memory_bytes ({err})") from None
    if gpu.lower() in GPUS:
        return GPUS[gpu.lower()]
    optional = ", ".join(f.name for f in fields(Hardware) if f.name not in ("name", "peak_flops", "memory_bytes"))
    raise ConfigError(
        f"gpu={gpu} is not a built-in profile; valid: {', '.join(GPUS)}, or a mapping with the keys "
        f"name, peak_flops, memory_bytes (optional: {optional})"
    )
