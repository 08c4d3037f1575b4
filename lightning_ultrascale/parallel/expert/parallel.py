"""ExpertParallel: the playbook's fifth dimension, MoE experts split over ``ep`` ranks.

The ``ep`` ranks are borrowed from the data-parallel ones (``dp_replicate x dp_shard x cp``, inner
ranks first, as torchtitan borrows ``dp_shard x cp``): no extra GPUs. Each rank of an ``ep`` group
holds ``E / ep`` of every MoE layer's experts, as one ``Shard(0)`` DTensor per stacked weight (one
global expert dim, so checkpoints reshard to any ``ep``), and reads its own tokens as before; the
MoE layer's dispatcher sends each token to the rank of its expert and back (``comms.py``).

The flattened data ranks ``dp_cp`` are unflattened into ``(edp, ep)``: ``edp`` are the ranks that
hold the same experts. The experts' gradients average over ``edp`` (a gradient group in the
Layout, so every ZeRO stage applies to them: FSDP2 shards them over ``edp`` under stage 3), the
rest over ``dp x cp`` as before. Router, shared experts and dense blocks are ordinary parameters.

Tensor parallelism does not split experts (see ``llama_tp_plan``): every tp rank routes the same
tokens, and the ``ep`` groups are made of ranks with the same tp coordinate.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_ultrascale.errors import ConfigError, option, require_positive_int
from lightning_ultrascale.models.spec import ModelSpec, require_spec
from lightning_ultrascale.parallel.dims import DATA_DIMS, DataShape, ParallelDims
from lightning_ultrascale.parallel.expert.comms import AllToAllDispatcher
from lightning_ultrascale.parallel.layout import Layout, ShardPlan
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.parallel.pricing import (
    CostTerms,
    NotSearched,
    PlanAxis,
    RankView,
    SearchContext,
    SearchPoint,
    add_traffic,
    powers_of_two,
)


class ExpertParallel(ParallelPlugin):
    """Split every MoE layer's experts over ``size`` data-parallel ranks; tokens travel by all-to-all.

    Args:
        size: expert-parallel degree ``ep``; must divide the model's routed experts and the
            data-parallel ranks ``dp_replicate x dp_shard x cp``.

    Example:
        >>> from lightning_ultrascale import ExpertParallel, UltraScaleStrategy, ZeRO
        >>> strategy = UltraScaleStrategy(ExpertParallel(4), ZeRO(stage=3))
    """

    applies_at = "expert"
    plan_order = 40
    plan_names = ("ep",)

    def __init__(self, size: int) -> None:
        require_positive_int(self, "size", size)
        self.size = size

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
        borrowed = point.dp * point.get("cp", 1)  # (expert ranks are borrowed from the data and context ones)
        if point.context is not None and borrowed % size:
            raise NotSearched(f"ep={size} does not divide the {borrowed} data x context ranks")
        return cls(size)

    def plan_label(self, dims: ParallelDims) -> str:
        return f"ep{self.size}" if self.size > 1 else ""

    def plan_facts(self, dims: ParallelDims) -> dict[str, Any]:
        return {"ep": self.size}

    def plan_cost(self, rank: RankView) -> CostTerms:
        """Dispatch and combine forward, their reverses backward, of every routed row (uniform routing)."""
        terms = CostTerms(host="expert")
        spec = rank.spec
        if not spec.moe_blocks:
            return terms
        moe_layers = sum(1 for i in rank.layers if spec.is_moe_block(i))
        rows = rank.tokens * spec.top_k * rank.widths.h * rank.element_bytes
        # (+ the split sizes: one count per expert each way)
        payload = (4 * rows + 8 * spec.n_experts) * moe_layers * rank.forwards
        add_traffic(terms.traffic, "ep", "all_to_all", payload)
        return terms

    def apply(self, model: nn.Module, layout: Layout) -> nn.Module:
        spec = require_spec(model)
        data = layout.mesh["dp_cp"]
        meshes = data._unflatten(0, (data.size() // self.size, self.size), ("edp", "ep"))
        ep_mesh = meshes["ep"]
        layout.mesh.add("ep", ep_mesh)
        layout.mesh.add("edp", meshes["edp"])
        dispatcher = AllToAllDispatcher(ep_mesh.get_group())
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
            moe.dispatcher = dispatcher
        layout.declare_gradient_group("experts", ("edp",), names)
        return model

    def plan_shards(self, model: nn.Module, plan: ShardPlan) -> None:
        # dp_cp, flattened row-major, unflattened into (edp, ep): ep the inner one (as in apply).
        n_data, data = plan.flat(DATA_DIMS)
        plan.sizes |= {"ep": self.size, "edp": n_data // self.size}
        plan.coordinate |= {"ep": data % self.size, "edp": data // self.size}
        spec = require_spec(model)
        for block in spec.moe_blocks:
            prefix = f"{spec.layers}.{block}.{spec.moe}.experts."
            for name in [n for n in plan.shapes if n.startswith(prefix) and "." not in n[len(prefix) :]]:
                plan.shard(name, 0, "ep")
                plan.groups[name] = ("edp",)
