"""ExpertParallel: the playbook's fifth dimension, MoE experts split over ``ep`` ranks.

The ``ep`` ranks are borrowed from the data-parallel ones (``dp_replicate x dp_shard x cp``, inner
ranks first, as torchtitan borrows ``dp_shard x cp``), and from the tensor-parallel ones where the
model's MoE layers fold over them (``ModelSpec.moe_folds_tp``, Megatron's MoE parallel folding: each
tp rank runs its share of the tokens, so ``ep`` divides ``dp x cp x tp``, tp innermost): no extra
GPUs. Each rank of an ``ep`` group holds ``E / ep`` of every MoE layer's experts, as one ``Shard(0)``
DTensor per stacked weight (one global expert dim, so checkpoints reshard to any ``ep``), and reads
its own tokens as before; the MoE layer's dispatcher sends each token to the rank of its expert and
back (``comms.py``).

The flattened ranks (``dp_cp``, or ``dp_cp x tp`` folded) are unflattened into ``(edp, ep)``: ``edp``
are the ranks that hold the same experts. The experts' gradients average over ``edp`` (a gradient
group in the Layout, so every ZeRO stage applies to them: FSDP2 shards them over ``edp`` under stage
3), the rest over ``dp x cp`` as before (a folded MoE's router and shared experts over ``dp x cp x
tp``: ``TensorParallel``'s ``moe_tokens`` group). Dense blocks are ordinary parameters.

Tensor parallelism does not split experts (see ``llama_tp_plan``): folded, every tp rank routes its
own tokens and the ``ep`` groups hold whole tp groups (or parts of one); a model whose MoE layers do
not fold (transformers' under ``model=hf``) routes the same tokens on every tp rank, and its ``ep``
groups are made of ranks with the same tp coordinate.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_ultrascale.errors import ConfigError, option, require_positive_int
from lightning_ultrascale.models.common.moe import GroupedExperts
from lightning_ultrascale.models.spec import ModelSpec, require_spec
from lightning_ultrascale.parallel.dims import DATA_DIMS, DataShape, ParallelDims
from lightning_ultrascale.parallel.expert.comms import AllToAllDispatcher, PlacedDispatcher
from lightning_ultrascale.parallel.layout import Layout, ShardPlan
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.parallel.pricing import (
    CostTerms,
    NotSearched,
    PlanAxis,
    RankView,
    SearchContext,
    SearchPoint,
    moe_fold,
    powers_of_two,
)


class ExpertParallel(ParallelPlugin):
    """Split every MoE layer's experts over ``size`` data-parallel ranks; tokens travel by all-to-all.

    Args:
        size: expert-parallel degree ``ep``; must divide the model's routed experts and the
            data-parallel ranks ``dp_replicate x dp_shard x cp`` (times ``tp`` where the MoE layers fold).
        redundant_experts: ``R`` extra expert slots per MoE block (EPLB's redundant experts: the hottest
            experts replicated, each replica running part of the expert's rows); ``E + R`` must split
            evenly over the ``size`` ranks.
        rebalance_every: re-place the experts every this many optimizer steps from the loads they measured
            (EPLB's placement, :mod:`~lightning_ultrascale.parallel.expert.placement`); ``None``: never
            (with ``redundant_experts``, experts ``0 .. R-1`` are the replicated ones).

    With either set, each forward sends every slot its expert's weights and backward sends their gradients
    back (:class:`~lightning_ultrascale.parallel.expert.comms.PlacedDispatcher`): parameters, optimizer state
    and checkpoints stay as without a placement, and training computes the same.

    Example:
        >>> from lightning_ultrascale import ExpertParallel, UltraScaleStrategy, ZeRO
        >>> strategy = UltraScaleStrategy(ExpertParallel(4), ZeRO(stage=3))
        >>> balanced = ExpertParallel(4, redundant_experts=4, rebalance_every=100)
    """

    applies_at = "expert"
    plan_order = 40
    plan_names = ("ep",)

    def __init__(self, size: int, redundant_experts: int = 0, rebalance_every: int | None = None) -> None:
        require_positive_int(self, "size", size)
        if not (isinstance(redundant_experts, int) and redundant_experts >= 0):
            raise ConfigError(
                f"{option(self, 'redundant_experts', redundant_experts)} must be an integer >= 0 (extra expert "
                "slots per MoE block; 0: none)"
            )
        if rebalance_every is not None:
            require_positive_int(self, "rebalance_every", rebalance_every)
        placed = redundant_experts > 0 or rebalance_every is not None
        if placed and size == 1:
            raise ConfigError(
                f"{option(self, 'redundant_experts', redundant_experts)} and "
                f"{option(self, 'rebalance_every', rebalance_every)} place experts over expert-parallel ranks, but "
                f"{option(self, 'size', size)} has one; valid: size > 1, or redundant_experts=0 and "
                "rebalance_every=None"
            )
        self.size = size
        self.redundant_experts = redundant_experts
        self.rebalance_every = rebalance_every

    @property
    def active(self) -> bool:
        return self.size > 1

    def mesh_sizes(self) -> dict[str, int | None]:
        return {"ep": self.size}

    def validate(self, dims: ParallelDims, spec: ModelSpec, data: DataShape | None) -> None:
        if self.size > 1 and not spec.moe_blocks:
            raise ConfigError(
                f"{option(self, 'size', self.size)} splits MoE experts, but model {spec.name} has none; "
                "use an MoE model (e.g. model=moe_tiny) or size 1"
            )
        if self.placed and not spec.expert_placement:
            raise ConfigError(
                f"{option(self, 'redundant_experts', self.redundant_experts)} / "
                f"{option(self, 'rebalance_every', self.rebalance_every)}: model {spec.name}'s experts run on their "
                "own parameters only (an expert placement sends slots their weights: our Llama, Mixtral and "
                "DeepSeek models' GroupedExperts; not transformers' experts); valid: redundant_experts=0 and "
                "rebalance_every=None"
            )
        slots = spec.n_experts + self.redundant_experts
        if self.size > 1 and self.redundant_experts and slots % self.size:
            valid = [r for r in range(1, 2 * self.size + 1) if (spec.n_experts + r) % self.size == 0][:2]
            raise ConfigError(
                f"{option(self, 'redundant_experts', self.redundant_experts)}: model {spec.name}'s "
                f"{spec.n_experts} experts + {self.redundant_experts} slots do not split evenly over "
                f"{option(self, 'size', self.size)} ranks; valid: {', '.join(map(str, valid))}, ... (multiples of "
                f"{self.size} where it divides the experts)"
            )

    @property
    def placed(self) -> bool:
        """Experts run on a placement (:class:`PlacedDispatcher`) rather than where their parameters are."""
        return self.size > 1 and (self.redundant_experts > 0 or self.rebalance_every is not None)

    def settings(self) -> dict[str, Any]:
        return (
            {"redundant_experts": self.redundant_experts, "rebalance_every": self.rebalance_every}
            if self.placed
            else {}
        )

    @classmethod
    def plan_axes(cls, context: SearchContext) -> tuple[PlanAxis, ...]:
        """Powers of two up to the routed experts of a block (1 alone for a dense model)."""
        sizes = powers_of_two(min(context.n_experts, context.world_size)) if context.n_experts else (1,)
        return (PlanAxis("ep", sizes),)

    @classmethod
    def plan_plugin(cls, point: SearchPoint) -> ExpertParallel | None:
        size = point.get("ep", 1)
        if size == 1:
            return None
        # (expert ranks are borrowed from the data and context ones, and the tensor ones where MoE layers fold)
        borrowed = point.dp * point.get("cp", 1)
        folds = point.context is not None and point.context.moe_folds_tp
        borrowed *= point.get("tp", 1) if folds else 1
        if point.context is not None and borrowed % size:
            raise NotSearched(f"ep={size} does not divide the {borrowed} data x context{' x tensor' * folds} ranks")
        return cls(size)

    def plan_label(self, dims: ParallelDims) -> str:
        return f"ep{self.size}" if self.size > 1 else ""

    def plan_facts(self, dims: ParallelDims) -> dict[str, Any]:
        return {"ep": self.size}

    def plan_cost(self, rank: RankView) -> CostTerms:
        """Dispatch and combine forward, their reverses backward, of every routed row (uniform routing)."""
        terms = CostTerms(host="expert")
        terms.hidden_by_matmul = 1.0 if rank.workload.ep_comm_overlap else 0.0  # (a stack's, not ours)
        spec = rank.spec
        if not spec.moe_blocks:
            return terms
        moe_layers = sum(1 for i in rank.layers if spec.is_moe_block(i))
        # (folded over tp, a rank routes its share of the tokens)
        rows = rank.tokens / moe_fold(spec, rank.widths) * spec.top_k * rank.widths.h * rank.element_bytes
        # (+ the split sizes: one count per expert each way)
        payload = (4 * rows + 8 * spec.n_experts) * moe_layers * rank.forwards
        if self.placed:
            # A placement: each forward sends every slot its expert's weights, backward their gradients back;
            # the slots' weights and gradients live through the layer's forward and backward.
            slots = (spec.n_experts + self.redundant_experts) // self.size
            weights = slots * 3 * rank.widths.h * spec.expert_ffn_dim * rank.element_bytes
            payload += 2 * weights * moe_layers * rank.forwards
            terms.working += 2 * weights
        # (a call for each of the four, and one for the split sizes of a forward)
        terms.add("ep", "all_to_all", payload, calls=(5 + (2 if self.placed else 0)) * moe_layers * rank.forwards)
        return terms

    def apply(self, model: nn.Module, layout: Layout) -> nn.Module:
        spec = require_spec(model)
        data = layout.mesh.over(self.borrowed(layout.dims.tp, spec))
        meshes = data._unflatten(0, (data.size() // self.size, self.size), ("edp", "ep"))
        ep_mesh = meshes["ep"]
        layout.mesh.add("ep", ep_mesh)
        layout.mesh.add("edp", meshes["edp"])
        group = ep_mesh.get_group()
        nodes = _nodes(group) if self.placed else 1  # (one collective, for every block)
        layers = model.get_submodule(spec.layers)
        names = set()
        for block in spec.moe_blocks:
            if str(block) not in layers:
                continue  # another pipeline stage's block
            prefix = f"{spec.layers}.{block}.{spec.moe}"
            moe = model.get_submodule(prefix)
            for name, param in list(moe.experts.named_parameters(recurse=False)):
                sharded = nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)]), param.requires_grad)
                moe.experts.register_parameter(name, sharded)
                names.add(f"{prefix}.experts.{name}")
            # One dispatcher a block: each counts the rows its experts received (and holds its placement).
            moe.dispatcher = (
                self._placed_dispatcher(moe, prefix, group, nodes, spec) if self.placed else AllToAllDispatcher(group)
            )
        layout.declare_gradient_group("experts", ("edp",), names)
        return model

    @staticmethod
    def borrowed(tp: int, spec: ModelSpec) -> tuple[str, ...]:
        """The mesh dims the ``ep`` ranks come from (flattened, ``ep`` innermost): the data dims, and ``tp``
        where the model's MoE layers fold over its ``tp`` ranks."""
        return (*DATA_DIMS, "tp") if tp > 1 and spec.moe_folds_tp else DATA_DIMS

    def _placed_dispatcher(
        self, moe: nn.Module, name: str, group: Any, nodes: int, spec: ModelSpec
    ) -> PlacedDispatcher:
        if not isinstance(moe.experts, GroupedExperts):
            raise ConfigError(
                f"{option(self, 'redundant_experts', self.redundant_experts)} / "
                f"{option(self, 'rebalance_every', self.rebalance_every)}: {name}.experts is a "
                f"{type(moe.experts).__name__}, and an expert placement sends slots the weights of GroupedExperts "
                "(our Llama, Mixtral and DeepSeek models); valid: redundant_experts=0 and rebalance_every=None"
            )
        groups = getattr(getattr(moe, "cfg", None), "n_group", 1)
        return PlacedDispatcher(group, spec.n_experts, self.redundant_experts, self.rebalance_every, nodes, groups)

    def plan_shards(self, model: nn.Module, plan: ShardPlan) -> None:
        # dp_cp (x tp), flattened row-major, unflattened into (edp, ep): ep the inner one (as in apply).
        spec = require_spec(model)
        n_data, data = plan.flat(self.borrowed(plan.sizes.get("tp", 1), spec))
        plan.sizes |= {"ep": self.size, "edp": n_data // self.size}
        plan.coordinate |= {"ep": data % self.size, "edp": data // self.size}
        for block in spec.moe_blocks:
            prefix = f"{spec.layers}.{block}.{spec.moe}.experts."
            for name in [n for n in plan.shapes if n.startswith(prefix) and "." not in n[len(prefix) :]]:
                plan.shard(name, 0, "ep")
                plan.groups[name] = ("edp",)


def _node() -> str:
    """This process's node: torchrun's ``GROUP_RANK``, SLURM's ``SLURM_NODEID``, else the host name."""
    for variable in ("GROUP_RANK", "SLURM_NODEID"):
        if variable in os.environ:
            return f"{variable}={os.environ[variable]}"
    return socket.gethostname()


def _nodes(group: Any) -> int:
    """How many nodes the expert-parallel ``group`` spans, where each holds the same number of its ranks in order
    (ranks ``n ep/nodes ..`` on node ``n``: a hierarchical placement packs them so); otherwise 1 (global)."""
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, _node(), group=group)
    names = list(dict.fromkeys(hosts))
    per_node = len(hosts) // len(names)
    in_order = hosts == [name for name in names for _ in range(per_node)]
    return len(names) if in_order else 1
