"""Named parallel layouts of the tiny models, for tests and benchmarks that must cover every technique.

Each :class:`NamedLayout` is a plugin factory (a fresh list per process), the processes it takes,
how many of them are data-parallel ranks (they share the global batch) and the model: the ZeRO
stages, tensor and sequence parallelism, their product with ZeRO-3, every context-parallel method,
every pipeline schedule whose backward is one op, the recomputation modes, and MoE with expert
parallelism. The regional-compilation suite and ``benchmarks/compile.py`` train the same matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_ultrascale.parallel.context import ContextParallel
from lightning_ultrascale.parallel.data import DataParallel, ZeRO
from lightning_ultrascale.parallel.expert import ExpertParallel
from lightning_ultrascale.parallel.pipeline import PipelineParallel
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.parallel.recompute import Recompute
from lightning_ultrascale.parallel.tensor import TensorParallel


@dataclass(frozen=True)
class NamedLayout:
    """Plugins (built in each process), processes, data-parallel ranks and the model's name."""

    plugins: Callable[[], list[ParallelPlugin]]
    world_size: int = 1
    dp: int = 1
    model: str = "llama_tiny"


def _sp() -> TensorParallel:
    return TensorParallel(2, sequence_parallel=True)


LAYOUTS: dict[str, NamedLayout] = {
    "one-process": NamedLayout(lambda: []),
    "dp2": NamedLayout(lambda: [DataParallel()], 2, 2),
    "zero1": NamedLayout(lambda: [ZeRO(stage=1)], 2, 2),
    "zero2": NamedLayout(lambda: [ZeRO(stage=2)], 2, 2),
    "zero3": NamedLayout(lambda: [ZeRO(stage=3)], 2, 2),
    "tp2": NamedLayout(lambda: [TensorParallel(2)], 2),
    "tp2-sp": NamedLayout(lambda: [_sp()], 2),
    "zero3xtp2-sp": NamedLayout(lambda: [ZeRO(stage=3), _sp()], 4, 2),
    "cp2-ring": NamedLayout(lambda: [ContextParallel(2, method="ring")], 2),
    "cp2-zigzag": NamedLayout(lambda: [ContextParallel(2, method="zigzag_ring")], 2),
    "cp2-all_to_all": NamedLayout(lambda: [ContextParallel(2, method="all_to_all")], 2),
    "pp2-afab": NamedLayout(lambda: [PipelineParallel(2, schedule="afab")], 2),
    "pp2-1f1b": NamedLayout(lambda: [PipelineParallel(2, schedule="1f1b")], 2),
    "pp2-interleaved": NamedLayout(lambda: [PipelineParallel(2, schedule="interleaved_1f1b")], 2),
    "pp2-looped_bfs": NamedLayout(lambda: [PipelineParallel(2, schedule="looped_bfs")], 2),
    "recompute-full": NamedLayout(lambda: [Recompute("full")]),
    "recompute-selective": NamedLayout(lambda: [Recompute("selective", every=2)]),
    "recompute-selective_op-zero3": NamedLayout(lambda: [Recompute("selective_op"), ZeRO(stage=3)], 2, 2),
    "moe-one-process": NamedLayout(lambda: [], model="moe_tiny"),
    "moe-ep2": NamedLayout(lambda: [ExpertParallel(2)], 2, 2, "moe_tiny"),
    "moe-ep2xtp2": NamedLayout(lambda: [ExpertParallel(2), TensorParallel(2)], 4, 2, "moe_tiny"),
}
