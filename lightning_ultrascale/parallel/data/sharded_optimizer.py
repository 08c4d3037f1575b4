"""ZeRO-1 and ZeRO-2: a sharded optimizer over replicated parameters (FSDP2 and torchtitan have no ZeRO-1).

The playbook's "ZeRO: Zero Redundancy Optimizer". Every rank of the N data-parallel ranks keeps the
whole model (Ψ parameters); gradients are reduce-scattered in buckets, launched from backward hooks
as soon as a bucket is full so communication overlaps backward; each rank owns 1/N of every
bucket, steps the optimizer on that shard only, and the updated shards are all-gathered back into
the replicated parameters after ``optimizer.step()``. Per rank, with bf16 mixed precision and Adam
(k = 12 bytes of fp32 master weights, momentum and variance per parameter; in fp32 training the
2Ψ terms are 4Ψ and k = 8):

    stage 1 (optimizer states sharded):       2Ψ + 2Ψ + kΨ/N
    stage 2 (optimizer states and gradients):  2Ψ + (2Ψ + kΨ)/N

ZeRO-1 keeps the full gradient buffer for the whole run, and the reduced shard gradient is this
rank's slice of it (no memory of its own; the buffer is zeroed after the optimizer step); ZeRO-2
frees each full-gradient bucket as soon as its reduce-scatter has completed, so after backward only
the 1/N shard gradient is left.
Traffic per step and rank is the same as DP's all-reduce: a reduce-scatter of Ψ(N-1)/N plus an
all-gather of Ψ(N-1)/N, i.e. 2Ψ(N-1)/N (payloads: Ψ each, padded to a multiple of N).

Layout. Parameters are planned into buckets (``plan_buckets``, shared with the DP all-reduce), each
holding parameters of one optimizer param group only, so a shard carries one set of hyperparameters.
A bucket's flat parameter buffer is padded to a multiple of N, and the model's parameters become
views into it, so the all-gather writes the updated values straight into the model. Rank r owns the
slice ``[r*c, (r+1)*c)`` (``c = ceil(numel / N)``) of the padded buffer; its optimizer parameter is
a ``DTensor`` with placement ``Shard(0)`` over the *unpadded* bucket, whose local tensor is the
unpadded part of that slice (a view: same storage). That is exactly DTensor's uneven ``Shard(0)``
split (chunks of ``c``, the last ranks shorter or empty), the way FSDP2 shards. So:

- the optimizer never sees the padding (weight decay and Adam states are exact, and optimizer-state
  bytes are Ψ/N plus at most one element per bucket);
- ``torch.nn.utils.clip_grad_norm_`` over the optimizer's params (Lightning's gradient clipping)
  computes the global norm: DTensor reduces the per-shard norms across the mesh;
- the checkpoint (:meth:`ZeroEngine.state_dict`) is keyed by parameter name at each parameter's
  own shape, each rank writing the chunks its shard holds (``flat_chunks.py``): the format every
  layout saves, so any layout, any N and any bucket size load it, and nothing is gathered.

Waiting. The step launches the all-gathers in the order the next forward needs the buckets (the
reverse of bucket order: ``plan_buckets`` walks the parameters backwards), the same order on every
rank. Each bucket is waited for, once, in the forward pre-hook of the first module holding one of
its parameters: a tied weight by the embedding; a recomputed forward finds nothing left to wait
for. A parameter that a forward reads without running any module holding it (Llama's fused
cross-entropy reads the head's weight in the model's own forward) is learnt at the step and waited
for where a part of the model starts its forward. Every other reader waits for all buckets: the
optimizer's update (after the closure, in which Lightning runs forward and backward: a gather's
input is the shard the update writes), ``state_dict()``, the optimizer-state checkpoint, and
:meth:`ZeroEngine.wait_for_parameters` (the end of training; callbacks). The gathers move the flat
buffers in the parameters' own dtype: fp32 under ``32-true``, bf16 under ``bf16-mixed`` and
``bf16-true``.

Mixed precision (``masters``, under ``bf16-mixed``). The parameters and the flat buffers are bf16;
each shard is an fp32 master of its slice, in memory of its own (4Ψ/N: with Adam's moments the
playbook's 12Ψ/N). The step updates the masters, copies this rank's slice into the bf16 buffer
and all-gathers bf16 (2 bytes per parameter on the wire). Gradients: with an fp32
``reduce_dtype`` the buckets are fp32 main gradients (``buckets.py``), reduce-scattered in fp32
straight into the masters' gradients; with bf16 they are bf16 buckets, reduce-scattered in bf16,
and the shard's fp32 gradient is a copy that lives until the step is done.

The optimizer must be elementwise (SGD, Adam, AdamW, Adagrad, RMSprop, ...): it sees one flat
shard per bucket, so per-tensor quantities (LAMB's trust ratio, Adafactor's factored moments)
would be computed over the wrong tensors. An optimizer with a ``register_flat_shard(shard,
members)`` method is told which parameters each shard holds and where
(:class:`~lightning_ultrascale.parallel.muon.Muon` orthogonalises their whole matrices).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.hooks import RemovableHandle

from lightning_ultrascale.errors import ConfigError, option
from lightning_ultrascale.parallel.compile import is_compiled
from lightning_ultrascale.parallel.data.buckets import GradBucket, GradientBuckets, _grad_in, plan_buckets
from lightning_ultrascale.parallel.data.flat_chunks import flat_chunks
from lightning_ultrascale.utils.optim import initialize_state
from lightning_ultrascale.utils.tensors import local_tensor

# torch 2.13 renamed the flat collectives to *_single and deprecated the old names (pytorch#186130);
# the GPU image's torch 2.11 has only the old ones. Both dispatch to the same c10d ops.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _sum_groups(p: nn.Parameter) -> tuple[dist.ProcessGroup, ...]:
    """The groups over which a (tensor-parallel) parameter's local pieces are distinct."""
    if not isinstance(p, DTensor):
        return ()
    return tuple(p.device_mesh.get_group(i) for i, pl in enumerate(p.placements) if not pl.is_replicate())


