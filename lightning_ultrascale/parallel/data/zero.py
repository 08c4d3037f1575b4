"""ZeRO: the playbook's data parallelism with optimizer states, gradients and parameters sharded.

One plugin, one number (Ψ parameters, N data-parallel ranks, k bytes of optimizer state per
parameter: k=12 for Adam in mixed precision, 8 in fp32; the 2Ψ terms are 4Ψ in fp32):

=========  =========================================  ==========================================
stage      model-state memory per rank                traffic per step and rank
=========  =========================================  ==========================================
0 (DP)     2Ψ + 2Ψ + kΨ                               all-reduce of grads: 2Ψ(N-1)/N
1          2Ψ + 2Ψ + kΨ/N                             reduce-scatter grads + all-gather params: 2Ψ
2          2Ψ + (2Ψ + kΨ)/N                           the same 2Ψ
3 (FSDP)   (2Ψ + 2Ψ + kΨ)/N                           all-gather params twice + reduce-scatter: 3Ψ
=========  =========================================  ==========================================

Under ``bf16-mixed`` stages 0-2 hold bf16 weights on the device and the fp32 master copy in the
optimizer state (whole at stage 0, 1/N at stages 1-2: ``master.py``), as the table counts them;
``utils.memory.layout_model_state_bytes`` gives the bytes every precision and ``reduce_dtype`` hold.

Stage 0 uses our bucketed all-reduce (``buckets.py``), stages 1 and 2 our sharded optimizer
(``sharded_optimizer.py``): FSDP2 has neither. Stage 3 is FSDP2 ``fully_shard`` per transformer block
and at the root, over ``dp_shard``, or over ``dp_replicate x dp_shard`` for HSDP (shard inside a
group, replicate across groups). Each runs as one engine per gradient group of the Layout
(``engines.py``): parameters that average over other data ranks (experts) get an engine of
their own. The playbook's guidance: ZeRO-2 is the usual sweet spot (same traffic as DP, most of
the memory saved); ZeRO-3 for models whose parameters do not fit.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from torch import nn

from lightning_ultrascale.errors import ConfigError, is_positive_int, option, require_positive_int
from lightning_ultrascale.models.spec import ModelSpec
from lightning_ultrascale.parallel.data.engines import (
    REDUCE_DTYPES,
    AllReduceEngine,
    FSDPEngine,
    GradientSync,
    ShardedOptimizerEngine,
    fsdp_shard_dim,
)
from lightning_ultrascale.parallel.data.pricing import data_parallel_cost
from lightning_ultrascale.parallel.dims import DATA_DIMS, DataShape, ParallelDims
from lightning_ultrascale.parallel.layout import GradientGroup, Layout, ShardPlan
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.parallel.pricing import (
    CostTerms,
    NotSearched,
    PlanAxis,
    RankView,
    SearchContext,
    SearchPoint,
)

STAGES = (0, 1, 2, 3)


class ZeRO(ParallelPlugin):
    """Data parallelism with ZeRO stage 0, 1, 2 or 3 (FSDP), and HSDP.

    Args:
        stage: 0 plain DP, 1 shard optimizer states, 2 also gradients, 3 also parameters.
        size: ranks that shard (stages 1-3) or replicate (stage 0) the model; ``None`` takes the
            ranks the other plugins leave.
        replicate: stage 3 only: HSDP replica groups; the model is sharded inside each group of
            ``size`` ranks and replicated across ``replicate`` groups.
        bucket_mb: gradient bucket size (stages 0-2), MiB.
        reshard_after_forward: stage 3: free gathered parameters after each block's forward (and
            gather them again for backward: 3Ψ traffic), or keep them until backward (2Ψ, more
            memory: the ZeRO-2-like point of FSDP). Default (``None``): free them, except where a
            part of the model runs several forwards per step (pipeline microbatches), which
            would gather its parameters again for every one of them (torchtitan's default too).
        reduce_dtype: dtype of gradient reduction under bf16 parameters, every stage:
            ``"fp32"`` (default) or ``"bf16"`` (half the bytes on the wire). Under
            ``bf16-mixed``, stages 0-2: fp32 keeps fp32 gradient buckets that accumulate
            micro-steps and are the master weights' gradients (Megatron's main gradients, its
            default for bf16: 4 bytes per parameter, whole at stages 0-1, /N at stage 2); bf16
            keeps bf16 buckets (the playbook's 2 bytes) and copies the reduced gradient to fp32
            for the optimizer step. Stage 3: FSDP2's reduce-scatter dtype.

    Example:
        >>> from lightning_ultrascale import UltraScaleStrategy, ZeRO
        >>> strategy = UltraScaleStrategy(ZeRO(stage=3))               # FSDP over all ranks
        >>> strategy = UltraScaleStrategy(ZeRO(stage=3, replicate=2))  # HSDP: 2 groups x N/2 shards
    """

    applies_at = "data"
    plan_order = 0
    plan_names = ("zero", "hsdp", "replicate", "reduce_dtype")

    def __init__(
        self,
        stage: int = 2,
        size: int | None = None,
        replicate: int = 1,
        bucket_mb: float = 25.0,
        reshard_after_forward: bool | None = None,
        reduce_dtype: str = "fp32",
    ) -> None:
        if stage not in STAGES:
            raise ConfigError(f"{option(self, 'stage', stage)} is not a ZeRO stage; valid: 0, 1, 2, 3")
        if size is not None and not is_positive_int(size):
            raise ConfigError(f"{option(self, 'size', size)} must be a positive integer or None (inferred)")
        require_positive_int(self, "replicate", replicate)
        if replicate > 1 and stage != 3:
            raise ConfigError(
                f"{option(self, 'replicate', replicate)} (HSDP) needs {option(self, 'stage', 3)}, got {stage}; "
                "for stages 0-2 every data-parallel rank already holds the whole model"
            )
        if not bucket_mb > 0:
            raise ConfigError(f"{option(self, 'bucket_mb', bucket_mb)} must be > 0 (DDP's default is 25)")
        if reduce_dtype not in REDUCE_DTYPES:
            raise ConfigError(f"{option(self, 'reduce_dtype', reduce_dtype)}; valid: {', '.join(REDUCE_DTYPES)}")
        self.stage = stage
        self.size = size
        self.replicate = replicate
        self.bucket_mb = bucket_mb
        self.reshard_after_forward = reshard_after_forward
        self.reduce_dtype = reduce_dtype

    def mesh_sizes(self) -> dict[str, int | None]:
        if self.stage == 0:
            return {"dp_replicate": self.size}
        if self.stage == 3:
            return {"dp_replicate": self.replicate, "dp_shard": self.size}
        return {"dp_shard": self.size}

    def size_arg(self, dim: str) -> str:
        return "replicate" if self.stage == 3 and dim == "dp_replicate" else "size"

    def settings(self) -> dict[str, Any]:
        return {"stage": self.stage}

    @classmethod
    def plan_axes(cls, context: SearchContext) -> tuple[PlanAxis, ...]:
        """Stages 0-3 (each shards more and moves as much or more), and HSDP with a node-local shard group."""
        return PlanAxis("zero", STAGES, trades_time_for_memory=True), PlanAxis("hsdp", (False, True))

    @classmethod
    def plan_plugin(cls, point: SearchPoint) -> ZeRO:
        """Stage ``zero`` over the ``dp`` ranks; in a search, ZeRO-0 only where ZeRO-1 is not tried or
        shards nothing (it moves ZeRO-1's bytes and keeps more), HSDP replicas only at stage 3."""
        stage = point.get("zero")
        sharding = point.dp * point.get("cp", 1)  # (context-parallel ranks share the shards)
        if point.axes and stage != 0 and sharding == 1:
            raise NotSearched(f"ZeRO stage {stage} on one data rank shards nothing")
        if stage == 0 and sharding > 1 and point.searches("zero", 1):
            raise NotSearched("ZeRO-0 moves ZeRO-1's bytes and keeps more")
        replicate = point.get("replicate") or cls._hsdp_replicas(point, stage)
        reduce_dtype = point.get("reduce_dtype") or (point.context.workload.reduce_dtype if point.context else "fp32")
        chosen = {} if stage is None else {"stage": stage}  # (None: the plugin's own default)
        return cls(**chosen, size=point.dp // replicate, replicate=replicate, reduce_dtype=reduce_dtype)

    @staticmethod
    def _hsdp_replicas(point: SearchPoint, stage: int | None) -> int:
        """Replica groups of a searched HSDP layout: one shard group per node's data ranks."""
        if not point.get("hsdp", False):
            return 1
        if stage != 3:
            if point.searches("hsdp", False):
                raise NotSearched("HSDP needs ZeRO stage 3")  # (the same layout as hsdp=False)
            return 1
        assert point.context is not None
        per_node = max(1, point.context.gpus_per_node // (point.get("tp", 1) * point.get("cp", 1)))
        if point.dp <= per_node or point.dp % per_node:
            raise NotSearched(f"HSDP needs whole groups of {per_node} node-local data ranks")
        return point.dp // per_node

    def plan_label(self, dims: ParallelDims) -> str:
        hsdp = f" hsdp{self.replicate}" if self.stage == 3 and self.replicate > 1 else ""
        return f"dp{dims.dp_replicate * dims.dp_shard} zero{self.stage}{hsdp}"

    def plan_splits(self, dims: ParallelDims) -> int:
        return int(dims.dp > 1) + int(self.stage == 3)

    def plan_shards_key(self) -> tuple[Any, ...]:
        return self.stage == 3, self.size, self.replicate

    def plan_facts(self, dims: ParallelDims) -> dict[str, Any]:
        replicate = dims.dp_replicate if self.stage == 3 else 1
        return {"dp": dims.dp_replicate * dims.dp_shard, "zero": self.stage, "replicate": replicate,
                "reduce_dtype": self.reduce_dtype}  # fmt: skip

    def plan_cost(self, rank: RankView) -> CostTerms:
        return data_parallel_cost(rank, self.stage, self.reduce_dtype, int(self.bucket_mb * 2**20))

    def validate(self, dims: ParallelDims, spec: ModelSpec, data: DataShape | None) -> None:
        if self.stage in (1, 2) and dims.dp_shard * dims.cp == 1:  # (context-parallel ranks share the shards)
            warnings.warn(
                f"ZeRO stage {self.stage} with one data-parallel rank shards nothing; it runs as plain training",
                stacklevel=2,
            )

    def apply(self, model: nn.Module, layout: Layout) -> nn.Module:
        # Other groups first: FSDP2 shards their modules before the blocks that contain them.
        for group in layout.gradient_groups:
            layout.grad_syncs.append(self._engine(group, layout, model))
        return model

    def plan_shards(self, model: nn.Module, plan: ShardPlan) -> None:
        if self.stage != 3:  # stages 0-2 keep every parameter whole (they shard optimizer states, gradients)
            return
        for name in plan.shapes:
            # FSDP2 cuts dim 0 of each (already tensor- or expert-sharded) parameter over its group's
            # ranks but dp_replicate (HSDP replicates across it); a group's own parameters (experts)
            # dim 1 where dim 0 is too short: see FSDPEngine.
            dims = tuple(d for d in plan.groups.get(name, DATA_DIMS) if d != "dp_replicate")
            ranks = math.prod(plan.sizes[d] for d in dims)
            dim = fsdp_shard_dim(plan.shapes[name], ranks) if name in plan.groups else 0
            plan.shard(name, dim, dims)

    def _engine(self, group: GradientGroup, layout: Layout, model: nn.Module) -> GradientSync:
        bucket_bytes = int(self.bucket_mb * 2**20)
        if self.stage == 0:
            return AllReduceEngine(group, layout, bucket_bytes, self.reduce_dtype)
        if self.stage == 3:
            return FSDPEngine(group, layout, model, self.replicate, self.reshard_after_forward, self.reduce_dtype)
        return ShardedOptimizerEngine(group, layout, bucket_bytes, self.stage, self.reduce_dtype)


class DataParallel(ZeRO):
    """Plain data parallelism over the ``dp_replicate`` mesh dim (``ZeRO(stage=0)``).

    Every rank of ``dp_replicate`` holds the whole model and reads its own slice of the global
    batch; gradients are averaged over the data dims by a bucketed all-reduce overlapped with
    backward: per step each rank moves 2·Ψ·(N-1)/N gradient bytes.

    Args:
        size: number of model replicas; ``None`` (default) takes whatever ranks the other plugins
            leave (world size / (tp x cp x pp)).
        bucket_mb: gradient bucket size in MiB (DDP's default is 25): larger buckets mean fewer,
            more efficient all-reduces; smaller ones start communicating earlier in backward.

    Example:
        >>> import lightning as L
        >>> from lightning_ultrascale import UltraScaleStrategy, DataParallel
        >>> strategy = UltraScaleStrategy(DataParallel(bucket_mb=25))
        >>> trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    def __init__(self, size: int | None = None, bucket_mb: float = 25.0) -> None:
        super().__init__(stage=0, size=size, bucket_mb=bucket_mb)
