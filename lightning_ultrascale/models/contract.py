"""The model contract: every hook a layout may need of a model, declared and checked in one place.

A model trains under a layout when it has what that layout's plugins use. :func:`check_model`
checks it for the chosen layout before any process group exists (``UltraScaleStrategy`` calls
it) and names, for each missing hook, what it is for, how to add it and where a working one is.

===========================  ==================  ============================  ===========================
hook                         on                  needed by                     example
===========================  ==================  ============================  ===========================
``spec: ModelSpec``          the model           every layout                  ``Llama.spec``
``init_weights(seed)``       the model           every layout (meta init)      ``Llama.init_weights``
``flops_per_token(seq)``     the model           optional: MFU (n/a without)   ``Llama.flops_per_token``
``spec.layers`` blocks       the model           every layout                  ``Llama.layers``
``forward(..., position_ids)``  the model        ContextParallel, Pipeline     ``Llama.forward``
``forward_stage(...)``       the model           PipelineParallel              ``Llama.forward_stage``
``loss_fn(logits, labels)``  the LightningModule PipelineParallel              ``LlamaModule.loss_fn``
``attention_fn(q, k, v)``    each attention      ContextParallel (swapped)     ``Attention.attention_fn``
``spec.tp_plan``             the spec            TensorParallel                ``llama_tp_plan``
head counts                  each attention      TensorParallel                ``Attention.forward``
``experts``, ``dispatcher``  each MoE module     ExpertParallel                ``MoE``
``pop_aux_loss(blocks)``     the model           optional: aux losses (PP)     ``Llama.pop_aux_loss``
===========================  ==================  ============================  ===========================

``init_weights(seed)`` gives every parameter a value that depends only on ``seed`` and the
parameter's name, never on the rank or on how it is sharded: the strategy calls it on each rank's
shards. Head counts: read them from the projections' outputs (``view(b, s, -1, head_dim)``), or
keep them as ``n_heads`` / ``n_kv_heads`` attributes of the attention module, which
``TensorParallel`` sets to the rank's own counts.

**Set by the library** (declared here; a model only provides the attribute): ``attention_fn``
(ContextParallel: ring or all-to-all attention), ``dispatcher`` (ExpertParallel: the all-to-all),
``sequence_split`` on any module that has it (ContextParallel: which chunks a rank holds), and
``aux_loss_scale`` on pipeline stages (PipelineParallel).

**The batch**: a dict of ``[batch, seq]`` tensors, :data:`BATCH_KEYS`: ``input_ids`` (long),
``labels`` (``-100`` is ignored), and optionally ``position_ids`` and ``document_ids`` (packed
documents' ids). Context and pipeline parallelism handle each key by name (split along the
sequence or into microbatches; a CP rank keeps the whole document ids for its attention masks),
so under them a batch of another type, or with another key, is refused (:func:`check_batch`).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_ultrascale.errors import ContractError
from lightning_ultrascale.models.shard_init import clean_name
from lightning_ultrascale.models.spec import (
    ModelSpec,
    PipelineLoss,
    RoutedExperts,
    StagedModel,
    SwappableAttention,
    declares,
    spec_of,
)

#: What a batch may hold under context and pipeline parallelism (each handled by name).
BATCH_KEYS = ("input_ids", "labels", "position_ids", "document_ids")

EVERY = "every layout"


@dataclass(frozen=True)
class Hook:
    """One entry of the contract: what it is, which plugins need it, how to add it, an example."""

    name: str
    needed_by: str  # a plugin class name, or EVERY
    how: str
    example: str
    present: Callable[[nn.Module, Any, ModelSpec], bool]


def _attentions(model: nn.Module, spec: ModelSpec) -> list[nn.Module]:
    layers = model.get_submodule(spec.layers)
    return [block.get_submodule(spec.attention) for block in layers.children()]


def _takes(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True  # not introspectable: the runtime check (position handshake) decides
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _layers_are_numbered(model: nn.Module, spec: ModelSpec) -> bool:
    layers = model.get_submodule(spec.layers) if _has_submodule(model, spec.layers) else None
    if isinstance(layers, nn.ModuleList):
        return True  # the strategy holds it as Blocks (models.blocks): names kept, blocks droppable
    return isinstance(layers, nn.ModuleDict) and list(layers.keys()) == [str(i) for i in range(len(layers))]


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


HOOKS: tuple[Hook, ...] = (
    Hook("init_weights(seed)", EVERY,
         "a method giving every parameter a value that depends only on the seed and the parameter's name "
         "(the strategy builds the model on the meta device and calls it on each rank's shards)",
         "lightning_ultrascale.models.llama.Llama.init_weights",
         lambda m, module, spec: callable(getattr(m, "init_weights", None))),
    Hook("spec.layers as an nn.ModuleList, or an nn.ModuleDict keyed '0'..'n-1'", EVERY,
         "hold the blocks in nn.ModuleList([...]) or nn.ModuleDict({str(i): block ...}) (a pipeline stage drops "
         "the blocks it does not run and keeps the others' names, so checkpoints stay layout independent)",
         "lightning_ultrascale.models.llama.Llama.__init__",
         lambda m, module, spec: _layers_are_numbered(m, spec)),
    Hook("forward(..., position_ids=...)", "ContextParallel",
         "accept position_ids [batch, seq] and build RoPE from them: a context-parallel rank holds chunks of "
         "the sequence (zig-zag: two far apart), so positions counted from 0 are wrong",
         "lightning_ultrascale.models.llama.Llama.forward",
         lambda m, module, spec: _takes(m.forward, "position_ids")),
    Hook("forward_stage(x, position_ids, blocks, embed=, head=)", "PipelineParallel",
         "a method running the named blocks (with the embedding first if embed, the norm and head last if "
         "head) on x: token ids on the first stage, the previous stage's hidden state elsewhere",
         "lightning_ultrascale.models.llama.Llama.forward_stage",
         lambda m, module, spec: declares(m, StagedModel)),
    Hook("loss_fn(logits, labels) on the LightningModule", "PipelineParallel",
         "a method returning the mean loss of one microbatch (the last stage computes it; labels -100 ignored)",
         "lightning_ultrascale.training.module.LlamaModule.loss_fn",
         lambda m, module, spec: declares(module, PipelineLoss)),
    Hook("attention_fn(q, k, v) on each block's attention module", "ContextParallel",
         "an attribute holding the attention kernel, called as attention_fn(q, k, v) with q, k, v of shape "
         "[batch, heads, seq, head_dim] (context parallelism swaps it for ring or all-to-all attention)",
         "lightning_ultrascale.models.llama.Attention",
         lambda m, module, spec: all(declares(a, SwappableAttention) for a in _attentions(m, spec))),
    Hook("experts and dispatcher on each MoE block's spec.moe module", "ExpertParallel",
         "the MoE module holds its experts' weights in `experts` (stacked [experts, ...] parameters, split over "
         "the expert ranks) and routes rows through `dispatcher(experts, rows, counts)`, which expert "
         "parallelism replaces with its all-to-all",
         "lightning_ultrascale.models.common.moe.MoE",
         lambda m, module, spec: all(
             declares(m.get_submodule(f"{spec.layers}.{i}.{spec.moe}"), RoutedExperts)
             for i in spec.moe_blocks if str(i) in m.get_submodule(spec.layers)
         )),
    Hook("spec.tp_plan", "TensorParallel",
         "ModelSpec(tp_plan=fn), fn(sequence_parallel) -> (top-level plan, {block name: block plan}) of DTensor "
         "ParallelStyles",
         "lightning_ultrascale.models.llama.llama_tp_plan",
         lambda m, module, spec: spec.tp_plan is not None),
)  # fmt: skip


def check_model(model: nn.Module, module: Any, plugins: Sequence[Any]) -> None:
    """Raise :class:`ContractError` naming every hook ``model`` (and its LightningModule ``module``)
    lacks for ``plugins`` (the layout's plugins that split something; see the module docstring).

    Example:
        >>> from lightning_ultrascale.models import build_model
        >>> from lightning_ultrascale import PipelineParallel
        >>> check_model(build_model("llama_tiny", device="meta"), object(), [PipelineParallel(2)])
        Traceback (most recent call last):
        ...
        lightning_ultrascale.errors.ContractError: Llama lacks what the layout needs:...
    """
    spec = spec_of(model)
    if spec is None:
        raise ContractError(
            f"{type(model).__name__} has no `spec: ModelSpec` attribute; every layout needs it (block list, "
            "attention, embedding, norm and head names, sizes). Example: lightning_ultrascale.models.llama.Llama.spec"
        )
    active = {type(p).__name__ for p in plugins if (getattr(p, "size", 1) or 1) > 1}
    missing = [
        h for h in HOOKS if (h.needed_by == EVERY or h.needed_by in active) and not h.present(model, module, spec)
    ]
    if missing:
        lines = [f"- {h.name} (needed by {h.needed_by}): {h.how}. Example: {h.example}" for h in missing]
        raise ContractError(
            f"{type(model).__name__} lacks what the layout needs:\n" + "\n".join(lines) + "\n(the model "
            "contract: lightning_ultrascale.models.contract; docs/models.md, 'Your own model')"
        )


def check_module(module: nn.Module, plugins: Sequence[Any]) -> None:
    """:func:`check_model` on the model ``module`` holds, if it holds one yet (a model built in
    ``configure_model`` is checked once built, by the strategy)."""
    for sub in module.modules():
        if spec_of(sub) is not None:
            check_model(sub, module, plugins)
            return


def check_batch(batch: Any, technique: str, also: Sequence[str] = ()) -> dict[str, Any]:
    """``batch`` if it is a dict of :data:`BATCH_KEYS` (and the keys ``also`` names) with ``input_ids`` and
    ``labels``; else a :class:`ContractError` naming the expected format (``technique`` splits every key of it)."""
    if not isinstance(batch, dict):
        raise ContractError(
            f"{technique} needs each batch as a dict of [batch, seq] tensors ({', '.join(BATCH_KEYS)}; input_ids "
            f"and labels required), got a {type(batch).__name__}: it splits each key by name (along the sequence "
            "or into microbatches) and cannot split what it cannot name. Return such a dict from your DataModule "
            "(UltraScaleDataModule does)"
        )
    unknown = sorted(set(batch) - set(BATCH_KEYS) - set(also))
    absent = [k for k in ("input_ids", "labels") if k not in batch]
    if unknown or absent:
        raise ContractError(
            f"{technique} handles each key of a batch by name, and knows {', '.join((*BATCH_KEYS, *also))}; got "
            f"{', '.join(map(repr, batch))}"
            + (f" (unknown: {', '.join(unknown)})" if unknown else "")
            + (f" (missing: {', '.join(absent)})" if absent else "")
            + ". Drop or rename the other keys in your DataModule (a key left unsplit would train on another "
            "rank's tokens)"
        )
    return batch


# ----------------------------------------------------------------------------- initialisation
def init_reference(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` before any plugin touches it (meta: no memory), for :func:`check_init`.

    None (nothing to check) for a model built whole, or one whose ``init_weights`` loads a
    checkpoint (a ``pretrained`` loader: the values are the file's, whatever the layout).
    """
    if getattr(model, "pretrained", None) is not None or not any(p.is_meta for p in model.parameters()):
        return None
    return copy.deepcopy(model)


def check_init(model: nn.Module, reference: nn.Module | None, seed: int, device: torch.device) -> None:
    """Refuse an ``init_weights(seed)`` that depends on the rank or the sharding, on every rank.

    The strategy initialises each rank's shards; a model whose ``init_weights`` draws from a
    global random stream (``torch.manual_seed`` + ``nn.init`` on shards) starts each layout from
    other weights, silently. One parameter (the smallest matrix of the rank's first block) is
    initialised again, whole, on ``reference`` (the model before any plugin, all else left on the
    meta device) and compared with the rank's shard of it. Every rank learns the verdict (one
    all-reduce of a flag), so every rank raises.
    """
    found = _probe(model, reference) if reference is not None else None
    bad = 0.0
    if found is not None:
        _, param, whole = found
        try:
            reference.init_weights(seed)  # type: ignore[operator, union-attr]
            bad = float(not _same(param, whole.detach()))
        except Exception as err:  # a model whose init needs every parameter real
            warnings.warn(
                f"could not check that init_weights(seed) ignores the layout ({err}); make it depend on (seed, "
                "parameter name) alone (lightning_ultrascale.models.shard_init.init_by_name)",
                stacklevel=2,
            )
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([bad], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = float(flag.item())
    if bad:
        raise ContractError(
            f"{type(model).__name__}.init_weights(seed) depends on the rank or the sharding: a parameter "
            f"({found[0] if found else 'on another rank'}) initialised on this layout's shards differs from the same "
            "parameter initialised whole. Every layout would start from other weights. Give each parameter values "
            "that depend only on (seed, its name): lightning_ultrascale.models.shard_init.init_by_name(self, seed, "
            "std_of) does (example: tests/own_model.py, docs/models.md, 'Your own model')"
        )


def _probe(model: nn.Module, reference: nn.Module) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """(name, the layout's parameter, the reference's copy materialised on its device) of the smallest
    matrix in the rank's first block; the reference's copy is empty until its ``init_weights`` runs."""
    spec = model.spec  # type: ignore[attr-defined]
    blocks = list(model.get_submodule(spec.layers).keys())  # type: ignore[operator]
    if not blocks:
        return None
    prefix = f"{spec.layers}.{blocks[0]}."
    matrices = []
    for fqn, param in model.named_parameters():
        name = clean_name(fqn)
        if name.startswith(prefix) and param.dim() == 2:
            matrices.append((param.numel(), name, param))
    if not matrices:
        return None
    _, name, param = min(matrices, key=lambda m: m[0])
    owner, _, attr = name.rpartition(".")
    module = reference.get_submodule(owner)
    local = param.to_local() if hasattr(param, "to_local") else param
    whole = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=local.device))
    setattr(module, attr, whole)
    return name, param, whole


def _same(param: torch.Tensor, whole: torch.Tensor) -> bool:
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import distribute_tensor

        expected = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
        mine = param.to_local()
    else:
        expected, mine = whole, param
    return mine.shape == expected.shape and torch.allclose(mine.float(), expected.float(), rtol=1e-5, atol=1e-8)
