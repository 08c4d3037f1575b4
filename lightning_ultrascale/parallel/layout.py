"""The Layout: the facts plugins hand each other, in one explicit object.

Plugins are applied in a fixed order (``plugin.APPLY_ORDER``). An earlier plugin writes what a
later one must know; the later one reads it here, never from an attribute stuck on a model or a
parameter, nor by peeking at another technique's mesh dim:

=========================  ==========================================  =============================
fact                       written by                                  read by
=========================  ==========================================  =============================
``tied``                   the strategy, on the model before any       tensor parallelism (re-ties),
                           plugin (parameters several modules hold)    pipeline, ZeRO-3, the strategy
``tied_copies``            pipeline (a tied weight's copies on other   the step runner (gradients
                           stages' ranks)                              summed), the strategy (equal)
``parts``, ``dropped``     pipeline (the stages this rank runs, the    data parallelism (FSDP roots),
                           modules it does not hold)                   tensor parallelism
``forwards_per_step``      pipeline (microbatches)                     data parallelism (reshard)
``linear_styles``          FP8 (which linears are Float8)              tensor parallelism
``all_gather_casts``       FP8 (weights that can be all-gathered in    ZeRO-3 (FSDP2 units)
                           FP8, and how to make them so)
``gradient_groups``        experts (parameters reduced over their     data parallelism (one engine
                           own data ranks); the rest: dp x cp          per group)
``grad_syncs``             data parallelism (the engines)              the step runner, the strategy
``grad_norm``              pipeline (stages, tied copy), sharded       gradient clipping
                           optimizer (shards split over tp)
``batch_transforms``       context parallelism (this rank's tokens)    the step runner
``step_contexts``          tensor parallelism (loss parallel)          the step runner
``part_name``              pipeline (``pp<rank>``)                     checkpoints of sharded states
=========================  ==========================================  =============================

Parameters are named relative to the parallelised model (``layers.0.attention.wq.weight``):
names survive materialisation, which replaces every ``Parameter`` object.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_ultrascale.parallel.dims import DATA_DIMS, ParallelDims
from lightning_ultrascale.parallel.mesh import ParallelMesh

if TYPE_CHECKING:
    from lightning_ultrascale.parallel.data.engines import GradientSync
    from lightning_ultrascale.parallel.tied import TiedCopy, TiedGroup


@dataclass(frozen=True)
class GradientGroup:
    """Parameters whose gradients are averaged over the ranks of the same mesh ``dims``.

    ``params``: names relative to the model; ``None`` for the default group, which takes every
    parameter no other group claims and averages over ``dp_replicate x dp_shard x cp``.

    Example:
        >>> GradientGroup("experts", ("dp_replicate", "edp"), frozenset({"layers.0.moe.w1"})).claims("layers.0.moe.w1")
        True
    """

    name: str
    dims: tuple[str, ...] = DATA_DIMS
    params: frozenset[str] | None = None

    def claims(self, name: str) -> bool:
        return self.params is not None and name in self.params


def chunk_length(length: int, parts: int, index: int) -> int:
    """Length of chunk ``index`` when ``length`` is cut into ``parts``: ``torch.chunk``'s rule.

    DTensor's ``Shard`` and FSDP2 both cut this way: chunks of ``ceil(length / parts)``, the last
    ones shorter or empty.

    Example:
        >>> [chunk_length(5, 4, i) for i in range(4)]
        [2, 2, 1, 0]
    """
    size = -(-length // parts)
    return max(0, min(size, length - index * size))


@dataclass
class ShardPlan:
    """The pure twin of :class:`Layout`: what one rank would hold, predicted without processes.

    ``shapes`` maps each parameter this rank holds to its local shape (the global shape before
    any plugin). A plugin's :meth:`~lightning_ultrascale.parallel.plugin.ParallelPlugin.plan_shards`
    drops the parameters its ``apply`` takes off this rank and shrinks the ones it shards.
    ``coordinate`` and ``sizes`` hold this rank's place in every mesh dim, including the ones a
    plugin adds (``ep``, ``edp``); ``groups`` the parameters whose gradient group spans other dims
    than the data dims (experts: ``("edp",)``).

    Example:
        >>> plan = ShardPlan({"tp": 1}, {"tp": 2}, {"w": (6, 4)})
        >>> plan.shard("w", dim=0, over="tp"); plan.shapes
        {'w': (3, 4)}
    """

    coordinate: dict[str, int]
    sizes: dict[str, int]
    shapes: dict[str, tuple[int, ...]]
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: every parameter's whole shape, before any plugin (where the caller knows it; else ``shapes`` is)
    whole: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def flat(self, dims: tuple[str, ...]) -> tuple[int, int]:
        """``(size, this rank's index)`` of mesh ``dims`` flattened row-major (as DeviceMesh flattens)."""
        size, index = 1, 0
        for d in dims:
            size, index = size * self.sizes[d], index * self.sizes[d] + self.coordinate[d]
        return size, index

    def shard(self, name: str, dim: int, over: str | tuple[str, ...]) -> None:
        """Cut parameter ``name`` along ``dim`` over mesh dim(s) ``over`` (flattened, row-major)."""
        parts, index = self.flat((over,) if isinstance(over, str) else over)
        shape = list(self.shapes[name])
        shape[dim] = chunk_length(shape[dim], parts, index)
        self.shapes[name] = tuple(shape)

    @property
    def numel(self) -> int:
        """Parameter elements this rank holds."""
        return sum(math.prod(shape) for shape in self.shapes.values())


@dataclass
class GradNormPlan:
    """What the global gradient norm must know beyond each gradient's own placements.

    - ``skip``: names of parameters whose gradient another rank's copy already counts (the tied
      head on the last pipeline stage);
    - ``across``: groups whose ranks hold different parameters (pipeline stages): the squared
      norm is summed over them at the end;
    - ``split_over``: tensors whose local pieces are split over more groups than their own mesh
      says (a sharded optimizer's flat shard of tensor-parallel pieces is also split over tp).
    """

    skip: set[str] = field(default_factory=set)
    across: list[dist.ProcessGroup] = field(default_factory=list)
    split_over: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)

    def groups_of(self, tensor: Any) -> tuple[dist.ProcessGroup, ...]:
        return self.split_over.get(tensor, ())