def _sum_group_names(p: nn.Parameter) -> tuple[str, ...]:
    return tuple(g.group_name for g in _sum_groups(p))


def _master_slice(
    masters: Mapping[nn.Parameter, torch.Tensor], params: list[nn.Parameter], offsets: list[int], start: int, numel: int
) -> torch.Tensor:
    """Elements ``[start, start + numel)`` of the bucket of ``params`` (at ``offsets``) in fp32, from ``masters``."""
    master = torch.empty(numel, dtype=torch.float32, device=params[0].device)
    for p, offset in zip(params, offsets):
        size = local_tensor(p).numel()
        lo, hi = max(start, offset), min(start + numel, offset + size)
        if lo < hi:
            master[lo - start : hi - start].copy_(local_tensor(masters[p]).reshape(-1)[lo - offset : hi - offset])
    return master


def _piece(p: nn.Parameter) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's piece of ``p`` and where it starts in ``p`` (a tensor-parallel shard)."""
    if not isinstance(p, DTensor):
        return tuple(p.shape), (0,) * p.dim()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(shape), tuple(offset)


@dataclass(kw_only=True)
class _Bucket(GradBucket):
    """A gradient bucket plus the replicated parameter data and this rank's shard of both."""

    shard_numel: int  # c = ceil(numel / N): every rank's slice of the padded buffer
    flat_params: torch.Tensor  # padded to N * shard_numel; the model's parameters are views into it
    shard: nn.Parameter  # DTensor over the unpadded bucket, local = this rank's part of flat_params
    reduced: torch.Tensor | None = None  # reduce-scatter output while in flight (padded shard)
    master: torch.Tensor | None = None  # the fp32 master slice the shard steps (mixed precision)
    gathering: dist.Work | None = None  # the all-gather of the updated shards, until a reader waits for it


