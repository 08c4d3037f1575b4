"""The gradient-sync engines of data parallelism: one per parameter group, behind one interface.

``ZeRO(stage)`` picks the engine; the Layout says which parameter groups exist and over which
data ranks each one averages (dense parameters over ``dp x cp``; an expert's parameters over its
own data ranks). Every engine does the same six things, so the step runner and the strategy use
them without knowing the stage:

=========================  ===================  =====================  =========================
                           stage 0              stages 1, 2            stage 3 (and HSDP)
=========================  ===================  =====================  =========================
built on the meta model    (nothing)            (nothing)              ``fully_shard`` the group
``bind`` (materialised)    bucketed all-reduce  sharded optimizer      (nothing to bind)
``attach`` (optimizer)     (nothing)            its shards replace     (FSDP2's DTensors are the
                                                its parameters         optimizer's parameters)
``no_sync`` / ``reduce``   hold buckets back /  the same, with         FSDP2's gradient sync off
                           reduce them now      reduce-scatters        / torch's stages reduce
optimizer state            the optimizer's      its shards' chunks,    the optimizer's DTensors
(by parameter name)        tensors              by parameter
``wait_for_parameters``    (updated in place)   the all-gathers the    (FSDP2 gathers in each
                                                step launched          forward)
``bf16-mixed``             bf16 weights; fp32   bf16 weights; fp32     FSDP2's policy: sharded
                           masters, whole, in   master slices are      fp32 parameters, bf16
                           the optimizer        the shards             gathers
=========================  ===================  =====================  =========================

Under ``bf16-mixed`` stages 0-2 build their buckets on one data rank too: the masters step
through them (``master.py``).
"""

from __future__ import annotations

