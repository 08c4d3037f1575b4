"""Hugging Face causal LMs trained as they are: the model contract derived from config and module names.

A ``transformers`` causal LM of a supported family (:data:`FAMILIES`) built in
``configure_model`` (``AutoModelForCausalLM.from_config`` under the strategy's meta device, or
``from_pretrained``) needs no code of the user's: :func:`adapt` gives it, in place, what every
layout needs (:mod:`~lightning_ultrascale.models.contract`), and keeps every parameter's name, so
``save_pretrained`` and HF checkpoints read and write it unchanged:

- ``spec``: sizes from the config; pieces by their HF names (``model.embed_tokens``,
  ``model.layers``, ``model.norm``, ``lm_head``; ``self_attn``, ``mlp``); the blocks'
  ``nn.ModuleList`` held as :class:`~lightning_ultrascale.models.blocks.Blocks` (same names);
- attention: the model's ``_attn_implementation`` becomes ``"ultrascale"``, registered with HF's
  ``AttentionInterface``: it calls each attention module's ``attention_fn(q, k, v)`` (causal
  SDPA; context parallelism swaps in ring or all-to-all attention). RoPE, biases (Qwen2) and
  q/k norms (Qwen3) stay HF's own code;
- MoE blocks (Mixtral, Qwen3-MoE): the block's forward routes with HF's own router, then sorts the
  rows by expert and hands them to ``dispatcher(experts, rows, counts)`` (expert parallelism
  swaps in its all-to-all); the experts' stacked ``gate_up_proj`` / ``down_proj`` run grouped;
- ``init_weights(seed)``: HF's ``_init_weights`` distributions (recorded, not run), each
  parameter drawn from ``(seed, its name)`` alone (:mod:`~lightning_ultrascale.models.shard_init`),
  so every layout starts from the same weights; buffers (RoPE's ``inv_freq``) as HF computes them;
- ``forward_stage`` (pipelines): embedding, the named blocks, norm and head of HF's own modules;
- a tensor-parallel plan per family (:func:`hf_tp_plan`).

Refused, by name, rather than trained differently: other ``model_type`` s, padding masks
(``attention_mask`` with zeros: pack sequences, mask labels with -100), labels already shifted
passed as HF ``labels`` (HF shifts them again: pass ``shift_labels=``), attention dropout,
router jitter and ``output_router_logits`` (the router's auxiliary loss is not trained), sliding
windows shorter than the sequence, and an embedding ``padding_idx`` under tensor parallelism.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2)
    >>> with torch.device("meta"):
    ...     model = adapt(LlamaForCausalLM(cfg))
    >>> model.spec.layers, model.spec.n_layers, type(model).__name__
    ('model.layers', 2, 'LlamaForCausalLM')
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_ultrascale.models.blocks import as_blocks
from lightning_ultrascale.models.common.layers import causal_attention
from lightning_ultrascale.models.common.moe import Dispatcher, _scale_grad
from lightning_ultrascale.models.contract import ContractError
from lightning_ultrascale.models.hf.convert import MODEL_TYPES
from lightning_ultrascale.models.shard_init import clean_name, init_parameter, local_indices
from lightning_ultrascale.models.spec import ModelSpec, piece, spec_of
from lightning_ultrascale.utils.tensors import local_tensor

__all__ = [
    "ATTENTION",
    "FAMILIES",
    "adapt",
    "adapt_in",
    "check_supported",
    "hf_tp_plan",
    "init_hf_weights",
    "is_hf_causal_lm",
    "tied_names",
]

#: The ``model_type`` s trained as they are (each tested against one process in every layout).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
#: The HF attention implementation this library registers.
ATTENTION = "ultrascale"
IGNORE_INDEX = -100


@dataclass(frozen=True)
class _Family:
    qk_norm: bool = False


_FAMILY = {"qwen3": _Family(qk_norm=True), "qwen3_moe": _Family(qk_norm=True)}


def is_hf_causal_lm(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` model with a language-model head (never imports transformers).

    ``transformers.PreTrainedModel`` is a lazy attribute whose first access imports the modeling code
    (0.75 s); no such model exists unless that module was imported, so it is looked up, never loaded.
    """
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel) and hasattr(module, "lm_head")


