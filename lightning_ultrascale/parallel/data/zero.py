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

Stage 0 uses our bucketed all-reduce (``buckets.py``), stages 1 and 2 our sharded optimizer
(``sharded_optimizer.py``): FSDP2 has neither. Stage 3 is FSDP2 ``fully_shard`` per transformer block
and at the root, over ``dp_shard``, or over ``dp_replicate x dp_shard`` for HSDP (shard inside a
group, replicate across groups). The playbook's guidance: ZeRO-2 is the usual sweet spot (same
traffic as DP, most of the memory saved); ZeRO-3 for models whose parameters do not fit.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.spec import ModelSpec, require_spec
from lightning_ultrascale.parallel.data.buckets import BucketedAllReduce
from lightning_ultrascale.parallel.dims import ParallelDims
from lightning_ultrascale.parallel.mesh import ParallelMesh
from lightning_ultrascale.parallel.plugin import ParallelPlugin, model_parts
from lightning_ultrascale.utils.memory import ModelStateBytes, playbook_model_state_bytes

STAGES = (0, 1, 2, 3)
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
            memory: the ZeRO-2-like point of FSDP). Default (``None``): free them, except under
            pipeline parallelism, where a stage runs many microbatches per step and would gather
            its parameters again for every one of them (torchtitan's default too).
        reduce_dtype: dtype of gradient reduction under bf16 parameters (stages 0 and 3; stages
            1-2 reduce in the gradients' dtype): ``"fp32"`` (default, exact sums) or ``"bf16"``
            (half the bytes).

    Example:
        >>> from lightning_ultrascale import UltraScaleStrategy, ZeRO
        >>> strategy = UltraScaleStrategy(ZeRO(stage=3))               # FSDP over all ranks
        >>> strategy = UltraScaleStrategy(ZeRO(stage=3, replicate=2))  # HSDP: 2 groups x N/2 shards
    """

    applies_at = "data"

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
            raise ConfigError(f"parallel.zero_stage={stage!r} is not a ZeRO stage; valid: 0, 1, 2, 3")
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ConfigError(f"parallel.dp={size!r} must be a positive integer or None (inferred)")
        if not isinstance(replicate, int) or replicate < 1:
            raise ConfigError(f"parallel.replicate={replicate!r} must be a positive integer")
        if replicate > 1 and stage != 3:
            raise ConfigError(
                f"parallel.replicate={replicate} (HSDP) needs parallel.zero_stage=3, got {stage}; "
                "for stages 0-2 every data-parallel rank already holds the whole model"
            )
        if not bucket_mb > 0:
            raise ConfigError(f"parallel.bucket_mb={bucket_mb!r} must be > 0 (DDP's default is 25)")
        if reduce_dtype not in REDUCE_DTYPES:
            raise ConfigError(f"parallel.reduce_dtype={reduce_dtype!r}; valid: {', '.join(REDUCE_DTYPES)}")
        self.stage = stage
        self.size = size
        self.replicate = replicate
        self.bucket_mb = bucket_mb
        self.reshard_after_forward = reshard_after_forward
        self.reduce_dtype = reduce_dtype
        self.precision = "32-true"
        self.reducer: Any = None  # BucketedAllReduce (stage 0) or ZeroEngine (stages 1, 2)
        self._fsdp_roots: list[FSDPModule] = []
        self._stage_key = "shards"
        self._mesh: DeviceMesh | None = None

    def mesh_sizes(self) -> dict[str, int | None]:
        if self.stage == 0:
            return {"dp_replicate": self.size}
        if self.stage == 3:
            return {"dp_replicate": self.replicate, "dp_shard": self.size}
        return {"dp_shard": self.size}

    def settings(self) -> dict[str, Any]:
        return {"stage": self.stage}

    def set_precision(self, precision: str) -> None:
        self.precision = precision

    def validate(self, dims: ParallelDims, spec: ModelSpec) -> None:
        if self.stage in (1, 2) and dims.dp_shard == 1:
            warnings.warn(
                f"ZeRO stage {self.stage} with one data-parallel rank shards nothing; it runs as plain training",
                stacklevel=2,
            )

    def expected_state_bytes(self, n_params: int, k_optimizer: int) -> ModelStateBytes:
        """The playbook's per-rank model state for this stage, fp32 form (params and grads 4Ψ each).

        fp32 is the right form for ``32-true`` and for ``bf16-mixed`` under stages 0-2 too: there
        Lightning's autocast casts weights per op and keeps no bf16 copy of them.
        """
        assert self._mesh is not None, "known once the plugin is applied"
        return playbook_model_state_bytes(
            n_params, stage=self.stage, dp=self._mesh.size(), k_optimizer=k_optimizer, mixed_precision=False
        )

    @property
    def _bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    def apply(self, model: nn.Module, mesh: ParallelMesh) -> nn.Module:
        # Gradients are averaged over every data dim: the dp ranks and the context-parallel ranks,
        # which hold other tokens of the same samples.
        self._mesh = mesh["dp_cp"]
        pp = mesh.root["pp"]
        self._stage_key = f"pp{pp.get_local_rank()}" if pp.size() > 1 else "shards"
        if self.stage == 3:
            self._fully_shard(model, mesh)
        return model

    def _fully_shard(self, model: nn.Module, mesh: ParallelMesh) -> None:
        spec = require_spec(model)
        reshard = self.reshard_after_forward
        if reshard is None:
            reshard = mesh.root["pp"].size() == 1
        # Context-parallel ranks shard too: they hold other tokens of the same samples, and their
        # gradients must be summed with the dp ranks' (FSDP reduces over its own mesh only).
        shard_mesh = mesh.root[("dp_replicate", "dp_shard_cp")] if self.replicate > 1 else mesh["dp_shard_cp"]
        policy = MixedPrecisionPolicy()
        reduce_dtype = REDUCE_DTYPES[self.reduce_dtype]
        if self.precision == "bf16-mixed":
            # bf16 compute and all-gathers; fp32 sharded master weights and (by default) fp32 reduce-scatter.
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        elif self.precision == "bf16-true":
            # bf16 parameters everywhere (no master copy); the gradient sum may still run in fp32.
            policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        blocks = list(model.get_submodule(spec.layers).values())
        for block in blocks:
            fully_shard(block, mesh=shard_mesh, reshard_after_forward=reshard, mp_policy=policy)
        # The root unit of each part (the model, or each pipeline stage) holds embedding, final
        # norm and head, resharded like the blocks so that the traffic is the playbook's 3Ψ
        # (keeping it gathered would save re-gathering ~17% of llama_tiny, a few % of an 8B model,
        # for that much more memory).
        self._fsdp_roots = []
        for part in model_parts(model):
            fully_shard(part, mesh=shard_mesh, reshard_after_forward=reshard, mp_policy=policy)
            assert isinstance(part, FSDPModule)
            self._fsdp_roots.append(part)
            # Explicit forward prefetch: gather block i+1 while block i computes (FSDP2 prefetches
            # backward by itself, forward only if told).
            part_blocks = list(part.get_submodule(spec.layers).values())
            for current, following in itertools.pairwise(part_blocks):
                current.set_modules_to_forward_prefetch([following])  # type: ignore[operator]

    def on_materialized(self, model: nn.Module) -> None:
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        assert self._mesh is not None
        if self.stage == 3 or self._mesh.size() == 1:
            return
        params = list(model.parameters())
        if self.stage == 0:
            self.reducer = BucketedAllReduce(
                params,
                self._mesh.get_group(),
                bucket_bytes=self._bucket_bytes,
                reduce_dtype=REDUCE_DTYPES[self.reduce_dtype],
            )
        else:
            from lightning_ultrascale.parallel.data.sharded_optimizer import ZeroEngine

            self.reducer = ZeroEngine(params, self._mesh, stage=self.stage, bucket_bytes=self._bucket_bytes)

    def reduced_gradients(self) -> dict[nn.Parameter, torch.Tensor] | None:
        """Stages 1-2: each parameter's averaged gradient, gathered from the shards (a collective).

        There ``param.grad`` is the local, unreduced gradient (stage 1) or freed (stage 2): the
        averaged gradient lives only in the optimizer's shards. For parity tests and debugging.
        """
        if self.stage in (1, 2) and self.reducer is not None:
            return self.reducer.full_grads()
        return None

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        if self.stage in (1, 2) and self.reducer is not None:
            # Pipeline stages have buckets of their own under the same names: one key per stage.
            return {self._stage_key: self.reducer.state_dict()}
        return None

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if self.stage in (1, 2) and self.reducer is not None:
            self.reducer.load_state_dict(state[self._stage_key])

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if self.stage in (1, 2) and self.reducer is not None:
            if len(optimizers) != 1:
                raise ConfigError(
                    f"ZeRO stage {self.stage} shards one optimizer; configure_optimizers gave {len(optimizers)}"
                )
            self.reducer.attach(optimizers[0])

    def sync_gradients(self) -> None:
        # Stages 0-2: a pipeline schedule ran its backwards under no_sync; reduce their sum now.
        # (Stage 3: torch's pipeline stages reduce-scatter after their last backward themselves.)
        if self.reducer is not None:
            self.reducer.reduce_now()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if self._fsdp_roots:
            for root in self._fsdp_roots:
                root.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                for root in self._fsdp_roots:
                    root.set_requires_gradient_sync(True)
        elif self.reducer is not None:
            with self.reducer.no_sync():
                yield
        else:
            yield


class DataParallel(ZeRO):
    """Plain data parallelism over the ``dp_replicate`` mesh dim (``ZeRO(stage=0)``).

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
