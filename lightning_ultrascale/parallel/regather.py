"""Sequence-parallel inputs kept sharded for backward, all-gathered again there (Megatron's SP memory saving).

Under sequence parallelism each sub-layer's input (the norm's output) is all-gathered over ``tp`` before
its column-parallel projections, and those projections save the gathered ``[b, s, h]`` tensor for their
weight gradients: per block two full-sequence tensors, ``2 s h`` elements, where everything else of the
norms is ``s h / tp``. Megatron-Core keeps the sequence shard instead and all-gathers it again in backward
(``LinearWithGradAccumulationAndAsyncCommunication``); :class:`RegatheredInput` does the same for any
:class:`~torch.distributed.tensor.parallel.PrepareModuleInput` of the plan that gathers a ``Shard`` into
``Replicate``: while the module runs forward, autograd's saved-tensor hooks swap each tensor saved from
the gathered storage for a reference to the shard; in backward the first projection that needs it
all-gathers once, the module's other projections reuse that copy, and it is freed after the last one.

Cost: one more all-gather per gathered input in backward (on the critical path here; Megatron overlaps
it with the input-gradient GEMM). Saving: ``(tp - 1) / tp`` of each gathered input, per block and
microbatch in flight. Values and gradients are bit for bit those of the plain plan: an all-gather moves
the same bytes again.

Inside activation checkpointing (a recomputed block, op-level SAC) the checkpoint owns what is saved and
the module runs as the plain plan: a fully recomputed block keeps only its input anyway, and
``selective_op`` recomputes the all-gather itself. Other saved-tensor hooks active around the module
(activation offloading, a memory probe) still see every tensor but the gathered inputs.

Under ``torch.compile`` (``Compile``) saved-tensor hooks cannot be traced: ``TensorParallel`` refuses the
pair.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput

__all__ = ["RegatheredInput", "regathered"]


class _Gathered:
    """One forward's gathered input: its shard (kept), and its full copy again once backward asks."""

    def __init__(self, shard: DTensor, gathered: torch.Tensor) -> None:
        self.shard = shard
        self.storage = gathered.untyped_storage().data_ptr()
        self.layout = (gathered.size(), gathered.stride())
        self._full: torch.Tensor | None = None

    def full(self) -> torch.Tensor:
        """The gathered local tensor, all-gathered from the shard on the first call (in backward)."""
        if self._full is None:
            full = self.shard.redistribute(self.shard.device_mesh, (Replicate(),))._local_tensor
            if (full.size(), full.stride()) != self.layout:
                raise RuntimeError(
                    f"RegatheredInput: the all-gather in backward gave a tensor of size {tuple(full.size())} and "
                    f"strides {full.stride()}, the forward's had {tuple(self.layout[0])} and {self.layout[1]}"
                )
            self._full = full
        return self._full


@dataclass(frozen=True)
class _Saved:
    """What autograd keeps instead of a tensor saved from the gathered storage: where it sat in it."""

    gathered: _Gathered
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    spec: Any  # the DTensor's spec when autograd saved a DTensor view, else None


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding ``t``'s data (a DTensor's local shard), or None for other subclasses."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local if type(local) is torch.Tensor else None


class _SwapGathered:
    """The saved-tensor hooks of one module's forward: tensors viewing a gathered input's storage are not kept.

    Hooks already active (``outer``: a memory probe, activation offloading) still see every other tensor: only
    the innermost pair of saved-tensor hooks runs, so these call theirs.
    """

    def __init__(self, gathered: list[_Gathered], outer: tuple[Any, Any] | None) -> None:
        self.by_storage = {g.storage: g for g in gathered}
        self.outer_pack, self.outer_unpack = outer or (None, None)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        local = _local(t)
        gathered = None if local is None else self.by_storage.get(local.untyped_storage().data_ptr())
        if gathered is None:
            return (self.outer_pack(t),) if self.outer_pack is not None else t
        spec = t._spec if isinstance(t, DTensor) else None
        return _Saved(gathered, local.size(), local.stride(), local.storage_offset(), spec)

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, tuple):
            return self.outer_unpack(saved[0])
        if not isinstance(saved, _Saved):
            return saved
        local = saved.gathered.full().as_strided(saved.size, saved.stride, saved.offset)
        if saved.spec is None:
            return local
        return DTensor(local, saved.spec, requires_grad=False)


