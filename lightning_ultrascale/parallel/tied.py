"""Tied weights: one Parameter that several modules hold (the embedding and the output head, or any other).

A tie is a fact of the model as it was built, found on it before any plugin runs
(:func:`find_tied`, the Layout's ``tied``). Three things untie a model without a word, each
handled here:

- materialising a meta model (``to_empty``) and tensor parallelism's ``parallelize_module`` give
  each module a Parameter of its own: :func:`retie` makes the copies one Parameter again, and
  refuses copies that a plugin laid out differently (they cannot be one tensor);
- a pipeline puts the embedding and the head on different ranks: each holds a copy, and the
  copies are kept equal by construction (:class:`TiedCopy`): the copy of the rank that holds
  the first name (the one a single process initialises) is broadcast once the model is
  initialised, or loaded by its ``pretrained`` loader (:func:`equalise`; a file that stores a
  tied weight once, as Hugging Face's ``save_pretrained`` does, fills only the first name), and
  the copies' gradients are summed before every optimizer step (:func:`sum_gradients`,
  Megatron's "embedding group"), so they take the same steps. Our checkpoints store every
  copy under its own name.

Names are relative to the parallelised model, without wrapper components (``clean_name``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.shard_init import clean_name
from lightning_ultrascale.utils.tensors import local_tensor

if TYPE_CHECKING:
    from lightning_ultrascale.parallel.data.engines import GradientSync

#: Names of one tied Parameter, in ``named_parameters`` order: the first is the name it is known by.
TiedGroup = tuple[str, ...]


@dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of a tied weight whose other copies live on other ranks (pipeline stages).

    ``name``: the copy's name here; ``group``: the ranks holding a copy (same coordinates in every
    other mesh dim); ``source``: the global rank whose copy is the original (it holds the first name).
    """

    name: str
    group: dist.ProcessGroup
    source: int

    @property
    def is_source(self) -> bool:
        return dist.get_rank() == self.source


def find_tied(model: nn.Module) -> tuple[TiedGroup, ...]:
    """Every Parameter that ``model`` holds under several names, as groups of those names.

    Example:
        >>> m = nn.ModuleDict({"embed": nn.Embedding(10, 4), "head": nn.Linear(4, 10, bias=False)})
        >>> m.head.weight = m.embed.weight
        >>> find_tied(m)
        (('embed.weight', 'head.weight'),)
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(clean_name(name))
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def _slots(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """``{clean parameter name: (the module holding it, its attribute)}``, one entry per name a tie has."""
    slots = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr in module._parameters:
            slots[clean_name(f"{prefix}.{attr}" if prefix else attr)] = (module, attr)
    return slots


def _describe(param: torch.Tensor) -> str:
    if isinstance(param, DTensor):
        return f"a DTensor {tuple(param.shape)} placed {list(param.placements)}"
    return f"a tensor {tuple(param.shape)}"


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, DTensor) != isinstance(b, DTensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return not isinstance(a, DTensor) or (a.placements == b.placements and a.device_mesh == b.device_mesh)


def retie(model: nn.Module, tied: Iterable[TiedGroup], by: str) -> None:
    """Make the copies of each tied Parameter that ``model`` holds one Parameter again.

    ``by`` names what gave them separate Parameters, for the error raised where two copies are
    laid out differently (e.g. a tensor-parallel plan that shards the embedding and the head
    along different dims): such copies cannot be one tensor, and training them apart would be
    another model.
    """
    slots = _slots(model)
    for group in tied:
        held = [name for name in group if name in slots]
        if len(held) < 2:
            continue
        first_module, first_attr = slots[held[0]]
        original = first_module._parameters[first_attr]
        assert original is not None
        for name in held[1:]:
            module, attr = slots[name]
            copy = module._parameters[attr]
            if copy is original:
                continue
            assert copy is not None
            if not _same_layout(original, copy):
                raise ConfigError(
                    f"{held[0]} and {name} are one tied Parameter in the model, but {by} laid them out differently "
                    f"({_describe(original)} vs {_describe(copy)}), so they cannot stay one tensor and would train "
                    "as two. Give both the same placement (a tensor-parallel plan sharding both over the vocabulary: "
                    "RowwiseParallel for the embedding, ColwiseParallel for the head), or untie them in the model"
                )
            module._parameters[attr] = original


def find_parameter(model: nn.Module, name: str) -> nn.Parameter:
    """The parameter ``model`` holds under the clean ``name`` (wrapper components such as activation
    checkpointing's left out of the path)."""
    module, attr = _slots(model)[name]
    param = module._parameters[attr]
    assert param is not None
    return param


@torch.no_grad()
def equalise(model: nn.Module, copies: Sequence[TiedCopy]) -> None:
    """Give every rank's copy of a tied weight the original's values (after initialisation or loading)."""
    for copy in copies:
        dist.broadcast(local_tensor(find_parameter(model, copy.name)), src=copy.source, group=copy.group)


def sum_gradients(model: nn.Module, copies: Sequence[TiedCopy], grad_syncs: Sequence[GradientSync]) -> None:
    """Sum the gradients of each tied weight's copies, so that every copy takes the same step.

    Where a data-parallel engine keeps the gradient (fp32 main gradients under ``bf16-mixed``),
    that is summed; the engines reduce over the data ranks afterwards.
    """
    for copy in copies:
        weight = find_parameter(model, copy.name)
        main = next((g for sync in grad_syncs if (g := sync.main_grad(weight)) is not None), None)
        if main is None and weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(local_tensor(main if main is not None else weight.grad), group=copy.group)