class ZeroEngine(GradientBuckets):
    """Shard optimizer states (stage 1) and gradients (stage 2) of ``params`` over a 1-D data-parallel mesh.

    Args:
        params: the model's parameters, with storage and initial values; those with
            ``requires_grad`` are managed. The ``Parameter`` objects are kept: their data become
            views into flat bucket buffers at :meth:`attach`.
        mesh: the 1-D data-parallel mesh; gradients are averaged over it.
        stage: 1 (optimizer states sharded, full gradients kept) or 2 (gradients sharded too).
        bucket_bytes: gradient bucket size: larger buckets mean fewer, more efficient collectives;
            smaller ones start communicating earlier in backward.
        parts: the modules whose ``forward`` a step calls (the model, or this rank's pipeline
            stages), holding the modules that hold ``params``: the updated parameters are waited
            for in their forwards.
        masters: the fp32 master copy of each bf16 parameter (``bf16-mixed``): the shards become
            fp32 slices of them (module docstring); the engine keeps only its slices after
            :meth:`attach`, and empties the mapping.
        reduce_dtype: the dtype gradients are reduced in (``None``: the parameters'); with
            ``masters``, fp32 makes the buckets fp32 main gradients.
        alone: parameters that get a bucket (so a shard) of their own: a tied weight's second copy,
            which the gradient norm must leave out (:meth:`shard_of`).

    After a synced backward the averaged gradient lives only on the optimizer's shard parameters
    (``optimizer.param_groups[i]["params"]``, DTensors): the model's ``.grad`` are scratch (ZeRO-1:
    zeros, ZeRO-2: ``None``). Inside :meth:`no_sync` both stages accumulate full local gradients
    (as DDP's ``no_sync``), so ZeRO-2 holds full gradients between the micro-steps of one step.
    Do not move the model (``.to()``) after :meth:`attach`: it would detach the parameters from the
    buffers. Between ``optimizer.step()`` and the next forward the parameters are being gathered:
    read their values there only after :meth:`wait_for_parameters` (``state_dict()`` waits itself).

    Example:
        >>> engine = ZeroEngine(list(model.parameters()), mesh["dp_cp"], 2, 25 * 2**20, [model])  # doctest: +SKIP
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)                            # doctest: +SKIP
        >>> engine.attach(optimizer)       # optimizer now steps this rank's 1/N shard           # doctest: +SKIP
        >>> model(x).sum().backward()      # reduce-scatters overlap backward                     # doctest: +SKIP
        >>> optimizer.step(); optimizer.zero_grad()   # step launches the all-gathers             # doctest: +SKIP
        >>> model(x)                       # each layer waits for its bucket's gather             # doctest: +SKIP
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        mesh: DeviceMesh,
        stage: Literal[1, 2],
        bucket_bytes: int,
        parts: Sequence[nn.Module],
        masters: dict[nn.Parameter, nn.Parameter] | None = None,
        reduce_dtype: torch.dtype | None = None,
        alone: Collection[nn.Parameter] = (),
    ) -> None:
        if stage not in (1, 2):
            raise ConfigError(
                f"{option('ZeRO', 'stage', stage)}: ZeroEngine runs stages 1 and 2 (stage 3 is FSDP2's fully_shard)"
            )
        if bucket_bytes <= 0:
            bucket_mb = option("ZeRO", "bucket_mb", bucket_bytes / 2**20)
            raise ConfigError(f"bucket_bytes={bucket_bytes} (from {bucket_mb}) must be > 0")
        if mesh.ndim != 1:
            raise ValueError(f"mesh must be the 1-D data-parallel mesh, got dims {mesh.mesh_dim_names}")
        self.mesh = mesh
        self.stage = stage
        self.bucket_bytes = bucket_bytes
        self.group = mesh.get_group()
        self.group_size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.params = list(dict.fromkeys(p for p in params if p.requires_grad))  # tied weights count once
        self.parts = list(parts)
        self.optimizer: torch.optim.Optimizer | None = None
        self._waits: list[RemovableHandle] = []
        self._held: dict[nn.Module, list[_Bucket]] = {}  # module -> buckets of the parameters it holds
        self._covers: dict[nn.Module, list[nn.Parameter]] = {}  # holder -> the parameters it waits for
        self._ran: set[nn.Module] = set()  # holders whose forward ran since the last update
        self._late: list[_Bucket] = []  # buckets waited for at the start of the forward
        self.masters = masters
        self.reduce_dtype = reduce_dtype
        self.alone = set(alone)
        super().__init__(self.params)
        self.main_grads = masters is not None and reduce_dtype == torch.float32

    # ---- layout -------------------------------------------------------------------------------

    def attach(self, optimizer: torch.optim.Optimizer, others: Collection[torch.Tensor] = ()) -> None:
        """Make ``optimizer`` (the same object: LR schedulers hold it) step this rank's shards only.

        In its param groups this engine's parameters become this rank's flat shard parameters (one
        per bucket, buckets planned per param group), their state is reset, the model's parameters
        become views into the flat bucket buffers, a step post-hook launches the all-gathers of the
        updated shards and forward pre-hooks wait for them. ``others``: parameters the optimizer
        also holds that other engines manage (another parameter group's data ranks); they stay
        where they are.
        """
        if self.optimizer is not None:
            raise RuntimeError("ZeroEngine.attach() was already called; one engine shards one optimizer")
        group_of = self._group_index(optimizer, {id(t) for t in others})
        plan = plan_buckets(
            self.params,
            self.bucket_bytes,
            key=lambda p: (group_of[p], p.dtype, p.device, _sum_group_names(p), p if p in self.alone else None),
        )
        self._set_buckets([self._make_bucket(members) for members in plan])
        if self.masters is not None:
            self.masters.clear()  # each rank keeps its slices only
        for index, group in enumerate(optimizer.param_groups):
            kept = [p for p in group["params"] if p not in group_of]
            group["params"] = kept + [b.shard for b in self.buckets if group_of[b.params[0]] == index]
        for p in self.params:
            optimizer.state.pop(p, None)
        register = getattr(optimizer, "register_flat_shard", None)  # Muon: whole matrices from flat shards
        if register is not None:
            for b in self.buckets:
                register(b.shard, list(zip(b.params, b.offsets)))
        self._waits = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._all_gather_params),
            *self._hook_forwards(),
        ]
        self.optimizer = optimizer

    def _group_index(self, optimizer: torch.optim.Optimizer, others: set[int]) -> dict[nn.Parameter, int]:
        managed = set(self.params)
        group_of: dict[nn.Parameter, int] = {}
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in others:
                    continue
                if p not in managed:
                    raise ValueError(
                        f"optimizer param group {index} holds a parameter of shape {tuple(p.shape)} that this "
                        "ZeroEngine does not manage (not among its params, or requires_grad=False)"
                    )
                group_of[p] = index
        missing = [tuple(p.shape) for p in self.params if p not in group_of]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameters (shapes {missing[:3]}...) are in no optimizer param group; "
                "ZeRO shards what the optimizer updates: add them to configure_optimizers or set requires_grad=False"
            )
        return group_of

    def _make_bucket(self, params: list[nn.Parameter]) -> _Bucket:
        offsets = [0, *itertools.accumulate(local_tensor(p).numel() for p in params)]
        numel = offsets[-1]
        shard_numel = -(-numel // self.group_size)
        first = params[0]
        # Padded to a multiple of N: reduce_scatter and all_gather need equal slices on every rank.
        flat = torch.zeros(shard_numel * self.group_size, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, offset in zip(params, offsets):
                local = local_tensor(p)
                view = flat[offset : offset + local.numel()].view_as(local)
                view.copy_(local)
                if isinstance(p, DTensor):
                    # A tensor-parallel parameter: its local shard becomes the view (same object,
                    # new storage), so the all-gather still writes straight into the model.
                    p._local_tensor.set_(view)
                else:
                    p.data = view
                p.grad = None
        start = self.rank * shard_numel
        local = flat[start : start + max(0, min(shard_numel, numel - start))]
        master = None if self.masters is None else _master_slice(self.masters, params, offsets, start, local.numel())
        shard = nn.Parameter(self._as_shard(local if master is None else master, numel))
        return _Bucket(
            params=params, offsets=offsets[:-1], numel=numel, shard_numel=shard_numel, flat_params=flat, shard=shard,
            master=master,
        )  # fmt: skip

    def _as_shard(self, local: torch.Tensor, numel: int) -> DTensor:
        # shape/stride given explicitly: the split is uneven, from_local cannot infer the global size.
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=(numel,), stride=(1,))

    # ---- backward: reduce-scatter ---------------------------------------------------------------

    def _allocate_grads(self, bucket: _Bucket) -> None:
        if self.main_grads:  # fp32 main gradients: every gradient is added in
            buffer = torch.zeros_like(bucket.flat_params, dtype=torch.float32)
        else:
            # Every parameter's slice is overwritten by its first gradient (or zero-filled if
            # unused), so only the padding needs zeros.
            buffer = torch.empty_like(bucket.flat_params)
            buffer[bucket.numel :].zero_()
        bucket.grad_buffer = buffer
        bucket.grad_views = [
            buffer[o : o + local_tensor(p).numel()].view_as(local_tensor(p))
            for p, o in zip(bucket.params, bucket.offsets)
        ]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if self.optimizer is None:
            raise RuntimeError("ZeroEngine.attach(optimizer) must run before the first backward")
        bucket = self._slot[param][0]
        if isinstance(bucket, _Bucket) and bucket.gathering is not None:
            holders = sorted({type(m).__name__ for m, held in self._held.items() if any(b is bucket for b in held)})
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} took part in a forward while its all-gather was still "
                f"in flight: ZeRO waits for it when a module holding it ({', '.join(holders) or 'none'}) or a part "
                "of the model starts its forward; read parameters inside such a forward (call the module, not its "
                "forward method), or call wait_for_parameters() first"
            )
        super()._on_grad_ready(param)

    def _launch(self, bucket: GradBucket) -> dist.Work:
        assert isinstance(bucket, _Bucket) and bucket.grad_buffer is not None
        wire = bucket.grad_buffer
        if self.reduce_dtype is not None and wire.dtype != self.reduce_dtype:
            wire = wire.to(self.reduce_dtype)  # bf16 gradients summed in fp32 (bf16-true)
        # Pre-divide so the sum is the mean (as DDP; keeps low-precision sums in range).
        wire.div_(self.group_size)
        if bucket.reduced is None or bucket.reduced.dtype != wire.dtype:
            bucket.reduced = wire.new_empty(bucket.shard_numel)
        return _reduce_scatter(bucket.reduced, wire, group=self.group, async_op=True)

    def _poll(self) -> None:
        self._collect(block=False)

    def _complete(self) -> None:
        self._collect(block=True)

    def _collect(self, block: bool) -> None:
        """Hand finished reduce-scatters to the shard gradients (waiting for all of them if ``block``).

        Polled from the hooks too, so ZeRO-2 frees a full-gradient bucket as soon as its
        reduce-scatter is done, not at the end of backward: that bounds the peak, not only the end.
        """
        for bucket in self.buckets[: self._next]:
            if bucket.work is None or not (block or bucket.work.is_completed()):
                continue
            bucket.work.wait()
            bucket.work = None
            self._deliver(bucket)

    def _deliver(self, bucket: _Bucket) -> None:
        assert bucket.reduced is not None and bucket.grad_buffer is not None
        shard = bucket.shard
        reduced = bucket.reduced[: shard.to_local().numel()]  # the padding is not part of the shard
        # A reduced bf16 shard of bf16 master-weight gradients stays (2Ψ/N, reused next step): the
        # shard's fp32 gradient is a copy of it.
        keep = self.masters is not None and not self.main_grads and self.stage == 2
        if not keep:
            bucket.reduced = None
        with torch.no_grad():
            if self.stage == 1 and reduced.dtype == shard.dtype == bucket.grad_buffer.dtype:
                # ZeRO-1 as the playbook lays it out: the full gradient buffer stays (2Ψ) and the
                # reduced shard lives in this rank's slice of it, not in memory of its own.
                start = self.rank * bucket.shard_numel
                region = bucket.grad_buffer[start : start + reduced.numel()]
                if shard.grad is None:
                    region.copy_(reduced)
                    shard.grad = self._as_shard(region, bucket.numel)
                else:
                    # Torch semantics: gradients accumulate until the user zeroes them.
                    shard.grad.to_local().add_(reduced)
                # The rest of the buffer is zeroed once the optimizer step has used the shard.
                return
            if shard.grad is None:
                # After zero_grad(set_to_none=True): a fresh gradient, never stale memory.
                shard.grad = self._as_shard(reduced.to(shard.dtype, copy=keep), bucket.numel)
            else:
                shard.grad.to_local().add_(reduced)
            if self.stage == 1:
                return  # the full buffer (in another dtype than the shard) stays
            for p in bucket.params:
                p.grad = None
            bucket.grad_buffer = None
            bucket.grad_views = []

    # ---- optimizer step: all-gather, waited for where the parameters are read -----------------

    def _hook_forwards(self) -> list[RemovableHandle]:
        """Where the gathers are waited for (see the module docstring).

        Every module of ``parts`` that holds a parameter waits for its buckets before its forward
        and its ``state_dict``; every part, before its forward, for the buckets read without a holder.
        """
        self._covers = _holders(self.parts)
        for module, params in self._covers.items():
            held = [self._slot[p][0] for p in params if p in self._slot]
            if held:
                self._held[module] = list({id(b): b for b in held}.values())  # buckets compare by value
        # Until a forward has shown which holders run, every bucket waits at the start.
        self._late = list(self.buckets)
        return [
            *(m.register_forward_pre_hook(self._before_holder_forward) for m in self._held),
            *(m.register_state_dict_pre_hook(self._before_state_dict) for m in self._held),
            *(part.register_forward_pre_hook(self._before_part_forward) for part in self.parts),
        ]

    def _before_holder_forward(self, module: nn.Module, args: Any) -> None:
        self._ran.add(module)
        self._wait(self._held[module])

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._wait(self._held[module])

    def _before_part_forward(self, module: nn.Module, args: Any) -> None:
        self._wait(self._late)

    def _wait(self, buckets: Sequence[_Bucket]) -> None:
        for b in buckets:
            if b.gathering is not None:
                b.gathering.wait()
                b.gathering = None

    def wait_for_parameters(self) -> None:
        """Finish every all-gather still in flight: the parameters hold the last step's values (idempotent)."""
        self._wait(self.buckets)

    def _before_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        # The update must not start while a gather still reads the shard it writes (a step with no
        # forward since the last one). Lightning runs forward and backward inside step() (the
        # closure, args[1] or kwargs["closure"]): waiting here would wait before that forward.
        closure: Callable[[], Any] | None = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._before_update()
            return None

        def closure_then_wait() -> Any:
            loss = closure()
            self._before_update()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (args[0], closure_then_wait, *args[2:]), kwargs

    def _before_update(self) -> None:
        self.wait_for_parameters()
        if self._ran:
            # A parameter none of whose holders ran was read elsewhere in the forward (or not at
            # all): its bucket waits at the start of the next one.
            covered = {p for m in self._ran for p in self._covers[m]}
            self._late = [b for b in self.buckets if not all(p in covered for p in b.params)]
            self._ran = set()

    def _all_gather_params(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.stage == 1:
            # The step has consumed the shard gradients (slices of the full buffers): zero the
            # buffers so the next backward accumulates into them in place (DDP's
            # gradient_as_bucket_view) instead of allocating and copying.
            for b in self.buckets:
                if b.grad_buffer is not None:
                    b.grad_buffer.zero_()
        if self.masters is not None:
            self._masters_into_params()
        # Reversed: in the order the next forward needs them, the same on every rank. In place:
        # each rank's input is its own slice of the output (NCCL and gloo allow it), in the
        # parameters' dtype (the buffer is theirs).
        with torch.profiler.record_function("ultrascale/param_all_gather"):  # named in traces (profiler=torch)
            for b in reversed(self.buckets):
                assert isinstance(b, _Bucket)
                own = b.flat_params[self.rank * b.shard_numel : (self.rank + 1) * b.shard_numel]
                b.gathering = _all_gather(b.flat_params, own, group=self.group, async_op=True)

    def _masters_into_params(self) -> None:
        """Round the updated fp32 master slices into this rank's slices of the bf16 buffers.

        A shard's fp32 gradient that was a copy of a bf16 reduction has been used by the step: it
        is dropped (fp32 main gradients are the buffers themselves, and stay).
        """
        with torch.no_grad():
            for b in self.buckets:
                assert b.master is not None
                start = self.rank * b.shard_numel
                b.flat_params[start : start + b.master.numel()].copy_(b.master)
                if not self.main_grads:
                    b.shard.grad = None

    def load_masters(self, values: Mapping[nn.Parameter, torch.Tensor] | None = None) -> None:
        """After a checkpoint filled the master slices: every rank's parameters take their values (a collective).

        ``values``: whole fp32 values by parameter (a single-file checkpoint) the slices take first.
        """
        if self.masters is None:
            return
        self.wait_for_parameters()
        if values is not None:
            with torch.no_grad():
                for b in self.buckets:
                    assert b.master is not None
                    start = self.rank * b.shard_numel
                    b.master.copy_(_master_slice(values, b.params, b.offsets, start, b.master.numel()))
        self._masters_into_params()
        for b in self.buckets:
            own = b.flat_params[self.rank * b.shard_numel : (self.rank + 1) * b.shard_numel]
            _all_gather(b.flat_params, own, group=self.group)

    def master_state(self, names: Mapping[nn.Parameter, Sequence[str]]) -> dict[str, Any]:
        """The fp32 masters this rank holds, as checkpoint chunks keyed by parameter name (``state_dict``'s format).

        ``None`` for a parameter none of whose elements this rank's shards hold: its name must not
        be written (nor read) by this rank, whose bf16 copy is no part of the checkpoint.
        """
        out: dict[str, Any] = {}
        if self.masters is None:
            return out
        for b in self.buckets:
            for p, offset in zip(b.params, b.offsets):
                entry = self._param_state(b, p, offset, {"master": b.shard}).get("master")
                out.update(dict.fromkeys(names[p], entry))
        return out

    # ---- checkpoint: the per-parameter format every layout reads --------------------------------

    def state_dict(self, names: Mapping[nn.Parameter, Sequence[str]]) -> dict[str, Any]:
        """This rank's part of the optimizer state of this engine's parameters, keyed by parameter name.

        The format every layout saves (``lightning_ultrascale.core.checkpoint``): ``state.<name>.<key>``
        at the parameter's own shape, ``param_groups.<name>.<hyperparameter>``; ``names`` gives
        each parameter's names in the model (a tied weight has two). An element-wise state
        (Adam's ``exp_avg``) holds this rank's part of the parameter as chunks
        (:mod:`.flat_chunks`) that are views of the live state, so ``dcp.load`` into this dict
        fills the optimizer in place, from a checkpoint of any layout; :meth:`load_state_dict`
        then restores hyperparameters and non-tensor state. Missing states are created first.
        """
        optimizer = self._require_optimizer()
        initialize_state(optimizer)
        # That may have stepped, launching the gathers: a save reads the parameters, a load writes them.
        self.wait_for_parameters()
        out: dict[str, Any] = {}
        for b in self.buckets:
            group = next(g for g in optimizer.param_groups if any(p is b.shard for p in g["params"]))
            hyper = {h: v for h, v in group.items() if h != "params"}
            for p, offset in zip(b.params, b.offsets):
                entries = self._param_state(b, p, offset, optimizer.state[b.shard])
                for name in names[p]:
                    out.update({f"state.{name}.{k}": v for k, v in entries.items()})
                    out.update({f"param_groups.{name}.{h}": v for h, v in hyper.items()})
        return out

    def _param_state(self, b: _Bucket, p: nn.Parameter, offset: int, state: dict[str, Any]) -> dict[str, Any]:
        """The part of ``p``'s state that this rank's shard of bucket ``b`` holds."""
        lo = self.rank * b.shard_numel
        hi = min(lo + b.shard_numel, b.numel)
        start, stop = max(offset, lo), min(offset + local_tensor(p).numel(), hi)
        entries: dict[str, Any] = {}
        for key, value in state.items():
            if not (isinstance(value, DTensor) and value.shape == (b.numel,)):
                entries[key] = value  # a per-shard scalar (Adam's step): the same for every parameter
            elif start < stop:
                local = value.to_local()[start - lo : stop - lo]
                piece_shape, piece_offset = _piece(p)
                entries[key] = flat_chunks(local, start - offset, piece_shape, piece_offset, p.shape, self.mesh)
        return entries

    def load_state_dict(self, state: dict[str, Any], names: Mapping[nn.Parameter, Sequence[str]]) -> None:
        """Finish a load into what :meth:`state_dict` returned: hyperparameters and non-tensor state."""
        optimizer = self._require_optimizer()
        for b in self.buckets:
            first = names[b.params[0]][0]
            live = optimizer.state[b.shard]
            for key, value in list(live.items()):
                loaded = state.get(f"state.{first}.{key}", value)
                if not isinstance(value, torch.Tensor):
                    live[key] = loaded  # tensors were filled in place
            group = next(g for g in optimizer.param_groups if any(p is b.shard for p in g["params"]))
            group.update({h: state[f"param_groups.{first}.{h}"] for h in group if h != "params"})

    def parameter_at(self, shard: torch.Tensor, index: int) -> nn.Parameter | None:
        """The parameter whose element ``index`` of this rank's ``shard`` is (for error messages)."""
        for b in self.buckets:
            if b.shard is shard:
                flat = self.rank * b.shard_numel + index
                return next((p for p, o in zip(b.params, b.offsets) if o <= flat < o + local_tensor(p).numel()), None)
        return None

    def shard_of(self, param: nn.Parameter) -> nn.Parameter | None:
        """The shard of the bucket that holds ``param`` alone (see ``alone``), else ``None``."""
        return next((b.shard for b in self.buckets if b.params == [param]), None)

    def shard_norm_groups(self) -> dict[nn.Parameter, tuple[dist.ProcessGroup, ...]]:
        """Shards of tensor-parallel pieces, and the tp groups their local values are also split over.

        A shard is ``Shard(0)`` over this engine's mesh only, but when its bucket holds
        tensor-parallel pieces every tp rank's shard holds other values: the gradient norm must
        sum its square over those groups too (``Layout.grad_norm``).
        """
        return {b.shard: _sum_groups(b.params[0]) for b in self.buckets if _sum_groups(b.params[0])}

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("ZeroEngine.attach(optimizer) must run first")
        return self.optimizer

    # ---- accounting and teardown ----------------------------------------------------------------

    def full_grads(self) -> dict[nn.Parameter, torch.Tensor]:
        """The averaged gradient of every model parameter, gathered from the shards.

        A collective (every rank must call it) that materialises Ψ gradient bytes: for parity
        tests and debugging, not for training. Empty between ``zero_grad(set_to_none=True)`` and
        the next synced backward.
        """
        grads: dict[nn.Parameter, torch.Tensor] = {}
        for b in self.buckets:
            if b.shard.grad is None:
                continue
            flat = b.shard.grad.full_tensor()
            grads.update(
                {
                    p: _grad_in(flat[o : o + local_tensor(p).numel()].view_as(local_tensor(p)), p)
                    for p, o in zip(b.params, b.offsets)
                }
            )
        return grads

    def full_masters(self) -> dict[nn.Parameter, nn.Parameter]:
        """Each parameter's whole fp32 master, gathered from the shards (a collective; a second setup's start)."""
        masters: dict[nn.Parameter, nn.Parameter] = {}
        for b in self.buckets:
            flat = b.shard.full_tensor().detach()
            for p, o in zip(b.params, b.offsets):
                view = flat[o : o + local_tensor(p).numel()].view_as(local_tensor(p))
                masters[p] = nn.Parameter(_grad_in(view, p), requires_grad=p.requires_grad)
        return masters

    @property
    def grad_buffers(self) -> list[torch.Tensor]:
        """Every gradient tensor this rank holds (for model-state accounting).

        The full flat buckets (ZeRO-1: always once allocated; ZeRO-2: only until their
        reduce-scatter) and the local parts of the shard gradients.
        """
        full = [b.grad_buffer for b in self.buckets if b.grad_buffer is not None]
        kept = [b.reduced for b in self.buckets if b.reduced is not None and b.work is None]
        return full + kept + [b.shard.grad.to_local() for b in self.buckets if b.shard.grad is not None]

    def remove(self) -> None:
        """Detach every hook (the model keeps the values of its last step)."""
        self.wait_for_parameters()
        super().remove()
        for handle in self._waits:
            handle.remove()
        self._waits.clear()


def _holders(parts: Sequence[nn.Module]) -> dict[nn.Module, list[nn.Parameter]]:
    """The modules whose forward pre-hook waits for the buckets of ``params`` (in the order they run).

    A module holding parameters waits for its own; a compiled region (``Compile``) waits for every
    parameter inside it, before its compiled forward: a hook inside would run in the graph, and
    its lookup keyed by the module would make each block a graph of its own.
    """
    holders: dict[nn.Module, list[nn.Parameter]] = {}
    inside: set[nn.Module] = set()
    for part in parts:
        for module in part.modules():
            if module in inside or module in holders:
                continue
            if is_compiled(module):
                inside.update(module.modules())
                holders[module] = list(module.parameters())
            else:
                holders[module] = list(module.parameters(recurse=False))
    return {m: params for m, params in holders.items() if params}