import abc
import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# FSDP2's interface for a custom all-gather (not exported by torch.distributed.fsdp).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from torch.distributed.tensor import DTensor, Shard

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.spec import require_spec
from lightning_ultrascale.parallel.data.buckets import BucketedAllReduce, GradientBuckets
from lightning_ultrascale.parallel.data.master import MASTER_PRECISION, to_bf16_with_masters
from lightning_ultrascale.parallel.data.sharded_optimizer import ZeroEngine
from lightning_ultrascale.parallel.layout import GradientGroup, Layout
from lightning_ultrascale.utils.memory import ModelStateBytes, layout_model_state_bytes, reduces_in_fp32
from lightning_ultrascale.utils.tensors import local_tensor

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class GradientSync:
    """Averages the gradients of one :class:`GradientGroup` over its data ranks.

    Built by ``ZeRO.apply`` on the meta-device model; :meth:`bind` runs at every setup, once the
    parameters have storage (materialising and ``.to()`` replace parameter objects, and hooks
    stay with the old ones); :meth:`attach` once the optimizers exist.
    """

    stage: ClassVar[int] = 0

    def __init__(self, group: GradientGroup, layout: Layout, mesh: DeviceMesh, reduce_dtype: str = "fp32") -> None:
        self.group = group
        self.layout = layout
        self.mesh = mesh
        self.reduce_dtype = reduce_dtype
        #: Checkpoint key of this engine's sharded state: one per pipeline part and group.
        self.key = layout.part_name if group.params is None else f"{layout.part_name}.{group.name}"
        self.params: list[nn.Parameter] = []

    def bind(self, model: nn.Module) -> None:
        """Take hold of the group's (materialised) trainable parameters."""
        self.params = [p for _, p in self.layout.group_params(self.group, model) if p.requires_grad]

    def attach(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Called once Lightning has built the optimizers."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next synced backward (or :meth:`reduce`) averages the sum."""
        yield

    def reduce(self) -> None:
        """Average what :meth:`no_sync` held back, outside backward (after a pipeline schedule)."""

    def optimizer_shards(self) -> list[torch.Tensor]:
        """What the optimizer steps in place of this group's parameters (a sharded optimizer's shards)."""
        return []

    def named_optimizer_state(self, names: Mapping[nn.Parameter, Sequence[str]]) -> dict[str, Any]:
        """The optimizer state of :meth:`optimizer_shards`, keyed by parameter name (``checkpoint.py``'s format)."""
        return {}

    def load_named_optimizer_state(self, state: dict[str, Any], names: Mapping[nn.Parameter, Sequence[str]]) -> None:
        """Finish loading what :meth:`named_optimizer_state` gave (DCP filled its tensors)."""

    def wait_for_parameters(self) -> None:
        """Make the parameters hold the last optimizer step's values, where this engine updates them lazily."""

    def reduced_gradients(self) -> dict[nn.Parameter, torch.Tensor] | None:
        """Averaged gradients, where this engine keeps them away from ``param.grad`` (a collective)."""
        return None

    def parameter_at(self, tensor: torch.Tensor, index: int) -> nn.Parameter | None:
        """The parameter that element ``index`` of one of :meth:`optimizer_shards` belongs to."""
        return None

    def expected_bytes(self, n_params: int, k_optimizer: int) -> ModelStateBytes:
        """The per-rank model state of ``n_params`` parameters under this stage and the run's precision.

        ``k_optimizer``: the optimizer's bytes per parameter (an fp32 master included). The one
        formula, :func:`~lightning_ultrascale.utils.memory.layout_model_state_bytes`.
        """
        return layout_model_state_bytes(
            n_params, self.stage, self.mesh.size(), self.layout.precision, self.reduce_dtype, k_optimizer
        )

    def held(self) -> list[torch.Tensor]:
        """Its parameters and what it puts in the optimizer for them."""
        return [*self.params, *self.optimizer_shards(), *self.optimizer_aliases().values()]

    def optimizer_aliases(self) -> dict[nn.Parameter, torch.Tensor]:
        """Parameter -> the whole tensor the optimizer steps in its place (its fp32 master, ZeRO-0 ``bf16-mixed``)."""
        return {}

    def grad_buffers(self) -> list[torch.Tensor]:
        """Gradient memory this engine holds that no ``.grad`` shows (for model-state accounting)."""
        return []

    def master_weights(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each parameter's whole fp32 master where it keeps one (a collective at ZeRO 1-2; for tests and tools)."""
        return {}

    def main_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """The local tensor accumulating ``param``'s gradient when it is not ``param.grad`` (fp32 main gradients)."""
        return None

    def stepped(self, param: nn.Parameter) -> torch.Tensor | None:
        """The optimizer tensor that holds exactly ``param``'s values in its place, if this engine made one."""
        return self.optimizer_aliases().get(param)

    def master_state(self, names: Mapping[nn.Parameter, Sequence[str]]) -> dict[str, Any]:
        """The fp32 masters by parameter name, for the checkpoint's ``state_dict`` in place of the bf16 weights.

        Values are live tensors (or chunks of them): ``dcp.load`` into them fills the masters;
        :meth:`load_masters` then rounds them into the parameters.
        """
        return {}

    def load_masters(self, values: Mapping[nn.Parameter, torch.Tensor] | None = None) -> None:
        """Make the bf16 parameters the rounded masters (after a checkpoint load; every rank).

        ``values``: whole fp32 values by parameter (a single-file checkpoint) the masters take first.
        """

    def remove(self) -> None:
        """Detach from the parameters (the model can be parallelised again)."""


class _BucketEngine(GradientSync, abc.ABC):
    """Stages 0-2: a bucketed reducer bound to the group's parameters, over its flattened data ranks."""

    def __init__(self, group: GradientGroup, layout: Layout, bucket_bytes: int, reduce_dtype: str) -> None:
        super().__init__(group, layout, layout.mesh.over(group.dims), reduce_dtype)
        self.bucket_bytes = bucket_bytes
        self.reducer: GradientBuckets | None = None
        #: bf16 weights on the device, fp32 masters in the optimizer (``master.py``).
        self.keeps_masters = layout.precision == MASTER_PRECISION
        self.masters: dict[nn.Parameter, nn.Parameter] = {}
        self._handles: list[Any] = []  # optimizer hooks

    @abc.abstractmethod
    def _make_reducer(self, model: nn.Module) -> GradientBuckets:
        """The reducer over ``self.params`` (bound parameters of ``model``) and ``self.mesh``."""

    def bind(self, model: nn.Module) -> None:
        super().bind(model)
        self.remove()
        if self.keeps_masters:
            to_bf16_with_masters(self.params, self.masters)
        if self.mesh.size() > 1 or self.keeps_masters:  # masters step through the buckets at any size
            self.reducer = self._make_reducer(model)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.reducer.no_sync() if self.reducer is not None else contextlib.nullcontext():
            yield

    def main_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        return self.reducer.main_grad(param) if self.reducer is not None else None

    def reduce(self) -> None:
        if self.reducer is not None:
            self.reducer.reduce_now()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None


class AllReduceEngine(_BucketEngine):
    """Stage 0: bucketed all-reduce overlapped with backward (``buckets.py``)."""

    stage = 0

    def _make_reducer(self, model: nn.Module) -> GradientBuckets:
        masters = self.masters if self.keeps_masters else None
        dtype = REDUCE_DTYPES[self.reduce_dtype]
        return BucketedAllReduce(self.params, self.mesh.get_group(), self.bucket_bytes, dtype, masters)

    def attach(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """With masters: the optimizer steps them in place of the parameters; each step rounds them into the weights.

        An optimizer with a ``register_replicas(tensors, mesh)`` method (Muon) is told which of the tensors it
        steps are whole replicas over the data ranks: it may divide per-matrix work among them.
        """
        for optimizer in optimizers:
            register = getattr(optimizer, "register_replicas", None)
            if register is not None and self.mesh.size() > 1:
                register([self.masters.get(p, p) for p in self.params if not isinstance(p, DTensor)], self.mesh)
        if not self.masters or self.reducer is None:
            return
        reducer = self.reducer
        assert isinstance(reducer, BucketedAllReduce)
        for optimizer in optimizers:
            swapped = False
            for group in optimizer.param_groups:
                new = [self.masters.get(p, p) for p in group["params"]]
                swapped |= any(a is not b for a, b in zip(new, group["params"]))
                group["params"] = new
            for p in self.masters:
                optimizer.state.pop(p, None)
            if swapped:
                self._handles.append(optimizer.register_step_post_hook(lambda *_: reducer.after_step()))

    def optimizer_aliases(self) -> dict[nn.Parameter, torch.Tensor]:
        return dict(self.masters)

    def master_weights(self) -> dict[nn.Parameter, torch.Tensor]:
        return dict(self.masters)

    def reduced_gradients(self) -> dict[nn.Parameter, torch.Tensor] | None:
        """With masters: their fp32 gradients (``param.grad`` is a bf16 bucket view, or ``None``)."""
        if not self.masters:
            return None
        return {p: m.grad for p, m in self.masters.items() if m.grad is not None}

    def grad_buffers(self) -> list[torch.Tensor]:
        reducer = self.reducer
        return [b.grad_buffer for b in reducer.buckets if b.grad_buffer is not None] if reducer is not None else []

    def master_state(self, names: Mapping[nn.Parameter, Sequence[str]]) -> dict[str, Any]:
        return {name: master for p, master in self.masters.items() for name in names[p]}

    def load_masters(self, values: Mapping[nn.Parameter, torch.Tensor] | None = None) -> None:
        with torch.no_grad():
            for p, master in self.masters.items():
                if values is not None and p in values:
                    local_tensor(master).copy_(values[p])
                local_tensor(p).copy_(local_tensor(master))


class ShardedOptimizerEngine(_BucketEngine):
    """Stages 1 and 2: reduce-scatter into this rank's optimizer shard, all-gather after the step (waited lazily)."""

    def __init__(self, group: GradientGroup, layout: Layout, bucket_bytes: int, stage: int, reduce_dtype: str) -> None:
        super().__init__(group, layout, bucket_bytes, reduce_dtype)
        self.stage = stage

    def _make_reducer(self, model: nn.Module) -> GradientBuckets:
        parts = self.layout.model_parts(model)
        # A tied weight's second copy gets a shard of its own: the gradient norm leaves it out.
        named = dict(model.named_parameters())
        alone = [named[name] for name in self.layout.grad_norm.skip if name in named]
        return ZeroEngine(
            self.params, self.mesh, stage=self.stage, bucket_bytes=self.bucket_bytes, parts=parts,
            masters=self.masters if self.keeps_masters else None, reduce_dtype=REDUCE_DTYPES[self.reduce_dtype],
            alone=[p for p in alone if p in set(self.params)],
        )  # fmt: skip

    def stepped(self, param: nn.Parameter) -> torch.Tensor | None:
        return self._zero.shard_of(param) if self._zero is not None else None

    def remove(self) -> None:
        zero = self._zero
        if zero is not None and zero.optimizer is not None and self.keeps_masters:
            # A second setup builds new shards: they start from these masters, not the bf16 weights.
            self.masters.update(zero.full_masters())
        super().remove()

    def grad_buffers(self) -> list[torch.Tensor]:
        return self._zero.grad_buffers if self._zero is not None else []

    def master_weights(self) -> dict[nn.Parameter, torch.Tensor]:
        zero = self._zero
        return zero.full_masters() if zero is not None and zero.masters is not None else {}

    def master_state(self, names: Mapping[nn.Parameter, Sequence[str]]) -> dict[str, Any]:
        return self._zero.master_state(names) if self._zero is not None else {}

    def load_masters(self, values: Mapping[nn.Parameter, torch.Tensor] | None = None) -> None:
        if self._zero is not None:
            self._zero.load_masters(values)

    @property
    def _zero(self) -> ZeroEngine | None:
        assert self.reducer is None or isinstance(self.reducer, ZeroEngine)
        return self.reducer

    def optimizer_shards(self) -> list[torch.Tensor]:
        return [b.shard for b in self._zero.buckets] if self._zero is not None else []

    def attach(self, optimizers: list[torch.optim.Optimizer]) -> None:
        zero = self._zero
        if zero is None:
            return
        if len(optimizers) != 1:
            raise ConfigError(
                f"ZeRO stage {self.stage} shards one optimizer; configure_optimizers gave {len(optimizers)}"
            )
        others = [t for sync in self.layout.grad_syncs if sync is not self for t in sync.held()]
        zero.attach(optimizers[0], others)
        self.layout.grad_norm.split_over.update(zero.shard_norm_groups())

    def named_optimizer_state(self, names: Mapping[nn.Parameter, Sequence[str]]) -> dict[str, Any]:
        return self._zero.state_dict(names) if self._zero is not None else {}

    def load_named_optimizer_state(self, state: dict[str, Any], names: Mapping[nn.Parameter, Sequence[str]]) -> None:
        if self._zero is not None:
            self._zero.load_state_dict(state, names)

    def parameter_at(self, tensor: torch.Tensor, index: int) -> nn.Parameter | None:
        return self._zero.parameter_at(tensor, index) if self._zero is not None else None

    def wait_for_parameters(self) -> None:
        if self._zero is not None:
            self._zero.wait_for_parameters()

    def reduced_gradients(self) -> dict[nn.Parameter, torch.Tensor] | None:
        """Each parameter's averaged gradient, gathered from the shards (a collective).

        There ``param.grad`` is the local, unreduced gradient (stage 1) or freed (stage 2): the
        averaged gradient lives only in the optimizer's shards. For parity tests and debugging.
        """
        return self._zero.full_grads() if self._zero is not None else None


class FSDPEngine(GradientSync):
    """Stage 3: FSDP2 ``fully_shard`` of the group's modules, over ``dp_shard x cp`` (HSDP: and ``dp_replicate``).

    The default group shards every transformer block, then each part of the model (the model, or
    each pipeline stage) as the root of its unit with embedding, final norm and head. Another
    group shards the modules that hold its parameters, over its own ranks, first (FSDP2 nests
    units; torchtitan shards MoE experts the same way).
    """

    stage = 3

    def __init__(
        self,
        group: GradientGroup,
        layout: Layout,
        model: nn.Module,
        replicate: int,
        reshard_after_forward: bool | None,
        reduce_dtype: str,
    ) -> None:
        shard_dims = tuple(d for d in group.dims if d != "dp_replicate")
        shard_mesh = layout.mesh.over(shard_dims)
        if replicate > 1 and "dp_replicate" in group.dims:
            # HSDP: shard inside a group of ranks, replicate across groups (a group reducing over
            # its own ranks, e.g. experts over edp, is sharded over all of them).
            shard_mesh = layout.mesh.root[("dp_replicate", shard_mesh.mesh_dim_names[0])]
        super().__init__(group, layout, shard_mesh, reduce_dtype)
        # A pipeline stage runs its forward once per microbatch: re-gathering the parameters for
        # every one of them costs more than keeping them (torchtitan's default too).
        reshard = layout.forwards_per_step == 1 if reshard_after_forward is None else reshard_after_forward
        policy = _mixed_precision(layout.precision, REDUCE_DTYPES[reduce_dtype])
        self.roots: list[FSDPModule] = []
        # HSDP all-reduces across replicas once a step where FSDP2 holds the micro-steps' sums in fp32 (no_sync)
        replicated = replicate > 1 and "dp_replicate" in group.dims
        self.defers_all_reduce = replicated and reduces_in_fp32(layout.precision, reduce_dtype)
        if group.params is None:
            cast = _cast_for_fp8_all_gather(model, layout)
            self._shard_model(model, reshard, policy)
            if cast:
                # gloo has no float8 collectives: move the FP8 bytes as uint8 (free on NCCL too).
                for module in model.modules():
                    if isinstance(module, FSDPModule):
                        module.set_custom_all_gather(_ByteAllGather())
        else:
            # A group's own parameters (experts over edp): when expert parallelism leaves fewer
            # experts per rank than the group has ranks, dim 0 (the expert dim) cannot be split
            # evenly and torch.chunk would put whole experts on the first ranks: split dim 1.
            ranks = self.mesh.size(self.mesh.ndim - 1)  # (torch 2.11 takes no negative dim)

            def placement(param: nn.Parameter) -> Shard | None:
                return Shard(fsdp_shard_dim(_local_shape(param), ranks))

            for module in _owners(model, layout.group_params(group, model), group.name):
                fully_shard(
                    module, mesh=self.mesh, reshard_after_forward=reshard, mp_policy=policy,
                    shard_placement_fn=placement,
                )  # fmt: skip
                self.roots.append(module)  # type: ignore[arg-type]

    def _shard_model(self, model: nn.Module, reshard: bool, policy: MixedPrecisionPolicy) -> None:
        spec = require_spec(model)
        for block in model.get_submodule(spec.layers).values():
            fully_shard(block, mesh=self.mesh, reshard_after_forward=reshard, mp_policy=policy)
        # The root unit of each part holds embedding, final norm and head, resharded like the
        # blocks so that the traffic is the playbook's 3Ψ (keeping it gathered would save
        # re-gathering ~17% of llama_tiny, a few % of an 8B model, for that much more memory).
        for part in self.layout.model_parts(model):
            fully_shard(part, mesh=self.mesh, reshard_after_forward=reshard, mp_policy=policy)
            assert isinstance(part, FSDPModule)
            self.roots.append(part)
            # Explicit forward prefetch: gather block i+1 while block i computes (FSDP2 prefetches
            # backward by itself, forward only if told).
            for current, following in itertools.pairwise(part.get_submodule(spec.layers).values()):
                current.set_modules_to_forward_prefetch([following])  # type: ignore[operator]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # Gradients are reduce-scattered on every micro-step, also under accumulation, and
        # accumulate in the sharded gradients: holding them back (set_requires_gradient_sync(False))
        # would keep every unsharded fp32 gradient between micro-steps, 4 bytes per parameter of
        # the whole model (280 GB for 70B), which ZeRO-3 exists to avoid; torchtitan makes the same
        # choice. The cost: one reduce-scatter per micro-step instead of per optimizer step.
        # (Under a pipeline schedule torch's stages reduce-scatter after their last backward
        # themselves: reduce() has nothing left to do.)
        # HSDP's all-reduce across the replicas, though, waits for the last micro-step: FSDP2 holds each
        # micro-step's reduce-scattered shard (set_requires_all_reduce(False): one buffer the size of the
        # sharded gradients, which they would hold anyway) and sums them into that one all-reduce, one per
        # optimizer step instead of one per micro-step, on the links between replicas (nodes, as a rule).
        # FSDP2 holds that sum in the reduction's dtype: under reduce_dtype="bf16" it would round every
        # micro-step's share into bf16, where the sharded fp32 gradients add them exactly, so there the
        # all-reduce stays per micro-step.
        if not self.defers_all_reduce:
            yield
            return
        for root in self.roots:
            root.set_requires_all_reduce(False)
        try:
            yield
        finally:
            for root in self.roots:
                root.set_requires_all_reduce(True)


#: torch >= 2.12 names it all_gather_single (all_gather_into_tensor is deprecated there).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _cast_for_fp8_all_gather(model: nn.Module, layout: Layout) -> bool:
    """Apply the Layout's ``all_gather_casts`` (FP8 weights all-gathered in FP8) to the modules held here."""
    held = [name for name in layout.all_gather_casts if name not in layout.dropped]
    for name in held:
        layout.all_gather_casts[name](model.get_submodule(name))
    return bool(held)


class _ByteAllGather(AllGather):
    """FSDP2's all-gather, with 1-byte float dtypes (FP8) moved as ``uint8`` (gloo refuses float8)."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if output_tensor.dtype.is_floating_point and output_tensor.dtype.itemsize == 1:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def _mixed_precision(precision: str, reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    if precision == "bf16-mixed":
        # bf16 compute and all-gathers; fp32 sharded master weights and (by default) fp32 reduce-scatter.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    if precision == "bf16-true":
        # bf16 parameters everywhere (no master copy); the gradient sum may still run in fp32.
        return MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    return MixedPrecisionPolicy()


def fsdp_shard_dim(shape: Sequence[int], ranks: int) -> int:
    """The dim ZeRO-3 splits a group parameter of local ``shape`` along over ``ranks`` ranks.

    Dim 0, unless it holds fewer rows than there are ranks and dim 1 splits evenly (FSDP2 allows
    only even splits off dim 0): then dim 1, so that every rank holds its share.

    Example:
        >>> fsdp_shard_dim((1, 14336, 4096), ranks=8), fsdp_shard_dim((8, 14336, 4096), ranks=8)
        (1, 0)
    """
    if len(shape) > 1 and shape[0] < ranks and shape[1] % ranks == 0:
        return 1
    return 0


def _local_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.to_local().shape if isinstance(param, DTensor) else param.shape)


def _owners(model: nn.Module, params: list[tuple[str, nn.Parameter]], group: str) -> list[nn.Module]:
    """The modules that hold ``params`` directly; FSDP2 shards whole modules, so they may hold no other."""
    names = {n for n, _ in params}
    owners = dict.fromkeys(name.rpartition(".")[0] for name in names)
    modules = []
    for owner in owners:
        module = model.get_submodule(owner)
        foreign = [n for n, _ in module.named_parameters(prefix=owner, recurse=False) if n not in names]
        if foreign:
            raise ConfigError(
                f"gradient group {group!r} cannot be sharded by ZeRO(stage=3): module {owner!r} also holds "
                f"{', '.join(foreign)}, and fully_shard shards whole modules; give the group every parameter of it"
            )
        modules.append(module)
    return modules