def adapt_in(root: nn.Module) -> None:
    """What the strategy gives the model under ``root`` in place before any check: :func:`adapt` to the
    outermost HF causal LM that declares no spec yet; blocks kept in an ``nn.ModuleList`` held as
    :class:`~lightning_ultrascale.models.blocks.Blocks` (same names) to a model that declares one."""
    for module in root.modules():
        spec = spec_of(module)
        if spec is not None:
            if isinstance(getattr(module, spec.layers.split(".")[0], None), nn.Module):
                as_blocks(module, spec.layers)
            return
        if is_hf_causal_lm(module):
            adapt(module)
            return


def adapt(model: nn.Module) -> nn.Module:
    """Give the HF causal LM ``model`` the model contract in place (see the module docstring); returns it.

    Raises :class:`~lightning_ultrascale.models.contract.ContractError` for a family or a setting
    this library would train differently from transformers.
    """
    if spec_of(model) is not None:
        return model
    cfg = model.config
    check_supported(cfg)
    prefix = model.base_model_prefix
    layers = as_blocks(model, f"{prefix}.layers")
    _register_attention()
    cfg._attn_implementation = ATTENTION
    moe_blocks = []
    for i, block in enumerate(layers.values()):
        block.self_attn.attention_fn = causal_attention
        mlp = block.mlp
        if hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            _swap_class(mlp, _RoutedMoE)
            _swap_class(mlp.experts, _StackedExperts)
            mlp.dispatcher = Dispatcher()
            moe_blocks.append(i)
    n_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0
    model.spec = ModelSpec(
        name=cfg.model_type,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads,
        dim=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        n_experts=n_experts if moe_blocks else 0,
        moe_blocks=tuple(moe_blocks),
        embedding=f"{prefix}.embed_tokens",
        layers=f"{prefix}.layers",
        final_norm=f"{prefix}.norm",
        head="lm_head",
        attention="self_attn",
        moe="mlp",
        tp_plan=functools.partial(hf_tp_plan, model, tuple(moe_blocks)),
        **_priced_widths(cfg, bool(moe_blocks)),
    )
    _swap_class(model, _AdaptedCausalLM)
    return model


def _priced_widths(cfg: Any, moe: bool) -> dict[str, int]:
    """The :class:`ModelSpec` widths the planner prices, from the HF config (Qwen3 sets ``head_dim``
    apart from ``hidden_size``; Mixtral's experts are ``intermediate_size`` wide, Qwen3-MoE's
    ``moe_intermediate_size``; neither has shared experts)."""
    widths = {"ffn_dim": cfg.intermediate_size, "head_dim": getattr(cfg, "head_dim", None) or 0}
    if moe:
        expert = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        widths |= {"top_k": cfg.num_experts_per_tok, "expert_ffn_dim": expert}
    return widths


