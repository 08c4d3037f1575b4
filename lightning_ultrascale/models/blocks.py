"""A model's numbered blocks, held so that a pipeline stage can drop some and keep every name.

Our models keep their blocks in an ``nn.ModuleDict`` keyed ``"0" .. "n-1"``; Hugging Face models
(and most users') in an ``nn.ModuleList``. Deleting from a ``ModuleList`` renumbers the blocks
after it, and with them parameter names, checkpoints and per-parameter seeding. :func:`as_blocks`
turns a ``ModuleList`` into :class:`Blocks` in place: a ``ModuleDict`` under the same keys (so
every parameter keeps its name and ``state_dict`` is unchanged) that also reads like the list it
replaces (``blocks[0]``, ``blocks[:n]``, ``for block in blocks``), so the model's own forward runs
unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["Blocks", "as_blocks", "block_items"]


class Blocks(nn.ModuleDict):
    """Numbered blocks: a ``ModuleDict`` (drop one with ``del blocks["3"]``, the others keep their
    names) read like a ``ModuleList`` (integer index, slices and iteration give blocks, in order).

    Example:
        >>> from torch import nn
        >>> blocks = Blocks({str(i): nn.Linear(2, 2) for i in range(3)})
        >>> del blocks["1"]
        >>> list(blocks.keys()), len(blocks[:]), blocks[2] is blocks["2"]
        (['0', '2'], 2, True)
    """

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return list(self.values())[key]
        if isinstance(key, int):
            return super().__getitem__(str(key))
        return super().__getitem__(key)

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


def as_blocks(model: nn.Module, name: str) -> nn.Module:
    """The blocks at ``name`` in ``model``, a ``ModuleList`` turned into :class:`Blocks` in place
    (parameter names unchanged); a ``ModuleDict`` is returned as it is."""
    layers = model.get_submodule(name)
    if isinstance(layers, nn.ModuleList):
        blocks = Blocks({str(i): block for i, block in enumerate(layers)})
        model.set_submodule(name, blocks)
        return blocks
    return layers


def block_items(layers: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of a ``ModuleDict`` or ``ModuleList`` of blocks, in order."""
    return list(layers.named_children())