def _recomputing() -> tuple[bool, tuple[Any, Any] | None]:
    """(whether activation checkpointing owns what this forward saves, the saved-tensor hooks active now)."""
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return outer is not None and getattr(outer[0], "__module__", None) == "torch.utils.checkpoint", outer


class RegatheredInput(PrepareModuleInput):
    """:class:`PrepareModuleInput` whose all-gathered inputs are not kept for backward: their shards are.

    Example:
        >>> from torch.distributed.tensor import Replicate, Shard
        >>> RegatheredInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)).gathers
        (0,)
        >>> RegatheredInput(input_kwarg_layouts={"x": Shard(1)}, desired_input_kwarg_layouts={"x": Replicate()}).gathers
        ('x',)
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        pairs = [*enumerate(zip(self.input_layouts or (), self.desired_input_layouts or ()))]
        pairs += [(k, (v, self.desired_input_kwarg_layouts.get(k))) for k, v in self.input_kwarg_layouts.items()]
        #: The inputs this style all-gathers (a ``Shard`` made ``Replicate``): positions and keywords.
        self.gathers = tuple(i for i, (a, b) in pairs if isinstance(a, Shard) and isinstance(b, Replicate))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        active: list[_SwapGathered] = []

        def before(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            if self.with_kwargs:
                new_args, new_kwargs = self._prepare_input_kwarg_fn(args, kwargs, device_mesh)
            else:
                new_args, new_kwargs = self._prepare_input_fn(args, device_mesh), kwargs
            recomputing, outer = _recomputing()
            if torch.is_grad_enabled() and not recomputing:
                gathered = list(self._gathered(args, kwargs, new_args, new_kwargs, device_mesh))
                active.append(_SwapGathered(gathered, outer))
                active[-1].hooks.__enter__()
            return new_args, new_kwargs

        def after(*_: Any) -> None:
            if active:
                active.pop().hooks.__exit__(None, None, None)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, always_call=True)
        return module

    def _gathered(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], new_args: Any, new_kwargs: dict[str, Any], mesh: DeviceMesh
    ) -> Iterator[_Gathered]:
        for key in self.gathers:
            if isinstance(key, int):
                before, after, layout = args[key], new_args[key], self.input_layouts[key]
            else:
                before, after, layout = kwargs.get(key), new_kwargs.get(key), self.input_kwarg_layouts[key]
            gathered = _local(after) if isinstance(after, torch.Tensor) else None
            if gathered is not None and isinstance(before, torch.Tensor):
                yield _Gathered(_as_dtensor(before, mesh, layout), gathered)


def _as_dtensor(x: torch.Tensor, mesh: DeviceMesh, placement: Placement) -> DTensor:
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (placement,), run_check=False)


def regathered(style: ParallelStyle) -> ParallelStyle:
    """``style`` as a :class:`RegatheredInput` if it is a :class:`PrepareModuleInput` that all-gathers a sequence
    shard; any other style unchanged.

    Example:
        >>> from torch.distributed.tensor import Replicate, Shard
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput
        >>> type(regathered(PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()))).__name__
        'RegatheredInput'
        >>> type(regathered(ColwiseParallel())).__name__
        'ColwiseParallel'
    """
    if type(style) is not PrepareModuleInput:
        return style
    candidate = RegatheredInput(
        input_layouts=style.input_layouts,
        desired_input_layouts=style.desired_input_layouts,
        input_kwarg_layouts=style.input_kwarg_layouts if style.with_kwargs else None,
        desired_input_kwarg_layouts=style.desired_input_kwarg_layouts if style.with_kwargs else None,
        use_local_output=style.use_local_output,
    )
    return candidate if candidate.gathers else style
