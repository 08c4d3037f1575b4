"""This rank's part of a Hugging Face file tensor: what both HF weight readers load into.

A file holds whole tensors, an expert's in one tensor each; a rank holds shards (tensor-parallel,
FSDP, expert-parallel) of some of them (a pipeline stage's). :class:`RankParts` answers, per file
tensor, which of this rank's tensors it is read into (a view: nothing is gathered), or that this
rank holds none of it. Used by :func:`~lightning_ultrascale.models.hf.convert.load_hf_weights` (our
Llama from an HF directory) and :func:`~lightning_ultrascale.models.hf.weights.load_hf_directory`
(an HF model trained as it is).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["RankParts", "local_experts"]


class RankParts:
    """This rank's load target of each file tensor, given the tensors it holds by name.

    Example:
        >>> held = {"w": torch.zeros(2, 3), "experts": torch.zeros(4, 2, 3)}
        >>> part = RankParts(held)
        >>> part("w", None).shape, part("experts", 1).shape, part("other", None)
        (torch.Size([2, 3]), torch.Size([2, 3]), None)
    """

    def __init__(self, held: Mapping[str, Tensor]) -> None:
        self.held = held
        self._experts: dict[str, tuple[list[Tensor], int]] = {}

    def __call__(self, name: str, expert: int | None) -> Tensor | None:
        """The tensor the file tensor of parameter ``name`` (expert ``expert`` of it) loads into, or None.

        None: another pipeline stage's parameter, or an expert another expert-parallel rank holds.
        """
        if name not in self.held:
            return None
        if expert is None:
            return self.held[name]
        if name not in self._experts:
            self._experts[name] = local_experts(self.held[name])
        local, first = self._experts[name]
        return local[expert - first] if first <= expert < first + len(local) else None


def local_experts(weight: Tensor) -> tuple[list[Tensor], int]:
    """Load targets of this rank's experts of a stacked ``[E, ...]`` weight, and the global index of its first.

    Each target shares its expert's storage. Where ZeRO-3 splits inside each expert (fewer
    experts per rank than expert-data ranks: FSDP shards dim 1), a target is a DTensor of the
    expert's whole ``[...]`` shape holding this rank's rows, so DCP reads just those rows.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(weight, DTensor):
        return list(weight.unbind(0)), 0
    shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    local = weight.to_local()
    if tuple(shape[1:]) == tuple(weight.shape[1:]):
        return list(local.unbind(0)), offset[0]
    # The expert dim's split picks whole experts (no split of one expert); the others move down a dim.
    placements = [
        Replicate() if p.is_shard(0) else Shard(p.dim - 1) if isinstance(p, Shard) else p  # type: ignore[attr-defined]
        for p in weight.placements
    ]
    one = weight.shape[1:]
    stride = torch.empty(one, device="meta").stride()
    experts = [DTensor.from_local(e, weight.device_mesh, placements, run_check=False, shape=one, stride=stride)
               for e in local.unbind(0)]  # fmt: skip
    return experts, offset[0]
