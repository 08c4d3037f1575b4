"""Tensor parallelism and sequence parallelism (the playbook's TP/SP chapter), over DTensor.

Megatron's split, as the model declares it (``ModelSpec.tp_plan``): attention and MLP input
projections are column-parallel (each ``tp`` rank holds a slice of the heads / hidden units),
output projections row-parallel, so a block costs one all-reduce in forward and one in backward
per sub-layer. The embedding is vocabulary-parallel and the output projection leaves logits sharded
over the vocabulary: with ``loss_parallel`` the cross-entropy runs on the shards and ``[b, s, V]``
logits never exist in full on a rank.

With ``sequence_parallel`` the residual stream between sub-layers is sharded over the sequence:
norms work on ``s/tp`` tokens and each all-reduce becomes a reduce-scatter (after the row-parallel
projection) plus an all-gather (before the column-parallel one): the same bytes, and the
norm/residual activations divided by ``tp``. TP needs fast links: keep it inside a node.

A linear that an earlier plugin made special (the Layout's ``linear_styles``: FP8 says "these
linears are Float8") gets the parallel style registered for its kind in :data:`LINEAR_STYLES`,
from the same plan: one plan, never a second one per precision.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from lightning_ultrascale.errors import ConfigError, ContractError, nearby_multiples, option, require_positive_int
from lightning_ultrascale.models.spec import ModelSpec, SharesTokens, declares, require_spec
from lightning_ultrascale.parallel.dims import DATA_DIMS, DataShape, ParallelDims
from lightning_ultrascale.parallel.layout import Layout, ShardPlan
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.parallel.pricing import (
    CostTerms,
    NotSearched,
    PlanAxis,
    RankView,
    SearchContext,
    SearchPoint,
    powers_of_two,
)
from lightning_ultrascale.parallel.regather import regathered
from lightning_ultrascale.parallel.tied import retie
from lightning_ultrascale.utils.memo import memoized

#: For each linear style an earlier plugin may set in ``Layout.linear_styles``: how a plan's
#: parallel style becomes the one that fits such a linear (e.g. ``"float8"``: torchao's Float8
#: column/row-wise styles, registered by the plugin that swaps the linears).
LINEAR_STYLES: dict[str, Callable[[ParallelStyle], ParallelStyle]] = {}


class TensorParallel(ParallelPlugin):
    """Shard attention, MLP, embedding and head over the ``tp`` mesh dim.

    Args:
        size: tensor-parallel degree; must divide the model's heads and kv-heads.
        sequence_parallel: shard norms and the residual stream over the sequence (Megatron SP).
        loss_parallel: compute the cross-entropy on vocabulary shards (no full logits).
        regather: with ``sequence_parallel``, keep each sub-layer's input sequence-sharded for backward and
            all-gather it again there (Megatron-Core's default): ``(tp - 1) / tp`` of the two gathered inputs per
            block fewer activations, one more all-gather per sub-layer in backward
            (:mod:`~lightning_ultrascale.parallel.regather`).

    Example:
        >>> from lightning_ultrascale import TensorParallel, UltraScaleStrategy, ZeRO
        >>> strategy = UltraScaleStrategy(TensorParallel(2, sequence_parallel=True), ZeRO(stage=3))
    """

    applies_at = "tensor"
    plan_order = 10
    plan_names = ("tp", "sequence_parallel", "regather")

    def __init__(
        self, size: int, sequence_parallel: bool = True, loss_parallel: bool = True, regather: bool = False
    ) -> None:
        require_positive_int(self, "size", size)
        if regather and not sequence_parallel:
            raise ConfigError(
                f"{option(self, 'regather', regather)} keeps sequence-parallel shards for backward: it needs "
                f"{option(self, 'sequence_parallel', True)} (without SP nothing is gathered)"
            )
        self.size = size
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.regather = regather

    @property
    def active(self) -> bool:
        return self.size > 1

    def mesh_sizes(self) -> dict[str, int | None]:
        return {"tp": self.size}

    def validate(self, dims: ParallelDims, spec: ModelSpec, data: DataShape | None) -> None:
        if self.size > 1 and spec.tp_plan is None:
            raise ConfigError(
                f"{option(self, 'size', self.size)}, but model {spec.name} declares no tensor-parallel plan "
                "(ModelSpec.tp_plan)"
            )
        if data is not None:
            self.validate_sequence(data, folds=folds_moe(spec))

    def validate_with(self, plugins: Sequence[ParallelPlugin]) -> None:
        compiled = [p for p in plugins if type(p).__name__ == "Compile" and getattr(p, "enabled", False)]
        if self.active and self.regather and compiled:
            # (saved-tensor hooks inside a compiled block: "Attempted to call function marked as skipped")
            raise ConfigError(
                f"{option(self, 'regather', True)} cannot run under {compiled[0]!r}: it keeps the sequence shards "
                "for backward through autograd's saved-tensor hooks, which torch.compile cannot trace; valid: "
                f"{option(self, 'regather', False)} with compiled blocks, or compile off"
            )

    def validate_sequence(self, data: DataShape, folds: bool = False) -> None:
        """Sequence parallelism splits the sequence: it must divide by ``tp``; so must MoE parallel folding."""
        if self.size == 1 or data.seq_len % self.size == 0:
            return
        if self.sequence_parallel:
            raise ConfigError(
                f"{data.option('seq_len')} must be divisible by {option(self, 'size', self.size)} with sequence "
                f"parallelism; valid nearby: {nearby_multiples(data.seq_len, self.size)} "
                f"(or {option(self, 'sequence_parallel', False)})"
            )
        if folds:
            raise ConfigError(
                f"{data.option('seq_len')} must be divisible by {option(self, 'size', self.size)}: each tp rank runs "
                f"its share of the sequence through the MoE layers (MoE parallel folding); valid nearby: "
                f"{nearby_multiples(data.seq_len, self.size)}"
            )

    def apply(self, model: nn.Module, layout: Layout) -> nn.Module:
        spec = require_spec(model)
        assert spec.tp_plan is not None
        tp_mesh = layout.mesh["tp"]
        top, block_plans = spec.tp_plan(self.sequence_parallel)
        # A rank may hold only part of the model (a pipeline stage): nothing to shard elsewhere.
        parallelize_module(model, tp_mesh, _styled(top, "", layout.linear_styles, layout.dropped))
        for name, block in model.get_submodule(spec.layers).named_children():
            prefix = f"{spec.layers}.{name}."
            plan = _styled(block_plans[name], prefix, layout.linear_styles, layout.dropped)
            if self.regather:
                plan = {module: regathered(style) for module, style in plan.items()}
            parallelize_module(block, tp_mesh, plan)
            _localise_head_counts(block.get_submodule(spec.attention), self.size)
        layout.step_contexts.append(_AttentionErrors(self, model, spec).explained)
        if folds_moe(spec):
            _fold_moe(model, spec, layout)
        # parallelize_module gives each module a DTensor of its own: tied weights become one again.
        retie(model, layout.tied, by=f"{self!r}'s plan (the spec's tp_plan)")
        if self.loss_parallel:
            # Around the loss AND its backward (torchtitan does the same): cross-entropy on vocab shards.
            layout.step_contexts.append(loss_parallel)
        return model

    @classmethod
    def plan_axes(cls, context: SearchContext) -> tuple[PlanAxis, ...]:
        """Powers of two up to two nodes: the playbook keeps tp inside a node, the planner prices one beyond; the
        sequence shards regathered in backward where the layout without it does not fit."""
        sizes = powers_of_two(min(2 * context.gpus_per_node, context.world_size))
        regather = PlanAxis("regather", (False, True), trades_time_for_memory=True)
        return PlanAxis("tp", sizes, splits_world=True), regather

    @classmethod
    def plan_plugin(cls, point: SearchPoint) -> TensorParallel | None:
        size, sequence_parallel = point.get("tp", 1), point.get("sequence_parallel", True)
        regather = point.get("regather", False)
        if regather and point.searches("regather", True):
            if size == 1 or not sequence_parallel:
                raise NotSearched("regather without sequence parallelism: the layout without it")
            if point.get("recompute") in ("full", "selective_op"):  # (the checkpoint owns what every block saves)
                raise NotSearched("regather under recomputation of every block: the layout without it")
        return cls(size, sequence_parallel=sequence_parallel, regather=regather) if size > 1 else None

    def plan_label(self, dims: ParallelDims) -> str:
        return (
            f"tp{self.size}" + ("" if self.sequence_parallel else "(no sp)") + ("(regather)" if self.regather else "")
        )

    def plan_facts(self, dims: ParallelDims) -> dict[str, Any]:
        return {"tp": self.size, "sequence_parallel": self.sequence_parallel, "regather": self.regather}

    def settings(self) -> dict[str, Any]:
        return {"regather": True} if self.regather else {}

    def plan_cost(self, rank: RankView) -> CostTerms:
        """4 collectives per block (+ embedding, head) of ``t x h`` activations per forward, and the loss's.

        On the critical path (nothing overlaps them in our blocks); behind the GEMMs beside them
        for a stack that overlaps them (``Workload.tp_comm_overlap``). Run again in backward (traced
        by ``benchmarks/plan.py``): a block recomputed whole repeats its forward up to the last tensor
        backward needs (the FFN's down projection), so its all-gathers (SP) and the attention's
        reduce-scatter or all-reduce, not the FFN's; op-level recomputation keeps the reduce-scatters
        (SP) and gathers again, or repeats the attention's all-reduce; ``regather`` gathers the inputs
        again that it kept sharded.
        """
        terms = CostTerms(host="tensor")  # (every op of a block on DTensors)
        terms.hidden_by_matmul = 1.0 if rank.workload.tp_comm_overlap else 0.0
        c, spec = rank.layout, rank.spec
        activation, m = rank.tokens * rank.widths.h * rank.element_bytes, rank.forwards
        # A folded MoE sub-layer (each tp rank its share of the tokens) has none of the FFN's collectives; without
        # SP its output is all-gathered (forward) and its input's gradient too (backward).
        folded = sum(1 for i in rank.layers if spec.is_moe_block(i)) if folds_moe(spec) else 0
        n = 4 * len(rank.layers) - 2 * folded + (1 if rank.first else 0) + (1 if rank.last else 0)
        whole = sum(1 for i in rank.layers if c.recomputes(i))
        # (each collective one activation, one call)
        if self.sequence_parallel:
            gathers = n + sum(map(self._gathered_again(rank), rank.layers))
            terms.add("tp", "all_gather", gathers * activation * m, calls=gathers * m)
            terms.add("tp", "reduce_scatter", (n + whole) * activation * m, calls=(n + whole) * m)
        else:
            again = whole + (len(rank.layers) if c.recompute == "selective_op" else 0)
            terms.add("tp", "all_reduce", (n + again) * activation * m, calls=(n + again) * m)
            terms.add("tp", "all_gather", 2 * folded * activation * m, calls=2 * folded * m)
        if rank.last:  # loss parallelism: the target logit, max and sum of exponentials of every token, in fp32
            terms.add("tp", "all_reduce", 3 * 4 * rank.tokens * m, calls=3 * m)
        return terms

    def _gathered_again(self, rank: RankView) -> Callable[[int], int]:
        """How many of block ``i``'s sequence-parallel all-gathers run again in backward."""
        c, spec = rank.layout, rank.spec

        def again(i: int) -> int:
            moe = spec.is_moe_block(i)
            if c.recomputes(i) or c.recompute == "selective_op":
                return 1 if moe and folds_moe(spec) else 2  # (a folded MoE gathers nothing)
            return gathered_inputs(spec, i) if self.regather else 0

        return again

    def plan_shards(self, model: nn.Module, plan: ShardPlan) -> None:
        key = ("tp-shards", id(model), self.sequence_parallel)
        for full, dim in memoized(key, lambda: self._shards(model)):
            if full in plan.shapes:
                plan.shard(full, dim, "tp")
        spec = require_spec(model)
        if folds_moe(spec):  # (as _fold_moe: a folded MoE's own parameters reduce over dp x cp x tp)
            prefixes = tuple(f"{spec.layers}.{block}.{spec.moe}." for block in spec.moe_blocks)
            for name in plan.shapes:
                if name.startswith(prefixes) and name not in plan.groups:
                    plan.groups[name] = (*DATA_DIMS, "tp")

    def plan_shards_key(self) -> Hashable:
        """The shards depend on the size and the plan (SP changes the norms' styles), not on ``regather``."""
        return self.size, self.sequence_parallel

    def _shards(self, model: nn.Module) -> list[tuple[str, int]]:
        """Every parameter the plan splits, with its split dim."""
        spec = require_spec(model)
        assert spec.tp_plan is not None
        top, block_plans = spec.tp_plan(self.sequence_parallel)
        plans = [("", top)] + [(f"{spec.layers}.{name}.", p) for name, p in block_plans.items()]
        out = []
        for prefix, module_plan in plans:
            for name, style in module_plan.items():
                for param, dim in _sharded_dims(model.get_submodule(prefix + name), style).items():
                    out.append((f"{prefix}{name}.{param}", dim))
        return out


def gathered_inputs(spec: ModelSpec, layer: int) -> int:
    """Sub-layer inputs of block ``layer`` that sequence parallelism all-gathers: attention's, and a dense
    feed-forward's (an MoE feed-forward runs sequence shards when folded, its own gather when not)."""
    return 1 if spec.is_moe_block(layer) else 2


def folds_moe(spec: ModelSpec) -> bool:
    """Whether the model's MoE layers run each tp rank's share of the tokens (``ModelSpec.moe_folds_tp``)."""
    return bool(spec.moe_blocks) and spec.moe_folds_tp


def _fold_moe(model: nn.Module, spec: ModelSpec, layout: Layout) -> None:
    """Tell each MoE layer held its tp share and the ``cp x tp`` ranks of a sequence; reduce the gradients of its
    parameters that no other group claims (router, shared experts; the experts without expert parallelism) over
    ``dp x cp x tp``: each tp rank's are those of its own tokens."""
    tp_mesh, sequence = layout.mesh["tp"], layout.mesh.over(("cp", "tp"))
    names, layers = set(), model.get_submodule(spec.layers)
    for block in spec.moe_blocks:
        prefix = f"{spec.layers}.{block}.{spec.moe}"
        if str(block) not in layers:
            continue  # another pipeline stage's block
        moe = model.get_submodule(prefix)
        if not declares(moe, SharesTokens):
            raise ContractError(
                f"{prefix} is a {type(moe).__name__} without share_tokens(parts, part, group), but model {spec.name} "
                "declares moe_folds_tp (each tp rank runs its share of the tokens): implement SharesTokens or set "
                "ModelSpec.moe_folds_tp=False"
            )
        moe.share_tokens(tp_mesh.size(), tp_mesh.get_local_rank(), sequence.get_group())
        names |= {f"{prefix}.{name}" for name, _ in moe.named_parameters()}
    claimed = {n for group in layout.gradient_groups if group.params is not None for n in group.params}
    layout.declare_gradient_group("moe_tokens", (*DATA_DIMS, "tp"), names - claimed)


#: Head-count attributes of an attention module that reshapes by them (the model contract):
#: under TP a rank holds ``1/tp`` of the heads, so they become the rank's own counts.
HEAD_COUNTS = ("n_heads", "n_kv_heads", "num_heads", "num_key_value_heads")


def _localise_head_counts(attention: nn.Module, tp: int) -> None:
    for name in HEAD_COUNTS:
        count = getattr(attention, name, None)
        if isinstance(count, int) and not isinstance(count, bool):
            setattr(attention, name, count // tp)  # (ParallelDims checked that tp divides the heads)


def _sharded_dims(module: nn.Module, style: ParallelStyle) -> dict[str, int]:
    """The dim of each parameter of ``module`` that ``style`` shards (DTensor ``Shard(dim)``); others replicate.

    Column-parallel splits a linear's outputs (weight rows, bias) and an embedding's features;
    row-parallel a linear's inputs and an embedding's vocabulary (torch's parallel styles).
    """
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return {"weight": 1} if embedding else {"weight": 0, "bias": 0}
    if isinstance(style, RowwiseParallel):
        return {"weight": 0} if embedding else {"weight": 1}
    return {}


def _styled(
    plan: Mapping[str, ParallelStyle], prefix: str, styles: Mapping[str, str], dropped: set[str]
) -> dict[str, ParallelStyle]:
    """``plan`` without the modules this rank does not hold, each linear in the style that fits its kind."""
    out: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        full = prefix + name
        if full in dropped:
            continue
        kind = styles.get(full)
        if kind is not None:
            if kind not in LINEAR_STYLES:
                raise ConfigError(
                    f"module {full} is a {kind!r} linear, and TensorParallel has no parallel style for that kind; "
                    f"known kinds: {', '.join(LINEAR_STYLES) or 'none'} (register one in tensor.LINEAR_STYLES)"
                )
            style = LINEAR_STYLES[kind](style)
        out[name] = style
    return out


class _AttentionErrors:
    """Until a step has run, turns an error raised inside an attention module into one saying what TP needs.

    A model written for one device reshapes by the whole model's head count or width, or splits a
    fused q/k/v projection, and under TP fails with a raw shape or unpack error from its own code.
    The traceback names the attention that raised: the frame of its ``forward`` (its ``self``).
    No hooks: a hook with a per-block constant would make a compiled block recompile once per block.
    """

    def __init__(self, plugin: TensorParallel, model: nn.Module, spec: ModelSpec) -> None:
        self.plugin, self.armed = plugin, True
        blocks = model.get_submodule(spec.layers).named_children()
        self.names = {
            id(block.get_submodule(spec.attention)): f"{spec.layers}.{name}.{spec.attention}" for name, block in blocks
        }

    def _raised_in(self, err: BaseException) -> str | None:
        where = None
        for frame, _ in traceback.walk_tb(err.__traceback__):
            where = self.names.get(id(frame.f_locals.get("self")), where)
        return where

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        if not self.armed:
            yield
            return
        try:
            yield
        except (RuntimeError, ValueError) as err:
            inside = self._raised_in(err)
            if inside is None:
                raise
            tp = self.plugin.size
            raise ContractError(
                f"{inside} raised under {self.plugin!r}: {type(err).__name__}: {str(err).splitlines()[0]}. "
                f"Each of the tp={tp} ranks holds 1/{tp} of the heads: its q, k and v projections give "
                f"1/{tp} of their width. Reshape by the projections' outputs (view(b, s, -1, head_dim)) or keep "
                "the counts as n_heads / n_kv_heads attributes (set to each rank's own), never by the model's "
                "width or head count; and split a fused q/k/v projection into three Linears (a column shard of "
                "one fused matrix holds parts of q and of k). docs/models.md, 'Your own model'"
            ) from err
        self.armed = False