def check_supported(cfg: Any) -> None:
    """Refuse, by name, an HF config this library would train differently from transformers."""
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        # Only families with a converter can become our Llama (GPT-2's or OLMo2's blocks cannot).
        convert = (
            f"convert it to our model with lightning_ultrascale.models.hf.convert.load_hf_pretrained "
            f"(it reads {kind}), or "
            if kind in MODEL_TYPES.values()
            else ""
        )
        raise ContractError(
            f"model_type={kind!r} is not among the Hugging Face families lightning_ultrascale trains as they are "
            f"(tested in every layout); valid: {', '.join(FAMILIES)}. To train it: {convert}give your model the "
            "contract yourself (docs/models.md, 'Your own model')"
        )
    refused = {
        "attention_dropout": (getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0,
        "router_jitter_noise": (getattr(cfg, "router_jitter_noise", 0.0) or 0.0) > 0,
        "output_router_logits": bool(getattr(cfg, "output_router_logits", False)),
    }
    for name, bad in refused.items():
        if bad:
            raise ContractError(
                f"config.{name}={getattr(cfg, name)!r} is not supported: dropout and jitter draw from each rank's "
                "random stream (every layout would train on other noise) and the router's auxiliary loss is not "
                f"trained here; set config.{name} to {0.0 if name != 'output_router_logits' else False}"
            )


# ----------------------------------------------------------------------------- classes swapped in place
_SWAPPED: dict[tuple[type, type], type] = {}


def _swap_class(obj: nn.Module, mixin: type) -> None:
    """Make ``obj`` an instance of ``(mixin, its class)``: same state, same class name (HF saves the
    architecture by it), the mixin's methods first."""
    cls = type(obj)
    if issubclass(cls, mixin):
        return
    if (cls, mixin) not in _SWAPPED:
        body = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _SWAPPED[(cls, mixin)] = type(cls.__name__, (mixin, cls), body)
    obj.__class__ = _SWAPPED[(cls, mixin)]


class _AdaptedCausalLM:
    """What :func:`adapt` adds to an HF ``...ForCausalLM`` (methods resolved before the HF class's)."""

    spec: ModelSpec
    #: Set by context parallelism (the rank holds chunks of each sequence): HF's own label shift is refused.
    sequence_split: Any = None

    def init_weights(self, seed: int | None = None) -> None:
        """Without ``seed``: HF's own ``init_weights``. With it: HF's distributions, drawn per parameter name."""
        if seed is None:
            super().init_weights()  # type: ignore[misc]
            return
        init_hf_weights(self, seed)  # type: ignore[arg-type]  # (buffers, and what no file holds)
        loader = getattr(self, "pretrained", None)
        if loader is not None:  # e.g. models.hf_weights.load_hf_directory: each rank reads its shards
            loader(self)

    def forward(self, input_ids: Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if args:  # by name: the checks below read attention_mask and labels however they were passed
            names = list(inspect.signature(super().forward).parameters)[1 : 1 + len(args)]  # type: ignore[misc]
            kwargs.update(zip(names, args))
        if kwargs.pop("document_ids", None) is not None:  # (HF would hand it to the attention, which ignores it)
            raise ContractError(NO_DOCUMENTS)
        _refuse_padding(kwargs.get("attention_mask"))
        _refuse_shifted(kwargs.get("labels"), input_ids)
        if self.sequence_split is not None and kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
            raise ContractError(
                "labels= under context parallelism: HF shifts labels within each rank's chunk of the sequence, "
                "which pairs tokens with the wrong next tokens at every chunk's edge. Pass the batch's labels (shifted "
                "already) as shift_labels=, or compute the loss from .logits"
            )
        kwargs["attention_mask"] = None
        if kwargs.get("use_cache") is None:  # (config.use_cache: a KV cache grows in training, and again on recompute)
            kwargs["use_cache"] = False
        if kwargs.get("position_ids") is None and input_ids is not None:
            # From the tokens: HF counts them from the embedding's output, a sequence shard under SP.
            kwargs["position_ids"] = torch.arange(input_ids.shape[-1], device=input_ids.device)[None]
        return super().forward(input_ids, **kwargs)  # type: ignore[misc]

    def forward_stage(
        self,
        x: Tensor,
        position_ids: Tensor | None,
        blocks: Sequence[str],
        *,
        embed: bool,
        head: bool,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Run a part of the model (a pipeline stage) through HF's own modules; see ``Llama.forward_stage``."""
        if document_ids is not None:
            raise ContractError(NO_DOCUMENTS)
        base = getattr(self, self.base_model_prefix)  # type: ignore[attr-defined]
        h = base.embed_tokens(x) if embed else x
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device)[None]
        rope = base.rotary_emb(h, position_ids)
        for name in blocks:
            h = base.layers[name](h, attention_mask=None, position_ids=position_ids, position_embeddings=rope)
        if head:
            h = self.lm_head(base.norm(h))  # type: ignore[attr-defined]
        return h

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, ``6 N + 12 L H Q T`` as ``LlamaConfig.flops_per_token`` counts them
        (N: the matrices a token multiplies, routed experts ``top_k / E`` of theirs, the head included)."""
        cfg = self.config  # type: ignore[attr-defined]
        embedding = cfg.vocab_size * cfg.hidden_size
        total = 0.0
        for name, p in self.named_parameters():  # type: ignore[attr-defined]
            share = cfg.num_experts_per_tok / self.spec.n_experts if ".experts." in name else 1.0
            total += p.numel() * share if p.dim() >= 2 else 0.0
        matmul = total - embedding + (embedding if cfg.tie_word_embeddings else 0)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return float(6 * matmul + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq_len)


NO_DOCUMENTS = (
    "document masking (document_ids, data.documents=mask) is not supported for Hugging Face models trained as they "
    "are (transformers' attention would ignore the documents); valid: data.documents=concat (attention across the "
    "packed documents, as most pretraining does), or our Llama with document masks"
)


def _refuse_padding(mask: Tensor | None) -> None:
    if mask is not None and not bool(mask.all()):
        raise ContractError(
            "attention_mask with padding (zeros) is not supported: the attention is causal over the whole window. "
            "Pack sequences (UltraScaleDataModule does) and mask padded labels with -100 instead"
        )


def _refuse_shifted(labels: Tensor | None, input_ids: Tensor | None) -> None:
    """HF shifts ``labels`` by one itself: labels already shifted (ours are) would train on the token after next."""
    if labels is None or input_ids is None or labels.shape != input_ids.shape or labels.shape[-1] < 2:
        return
    nxt, lab = input_ids[..., 1:], labels[..., :-1]
    marked = lab != IGNORE_INDEX
    if bool(marked.any()) and bool((lab == nxt)[marked].all()):
        raise ContractError(
            "labels= holds labels already shifted (labels[t] == input_ids[t + 1], as UltraScaleDataModule gives them); "
            "HF shifts labels= again. Pass them as shift_labels=batch['labels'] (or compute the loss from .logits)"
        )


# ----------------------------------------------------------------------------- attention
def _ultrascale_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """HF's attention-interface signature around ``module.attention_fn(q, k, v)`` (``[b, heads, s, d]``)."""
    head_dim = query.shape[-1]
    if scaling is not None and abs(scaling * head_dim**0.5 - 1.0) > 1e-6:
        raise ContractError(f"{type(module).__name__}: attention scaling {scaling} is not 1/sqrt(head_dim)")
    if sliding_window is not None and not getattr(module, "_window_checked", False):
        positions = kwargs.get("position_ids")
        longest = int(positions.max()) + 1 if positions is not None else key.shape[-2]
        if longest > sliding_window:
            raise ContractError(
                f"{type(module).__name__}: sliding_window={sliding_window} is shorter than the sequence ({longest}); "
                "sliding-window attention is not supported: train on windows no longer than it, or set "
                "config.sliding_window=None"
            )
        module._window_checked = True
    out = module.attention_fn(query, key, value)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _ultrascale_attention)


# ----------------------------------------------------------------------------- experts
class _RoutedMoE:
    """An HF sparse MoE block (``gate`` router, stacked ``experts``) routed through a ``dispatcher``."""

    dispatcher: Any

    def forward(self, hidden_states: Tensor) -> Tensor:
        b, s, dim = hidden_states.shape
        tokens = hidden_states.reshape(-1, dim)
        _, weights, experts = self.gate(tokens)  # type: ignore[attr-defined]
        k, n = experts.shape[-1], self.experts.num_experts  # type: ignore[attr-defined]
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(n, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        rows = order // k
        y = self.dispatcher(self.experts, tokens[rows], counts)  # type: ignore[attr-defined]
        w = weights.reshape(-1)[order, None]
        out = torch.zeros_like(tokens, dtype=torch.float32).index_add_(0, rows, y.float() * w.float())
        return out.to(hidden_states.dtype).view(b, s, dim)


class _StackedExperts:
    """HF's stacked experts (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``) run on rows sorted by expert."""

    def forward(self, x: Tensor, counts: Tensor, grad_scale: float = 1.0) -> Tensor:
        gate_up = _scale_grad(local_tensor(self.gate_up_proj), grad_scale)  # type: ignore[attr-defined]
        down = _scale_grad(local_tensor(self.down_proj), grad_scale)  # type: ignore[attr-defined]
        sizes = counts.tolist()
        groups = x.split([*sizes, x.shape[0] - sum(sizes)])
        outs = []
        for rows, a, b in zip(groups, gate_up.unbind(0), down.unbind(0)):
            gate, up = F.linear(rows, a).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, b))  # type: ignore[attr-defined]
        outs.append(x.new_zeros(groups[-1].shape[0], down.shape[1]))
        return torch.cat(outs)