class Layout:
    """How this rank's model is laid out: the mesh, and every fact one plugin leaves for the next.

    Example:
        >>> layout = Layout(ParallelDims(), mesh)  # doctest: +SKIP
        >>> layout.declare_gradient_group("experts", ("dp_replicate", "edp"), expert_names)  # doctest: +SKIP
    """

    def __init__(
        self, dims: ParallelDims, mesh: ParallelMesh, precision: str = "32-true", tied: tuple[TiedGroup, ...] = ()
    ) -> None:
        self.dims = dims
        self.mesh = mesh
        self.precision = precision
        #: Parameters the model holds under several names (:mod:`~lightning_ultrascale.parallel.tied`).
        self.tied = tied
        self.tied_copies: list[TiedCopy] = []
        self.parts: list[nn.Module] | None = None
        self.dropped: set[str] = set()
        self.forwards_per_step = 1
        self.part_name = "shards"
        self.linear_styles: dict[str, str] = {}
        #: Module name -> a function that makes its weight all-gather in low precision (FP8);
        #: applied by ZeRO-3 before sharding, never without it.
        self.all_gather_casts: dict[str, Callable[[nn.Module], None]] = {}
        self.gradient_groups: list[GradientGroup] = [GradientGroup("dense")]
        self.grad_syncs: list[GradientSync] = []
        self.grad_norm = GradNormPlan()
        self.batch_transforms: list[Callable[[Any], Any]] = []
        self.step_contexts: list[Callable[[], contextlib.AbstractContextManager[Any]]] = []

    def model_parts(self, model: nn.Module) -> list[nn.Module]:
        """The modules whose ``forward`` a step calls: the pipeline stages if there are any, else the model."""
        return list(self.parts) if self.parts is not None else [model]

    def stepped(self, param: nn.Parameter) -> torch.Tensor:
        """The tensor the optimizer steps for ``param``: itself, its fp32 master (``bf16-mixed``, ZeRO 0) or its shard.

        A sharded optimizer's shard stands for ``param`` only where ``param`` has a bucket of its own.
        """
        for sync in self.grad_syncs:
            alias = sync.stepped(param)
            if alias is not None:
                return alias
        return param

    def declare_gradient_group(self, name: str, dims: tuple[str, ...], params: set[str] | frozenset[str]) -> None:
        """Reduce the gradients of ``params`` (names) over ``dims`` instead of the default data dims."""
        taken = {n for g in self.gradient_groups if g.params is not None for n in g.params}
        if name in {g.name for g in self.gradient_groups} or taken & set(params):
            raise ValueError(f"gradient group {name!r} repeats a group name or claims parameters of another group")
        self.gradient_groups.insert(-1, GradientGroup(name, dims, frozenset(params)))

    def group_params(self, group: GradientGroup, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The named parameters of ``model`` in ``group`` (the default group: those no other group claims)."""
        others = [g for g in self.gradient_groups if g.params is not None and g is not group]
        if group.params is not None:
            return [(n, p) for n, p in model.named_parameters() if group.claims(n)]
        return [(n, p) for n, p in model.named_parameters() if not any(g.claims(n) for g in others)]

    @contextlib.contextmanager
    def step_context(self) -> Iterator[None]:
        """Every plugin's context around a step's forward and backward (e.g. loss parallel)."""
        with contextlib.ExitStack() as stack:
            for context in self.step_contexts:
                stack.enter_context(context())
            yield

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Hold back every gradient reduction (non-final accumulation micro-steps, pipeline schedules)."""
        with contextlib.ExitStack() as stack:
            for sync in self.grad_syncs:
                stack.enter_context(sync.no_sync())
            yield

    def transform_batch(self, batch: Any) -> Any:
        """This rank's part of a batch its data-parallel group received (context parallelism keeps its tokens)."""
        for transform in self.batch_transforms:
            batch = transform(batch)
        return batch
