"""A pipeline stage as a module: a view of the pieces of the model that one stage runs.

The rank keeps ONE model object holding every piece of all its stages (so parameter names, and
with them checkpoints and per-parameter seeding, are those of the whole model). Each stage is a
:class:`StageModule` that registers the same embedding / blocks / norm / head modules as its
children, so ``stage.parameters()`` are exactly the stage's (torch's ``PipelineStage`` computes
weight gradients from them) and FSDP can wrap a stage as the root of its own unit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ultrascale.models.common.moe import attach_aux_loss
from lightning_ultrascale.models.spec import AuxLossModel, ModelSpec, declares, drop_piece


class StageModule(nn.Module):
    """Stage ``index`` of a pipeline: ``forward(x, position_ids) -> hidden state or logits``.

    ``x`` is the token ids on the first stage and the previous stage's hidden state elsewhere.
    The model must implement ``forward_stage(x, position_ids, blocks, embed=, head=)`` (our
    :class:`~lightning_ultrascale.models.llama.Llama` does).

    A model with auxiliary losses (MoE balancing: ``pop_aux_loss(blocks)``) has them join the
    objective through this stage's own backward, weighted by ``aux_loss_scale()`` (the weight of
    one token's loss in the step), instead of carrying them to the last stage; ``aux_total`` adds
    up their weighted values for the reported loss.

    Multi-token prediction (``spec.mtp_depth``) runs on the last stage: it holds the MTP blocks (after the
    main ones, not run among them) and the token embedding (a copy of the first stage's, kept equal:
    :class:`~lightning_ultrascale.parallel.tied.TiedCopy`), and gets each microbatch's tokens and labels
    ahead beside the positions; the model keeps the MTP sums for the loss function.
    """

    def __init__(self, model: nn.Module, spec: ModelSpec, index: int, blocks: Sequence[int], first: bool, last: bool):
        super().__init__()
        # The model is not a child: the stage is a view of some of its pieces.
        self.__dict__["_model"] = model
        self.index = index
        self.first = first
        self.last = last
        self.block_names = [str(i) for i in blocks]
        # Multi-token prediction's blocks: held, and run after the head's norm, not among the blocks.
        self.mtp_names = [str(i) for i in spec.mtp_blocks] if last else []
        self.aux_loss_scale: Callable[[], Tensor | float] = lambda: 1.0
        self.aux_total: Tensor | None = None
        self._tracking = True
        layers = model.get_submodule(spec.layers)
        if first or self.mtp_names:
            _attach(self, spec.embedding, model.get_submodule(spec.embedding))
        held = self.block_names + self.mtp_names
        _attach(self, spec.layers, nn.ModuleDict({name: layers[name] for name in held}))
        if last:
            _attach(self, spec.final_norm, model.get_submodule(spec.final_norm))
            _attach(self, spec.head, model.get_submodule(spec.head))

    def forward(
        self,
        x: Tensor,
        position_ids: Tensor,
        document_ids: Tensor | None = None,
        mtp_input_ids: Tensor | None = None,
        mtp_labels: Tensor | None = None,
    ) -> Tensor:
        model = self.__dict__["_model"]
        kwargs: dict[str, Any] = {} if document_ids is None else {"document_ids": document_ids}
        if self.mtp_names and mtp_input_ids is not None and mtp_labels is not None:
            kwargs["mtp"] = {"mtp_input_ids": mtp_input_ids, "mtp_labels": mtp_labels}
        out: Tensor = model.forward_stage(x, position_ids, self.block_names, embed=self.first, head=self.last, **kwargs)
        blocks = self.block_names + self.mtp_names
        aux = model.pop_aux_loss(blocks) if declares(model, AuxLossModel) else None
        if aux is not None and self._tracking:
            scale = self.aux_loss_scale()
            out = attach_aux_loss(out, aux, scale)
            weighted = aux.detach() * scale
            self.aux_total = weighted if self.aux_total is None else self.aux_total + weighted
        return out

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """Forwards that change nothing: torch's metadata inference runs the stage on uninitialised tensors.

        Buffers (an MoE layer's token counts) are restored after, and auxiliary losses dropped.
        """
        saved = [(b, b.clone()) for b in self.buffers()]
        self._tracking = False
        try:
            yield
        finally:
            self._tracking = True
            if self.mtp_names:
                self.__dict__["_model"].pop_mtp_sums()
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)

    def extra_repr(self) -> str:
        return f"index={self.index}, blocks={self.block_names}, first={self.first}, last={self.last}"


def _attach(root: nn.Module, name: str, module: nn.Module) -> None:
    """Register ``module`` at the dotted ``name`` under ``root`` (plain containers in between), so the
    stage's parameter names are the model's (``model.layers.3.mlp...`` in a Hugging Face model)."""
    *path, last = name.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    root.add_module(last, module)


def prune_to_stages(model: nn.Module, spec: ModelSpec, blocks: set[int], first: bool, last: bool) -> set[str]:
    """Drop from ``model`` every piece its rank's stages do not run (on the meta device: free).

    Returns the names of the dropped modules (the Layout's ``dropped``).
    """
    dropped: set[str] = set()
    if last:  # multi-token prediction's blocks (after the main ones) run on the last stage, with the embedding
        blocks = blocks | set(spec.mtp_blocks)
    layers = model.get_submodule(spec.layers)
    for name in list(layers.keys()):
        if int(name) not in blocks:
            del layers[name]
            dropped.add(f"{spec.layers}.{name}")
    embeds = first or (last and spec.mtp_depth > 0)
    pieces = ([] if embeds else [spec.embedding]) + ([] if last else [spec.final_norm, spec.head])
    for piece in pieces:
        drop_piece(model, piece)
        dropped.add(piece)
    return dropped


def first_param_device(module: nn.Module) -> torch.device:
    """Where the module's (local) parameters live."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