# ----------------------------------------------------------------------------- tensor parallelism
def hf_tp_plan(
    model: nn.Module, moe_blocks: tuple[int, ...], sequence_parallel: bool
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The Megatron pairing on HF module names (``LlamaConfig``'s plan, :func:`llama_tp_plan`, spelled for HF).

    q/k/v and gate/up split columns (heads, hidden units; Qwen2's biases with them), o and down
    rows; Qwen3's per-head q/k norms run on the rank's heads with their gains replicated (their
    gradients summed over tp); MoE blocks are gathered, not split (expert parallelism splits them).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    cfg, prefix = model.config, model.base_model_prefix  # type: ignore[attr-defined]
    if getattr(model.get_submodule(f"{prefix}.embed_tokens"), "padding_idx", None) is not None:
        raise ContractError(
            f"config.pad_token_id={cfg.pad_token_id} makes the embedding's padding_idx, which vocabulary-parallel "
            "embeddings do not honour; set config.pad_token_id=None for tensor parallelism (labels -100 mask padding)"
        )
    residual = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {
        f"{prefix}.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    attention, dense, moe = _block_plans(residual, _FAMILY.get(cfg.model_type, _Family()).qk_norm)
    norms = {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()}
    if sequence_parallel:
        top[f"{prefix}.norm"] = SequenceParallel()
    blocks = {
        str(i): attention | (moe if i in moe_blocks else dense) | (norms if sequence_parallel else {})
        for i in range(cfg.num_hidden_layers)
    }
    return top, blocks


def _block_plans(residual: Any, qk_norm: bool) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The attention's, a dense MLP's and an MoE block's plans, on HF's module names."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from lightning_ultrascale.models.common.tp_plan import gathered_moe

    attention: dict[str, Any] = {
        # HF's blocks call their attention with hidden_states=: converted as a keyword.
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": residual}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(output_layouts=residual),
    }
    if qk_norm:  # [b, s, heads, head_dim]: the rank's heads (dim 2), the gain's gradient summed over tp
        norm = SequenceParallel(sequence_dim=2, use_local_output=True)
        attention |= {"self_attn.q_norm": norm, "self_attn.k_norm": norm}
    dense = {
        "mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=residual),
    }
    return attention, dense, {"mlp": gathered_moe(residual)}


# ----------------------------------------------------------------------------- initialisation
_INIT_FUNCTIONS = ("normal_", "zeros_", "ones_", "constant_", "copy_")


@torch.no_grad()
def init_hf_weights(model: nn.Module, seed: int) -> None:
    """HF's initial distributions, each parameter's values drawn from ``(seed, its name)`` alone.

    HF's ``_init_weights`` runs on meta stand-ins of every tensor (global shapes) with
    ``transformers.initialization``'s functions recording what they would do; then each rank
    draws its own shard of every ``normal_`` (shard-local Philox, the same values in any layout
    and on any device), fills constants and copies computed buffers (RoPE's ``inv_freq``).
    An embedding's ``padding_idx`` row is zeroed, as HF does.
    """
    tied = tied_names(model)
    if tied and all(piece(model, n.rpartition(".")[0]) is not None for pair in tied.items() for n in pair):
        model.tie_weights()  # type: ignore[operator]  # (to_empty gives each module its own Parameter)
    plan = _record_init(model)
    for fqn, tensor in _named_tensors(model):
        how = plan.get(tied.get(fqn, fqn), plan.get(fqn))
        fqn = tied.get(fqn, fqn)  # a head tied to the embedding draws the embedding's values (pipeline: alone)
        if how is None:
            continue  # HF leaves it (a buffer it computes elsewhere, or one not persistent and unused)
        kind, arg = how
        local = local_tensor(tensor)
        if kind == "normal_":
            mean, std = arg
            init_parameter(tensor, fqn, seed, std)
            if mean:
                local.add_(mean)
        elif kind == "copy_":
            local.copy_(arg.to(local.device, local.dtype) if local.shape == arg.shape else _shard_of(tensor, arg))
        else:
            local.fill_(arg)
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            _zero_row(module.weight, module.padding_idx)


def tied_names(model: nn.Module) -> dict[str, str]:
    """``{tied copy: the name it draws from}`` when the config ties the head to the embedding."""
    if not getattr(model.config, "tie_word_embeddings", False):  # type: ignore[union-attr]
        return {}
    keys = getattr(model, "_tied_weights_keys", None)
    default = {"lm_head.weight": f"{model.base_model_prefix}.embed_tokens.weight"}
    return dict(keys) if isinstance(keys, dict) else default


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    seen: set[int] = set()
    for fqn, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in seen:
            seen.add(id(t))
            yield clean_name(fqn), t


def _record_init(model: nn.Module) -> dict[str, tuple[str, Any]]:
    """``{tensor name: (init function, its arguments)}`` of HF's ``_init_weights`` over every module."""
    import transformers.initialization as hf_init

    stand_ins: dict[int, str] = {}
    recorded: dict[str, tuple[str, Any]] = {}

    def recorder(kind: str) -> Any:
        def record(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            name = stand_ins.get(id(tensor))
            if name is None:
                return tensor  # a slice (the embedding's padding row): handled by init_hf_weights
            if kind == "normal_":
                recorded[name] = (
                    kind,
                    (
                        kwargs.get("mean", args[0] if args else 0.0),
                        kwargs.get("std", args[1] if len(args) > 1 else 1.0),
                    ),
                )
            elif kind == "copy_":
                recorded[name] = (kind, (args[0] if args else kwargs["other"]).detach().to("cpu"))
            else:
                recorded[name] = (kind, {"zeros_": 0.0, "ones_": 1.0}.get(kind, args[0] if args else kwargs.get("val")))
            return tensor

        return record

    def unsupported(name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ContractError(
                f"{type(model).__name__}._init_weights calls transformers.initialization.{name}, which "
                "lightning_ultrascale cannot draw per parameter name (supported: " + ", ".join(_INIT_FUNCTIONS) + ")"
            )

        return refuse

    patches = {n: recorder(n) for n in _INIT_FUNCTIONS}
    patches |= {
        n: unsupported(n) for n in dir(hf_init) if n.endswith("_") and not n.startswith("_") and n not in patches
    }
    with _stand_ins(model, stand_ins), _patched(hf_init, patches):
        for module in model.modules():
            model._init_weights(module)  # type: ignore[operator]
    return recorded


@contextlib.contextmanager
def _stand_ins(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Every parameter and buffer swapped for a meta tensor of its global shape (``names``: id -> name)."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    made: dict[int, Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for key, t in store.items():
                if t is None:
                    continue
                if id(t) not in made:  # a tied tensor gets one stand-in
                    made[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    names[id(made[id(t)])] = clean_name(f"{prefix}.{key}" if prefix else key)
                saved.append((store, key, t))
                store[key] = made[id(t)]
    try:
        yield
    finally:
        for store, key, t in saved:
            store[key] = t


@contextlib.contextmanager
def _patched(module: Any, values: dict[str, Any]) -> Iterator[None]:
    old = {k: getattr(module, k) for k in values if hasattr(module, k)}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k in values:
            if k in old:
                setattr(module, k, old[k])
            else:
                delattr(module, k)


def _shard_of(tensor: Tensor, whole: Tensor) -> Tensor:
    from torch.distributed.tensor import distribute_tensor

    local = local_tensor(tensor)
    dt = distribute_tensor(
        whole.to(local.device, local.dtype), tensor.device_mesh, tensor.placements, src_data_rank=None
    )  # type: ignore[attr-defined]
    return dt.to_local()


def _zero_row(weight: Tensor, row: int) -> None:
    local = local_tensor(weight)
    if local is weight:
        weight[row].zero_()
        return
    indices = local_indices(weight)
    assert indices is not None
    hit = (indices[0] == row).nonzero().flatten()
    if hit.numel():
        local[int(hit[0])].zero_()
