"""Hugging Face directories into and out of a Hugging Face model trained as it is, in any layout.

:func:`load_hf_directory` reads a ``save_pretrained`` directory (safetensors) into an adapted model
(:mod:`~lightning_ultrascale.models.hf.adapter`) through DCP: each rank reads what it holds (a
tensor-parallel, FSDP or expert shard, a pipeline stage's blocks), nothing is gathered. Files keep
the layout models are released in: Mixtral's experts one tensor per expert and projection
(``block_sparse_moe.experts.{j}.w1.weight``), Qwen3-MoE's likewise (``mlp.experts.{j}.gate_proj``);
transformers fuses them into ``gate_up_proj [E, 2F, D]`` / ``down_proj [E, D, F]`` when it loads, and
so does this reader, into the rank's rows of those. Every file tensor must have a place in the model
and every parameter a file tensor: anything else is refused by name.

:func:`save_pretrained` writes the model whole, from any layout, with HF's own ``save_pretrained``
(which writes the released layout back), so ``AutoModelForCausalLM.from_pretrained`` loads it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.hf.adapter import tied_names
from lightning_ultrascale.models.hf.files import file_keys
from lightning_ultrascale.models.hf.parts import RankParts
from lightning_ultrascale.models.shard_init import clean_name, local_indices
from lightning_ultrascale.models.spec import piece

__all__ = ["file_keys", "load_hf_directory", "save_pretrained"]

#: model_type -> (the experts' block name in files, {file projection: (our stacked parameter, half of it)}).
_EXPERT_FILES: dict[str, tuple[str, dict[str, tuple[str, int | None]]]] = {
    "mixtral": ("block_sparse_moe", {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}),
    "qwen3_moe": (
        "mlp",
        {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)},
    ),
}
_EXPERT_KEY = re.compile(r"(.*\.layers\.\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight")
#: Expert tensors read whole then cut: (the whole tensor, the rank's DTensor, half of a fused gate/up).
Later = list[tuple[Tensor, Tensor, int | None]]
_MIXTRAL_ROUTER = re.compile(r"(.*\.layers\.\d+)\.block_sparse_moe\.gate\.weight")


def _model_name(key: str, model_type: str) -> tuple[str, int | None, int | None]:
    """(parameter name in the model, expert index, half of a fused gate/up) of a file tensor."""
    m = _EXPERT_KEY.fullmatch(key)
    if m and model_type in _EXPERT_FILES:
        block, projections = _EXPERT_FILES[model_type]
        if m.group(2) == block and m.group(4) in projections:
            param, half = projections[m.group(4)]
            return f"{m.group(1)}.mlp.experts.{param}", int(m.group(3)), half
    router = _MIXTRAL_ROUTER.fullmatch(key)
    if router and model_type == "mixtral":
        return f"{router.group(1)}.mlp.gate.weight", None, None
    return key, None, None


def _whole_model_names(model: nn.Module) -> set[str]:
    """Every parameter name of the whole model (a pipeline rank holds some), one per tied pair."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(model.config)  # type: ignore[arg-type]
    return {n for n, _ in whole.named_parameters()}


@torch.no_grad()
def load_hf_directory(model: nn.Module, path: str | Path) -> None:
    """Copy the weights of the HF directory ``path`` into the adapted ``model``, in any layout (every rank calls it).

    Example:
        >>> load_hf_directory(module.model, "/models/Qwen2.5-0.5B")  # doctest: +SKIP
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    kind = model.config.model_type  # type: ignore[union-attr]
    held = {clean_name(n): p.detach() for n, p in model.named_parameters()}
    expected = _whole_model_names(model)
    targets: dict[str, Tensor] = {}
    later: Later = []
    covered, unknown = set(), []
    part = RankParts(held)
    for key in file_keys(path):
        name, expert, half = _model_name(key, kind)
        if name not in expected:
            unknown.append(key)
            continue
        covered.add(name)
        target = part(name, expert)
        if target is None:
            continue  # another pipeline stage's, or another rank's expert
        if expert is None:
            targets[key] = target
        else:
            _expert_target(targets, later, key, target, half)
    missing = sorted(expected - covered)
    if unknown or missing:
        raise ConfigError(
            f"model.path={path} does not hold this {kind} model's weights: "
            + (f"file tensors with no place in it: {', '.join(unknown[:5])}; " if unknown else "")
            + (f"parameters the files lack: {', '.join(missing[:5])}" if missing else "")
        )
    load(targets, storage_reader=HuggingFaceStorageReader(str(path)))
    for whole, target, half in later:
        _copy_rows(whole, target, half)


def _expert_target(
    targets: dict[str, Tensor],
    later: list[tuple[Tensor, Tensor, int | None]],
    key: str,
    target: Tensor,
    half: int | None,
) -> None:
    """Where one expert's file tensor goes: a view of the rank's expert, or (an expert split inside,
    ZeRO-3 with fewer experts than ranks) a whole temporary whose rows the rank keeps after the read."""
    if not hasattr(target, "to_local"):
        rows = target.shape[0] // 2
        targets[key] = target if half is None else target[half * rows : (half + 1) * rows]
        return
    shape = target.shape if half is None else (target.shape[0] // 2, *target.shape[1:])
    whole = torch.empty(shape, dtype=target.dtype, device=target.to_local().device)  # type: ignore[attr-defined]
    targets[key] = whole
    later.append((whole, target, half))


def _copy_rows(whole: Tensor, target: Tensor, half: int | None) -> None:
    indices = local_indices(target)
    assert indices is not None
    rows, cols = indices[0], indices[1]
    local = target.to_local()  # type: ignore[attr-defined]
    start = 0 if half is None else half * whole.shape[0]
    mine = (rows >= start) & (rows < start + whole.shape[0])
    local[mine] = whole.index_select(0, rows[mine] - start).index_select(1, cols).to(local.dtype)


def save_pretrained(model: nn.Module, directory: str | Path, **kwargs: Any) -> None:
    """Write an adapted HF model whole, as a Hugging Face directory, from any layout; every rank calls it.

    Each tensor is gathered whole (sharded DTensors: ``full_tensor``; pipeline stages: every
    rank's pieces merged), then rank 0 calls HF's ``save_pretrained(directory, state_dict=...)``
    (``kwargs`` go to it), so ``AutoModelForCausalLM.from_pretrained(directory)`` loads it.

    Example:
        >>> trainer.fit(module)  # doctest: +SKIP
        >>> save_pretrained(module.model, "out/hf")  # doctest: +SKIP
    """
    import torch.distributed as dist

    state = {clean_name(n): (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()
             for n, t in model.state_dict().items()}  # fmt: skip
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    spec = model.spec  # type: ignore[union-attr]
    split = len(model.get_submodule(spec.layers)) < spec.n_layers or piece(model, spec.embedding) is None
    if distributed and (split or piece(model, spec.head) is None):
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, state)  # (pipeline stages: another rank holds the other blocks)
        state = {n: t for part in parts for n, t in part.items()}
    for copy in tied_names(model):  # a tied head is the embedding: saved once, as HF does
        state.pop(copy, None)
    if not distributed or dist.get_rank() == 0:
        model.save_pretrained(directory, state_dict=state, **kwargs)  # type: ignore[operator]
    if distributed:
        dist.barrier()
