"""What parallel plugins need to know of a model, declared by the model itself.

Plugins never guess at a model's structure: a model that wants to be parallelised exposes a
:class:`ModelSpec` through a ``spec`` attribute. Our Llama does; a user's model can too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import Any, Generic, Protocol, runtime_checkable

from torch import Tensor, nn

from lightning_ultrascale.errors import ContractError


@dataclass(frozen=True)
class ModelSpec:
    """Structure and sizes of a decoder-only transformer, for validation and for the plugins.

    Module names are attribute paths relative to the model (``"layers"``, or ``"model.layers"`` in a
    Hugging Face model) or to one block (``"attention"``). ``layers`` is an ``nn.ModuleDict`` keyed
    ``"0" .. "n-1"``, or an ``nn.ModuleList`` that the strategy turns into one in place
    (:func:`~lightning_ultrascale.models.blocks.as_blocks`), so that a pipeline stage can drop the
    blocks it does not own and keep the fully qualified names (checkpoints and per-parameter
    seeding stay layout independent).

    Example:
        >>> from lightning_ultrascale.models import build_model
        >>> model = build_model("llama_tiny", device="meta")
        >>> model.spec.n_layers, model.spec.layers
        (4, 'layers')
    """

    name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    dim: int
    vocab_size: int
    n_experts: int = 0
    #: The blocks whose ``moe`` module is a mixture of experts (expert parallelism splits those).
    moe_blocks: tuple[int, ...] = ()
    #: Multi-token-prediction blocks after the ``n_layers`` main ones (``layers`` keys ``n_layers ..``): they run
    #: after the final norm, on the main output, and need every token of the sequence and the embedding.
    mtp_depth: int = 0
    #: The routed experts run on weights handed to them (``GroupedExperts.forward(place=)``), so expert parallelism
    #: can place them over slots of its own (``ExpertParallel(redundant_experts=, rebalance_every=)``).
    expert_placement: bool = False
    #: MoE parallel folding: under tensor parallelism each MoE layer runs its tp rank's share of the tokens (the
    #: modules declare :class:`SharesTokens`), so expert parallelism may span the tp ranks too (``ep`` divides
    #: ``dp x cp x tp``); otherwise every tp rank routes the same tokens and ``ep`` divides ``dp x cp``.
    moe_folds_tp: bool = False
    embedding: str = "tok_embeddings"
    layers: str = "layers"
    final_norm: str = "norm"
    head: str = "output"
    attention: str = "attention"
    moe: str = "feed_forward"
    # Tensor-parallel plan: ``tp_plan(sequence_parallel) -> (top_level_plan, {block name: block_plan})``,
    # each plan a mapping of module name (relative to the model / the block) to a DTensor ``ParallelStyle``.
    tp_plan: Callable[[bool], tuple[dict[str, Any], dict[str, dict[str, Any]]]] | None = field(
        default=None, compare=False, repr=False
    )
    # The widths the planner prices (lightning_ultrascale.plan), 0 where not declared (the planner then
    # refuses by name): the dense feed-forward's hidden width (SwiGLU: w1, w3 of ``dim x ffn_dim``);
    # one head's query/key and value widths (``dim // n_heads`` unless set; MLA's differ); an MoE
    # block's routed experts per token, shared experts and one expert's hidden width.
    ffn_dim: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    expert_ffn_dim: int = 0
    # Multi-head latent attention's low-rank projections (0: none, q/k/v/o are full-rank): keys and values come
    # from a ``kv_lora_rank`` latent plus one ``rope_head_dim`` rotary key shared by the heads (``wkv_a``, then
    # ``wkv_b`` per head), queries from a ``q_lora_rank`` latent where it is set (``wq_a``, then ``wq_b``).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_head_dim: int = 0

    def __post_init__(self) -> None:
        if not self.head_dim and self.n_heads > 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if not self.v_head_dim:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    @cached_property
    def _moe_set(self) -> frozenset[int]:
        return frozenset(self.moe_blocks)

    @property
    def mtp_blocks(self) -> range:
        """The global indices of the multi-token-prediction blocks (after the ``n_layers`` main ones)."""
        return range(self.n_layers, self.n_layers + self.mtp_depth)

    def is_moe_block(self, layer: int) -> bool:
        """Whether block ``layer`` (its global index) is a mixture of experts."""
        return layer in self._moe_set

    def undeclared_widths(self) -> list[str]:
        """The planner's widths this spec leaves at 0 although the model has such blocks."""
        needed = ["ffn_dim"] if len(self.moe_blocks) < self.n_layers else []
        needed += ["n_experts", "top_k", "expert_ffn_dim"] if self.moe_blocks else []
        return [name for name in needed if not getattr(self, name)]

    def pipeline_split_points(self) -> list[str]:
        """Module names before which a pipeline stage may begin: every block boundary."""
        return [f"{self.layers}.{i}" for i in range(1, self.n_layers)]


@dataclass(frozen=True)
class SequenceSplit:
    """How context parallelism splits every sequence over ``group``: what a per-sequence statistic needs.

    The sequence is cut into ``chunks`` equal chunks; rank ``r`` of ``group`` holds chunks
    ``held[r]``, concatenated in that order (ring: ``(r,)`` of ``cp``; zig-zag: ``(r, 2cp-1-r)`` of
    ``2 cp``). Context parallelism sets it on every module with a ``sequence_split`` attribute.

    Example:
        >>> split = SequenceSplit(group=None, rank=1, chunks=4, held=((0, 3), (1, 2)))
        >>> split.mine, split.world_size
        ((1, 2), 2)
    """

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    chunks: int
    held: tuple[tuple[int, ...], ...]

    @property
    def mine(self) -> tuple[int, ...]:
        """This rank's chunks, in the order its tokens hold them."""
        return self.held[self.rank]

    @property
    def world_size(self) -> int:
        return len(self.held)

    def split_further(self, parts: int, part: int, group: Any) -> SequenceSplit:
        """Each rank's tokens cut again into ``parts`` contiguous shares (tensor parallelism's), this rank
        holding share ``part``, over ``group``: this split's ranks times ``parts``, the share fastest.

        Every chunk becomes ``parts`` pieces: a rank's ``m`` chunks are ``m parts`` pieces in its token order,
        and share ``p`` holds pieces ``p m .. (p + 1) m - 1`` of them.

        Example:
            >>> zigzag = SequenceSplit(group=None, rank=1, chunks=4, held=((0, 3), (1, 2)))
            >>> folded = zigzag.split_further(2, 1, group=None)
            >>> folded.chunks, folded.held, folded.mine
            (8, ((0, 1), (6, 7), (2, 3), (4, 5)), (4, 5))
        """
        held = []
        for chunks in self.held:
            pieces = [chunk * parts + piece for chunk in chunks for piece in range(parts)]
            m = len(chunks)
            held += [tuple(pieces[p * m : (p + 1) * m]) for p in range(parts)]
        return SequenceSplit(group, self.rank * parts + part, self.chunks * parts, tuple(held))


#: One process's split: the whole sequence, one chunk (what tensor parallelism's shares refine without CP).
WHOLE_SEQUENCE = SequenceSplit(group=None, rank=0, chunks=1, held=((0,),))


@runtime_checkable
class SpecifiedModel(Protocol):
    """An ``nn.Module`` that declares its :class:`ModelSpec` and can initialise itself.

    ``init_weights(seed)`` must give every parameter a value that depends only on ``seed`` and the
    parameter's fully qualified name, never on the rank or on how the model is sharded. The whole
    contract, per layout (``flops_per_token`` is optional there), is
    :mod:`lightning_ultrascale.models.contract`.
    """

    spec: ModelSpec

    def init_weights(self, seed: int) -> None: ...

    def flops_per_token(self, seq_len: int) -> float: ...


@runtime_checkable
class StagedModel(Protocol):
    """What pipeline parallelism needs of a :class:`SpecifiedModel` beside it: running one stage's part.

    ``forward_stage`` embeds ``x`` (tokens) if ``embed``, else takes it as the hidden state; runs
    the named ``blocks`` in order; applies the final norm and head if ``head``. ``document_ids``
    (packed documents) is passed where the batch has them; a model whose spec has ``mtp_depth`` also takes
    ``mtp=`` (the microbatch's tokens and labels ahead) on its last stage. The contract's row:
    :mod:`lightning_ultrascale.models.contract` (``forward_stage``).
    """

    def forward_stage(
        self,
        x: Tensor,
        position_ids: Tensor | None,
        blocks: Sequence[str],
        *,
        embed: bool,
        head: bool,
        document_ids: Tensor | None = None,
    ) -> Tensor: ...


@runtime_checkable
class PipelineLoss(Protocol):
    """What pipeline parallelism needs of the LightningModule: the last stage's loss of one microbatch
    (mean over the tokens whose label is not ``-100``)."""

    def loss_fn(self, logits: Tensor, labels: Tensor) -> Tensor: ...


@runtime_checkable
class StepSums(Protocol):
    """Optional on the LightningModule: sums of a training step the strategy adds up over the global batch
    (each token counted once) in the step's one control collective (``core/agreement.py``), instead of
    a collective of the module's own: ``step_sums`` this rank's (the same length on every rank, taken
    once per step), ``agree_step_sums`` the totals back, before ``optimizer_step`` returns. An optional
    ``split_step_sums`` attribute (int) says how many of the last sums tensor-parallel peers hold parts of
    (statistics of layers that run each tp rank's share of the tokens): those are summed over them too."""

    def step_sums(self) -> Tensor: ...

    def agree_step_sums(self, sums: Tensor) -> None: ...


@runtime_checkable
class StepMaxima(Protocol):
    """Optional beside :class:`StepSums`: non-negative values of a training step the strategy takes the
    maximum of over the ranks that see different tokens and the pipeline stages, in the same one control
    collective (a stage reports its own blocks' values and zeros for the others): ``step_maxima`` this
    rank's (the same length on every rank), ``agree_step_maxima`` the maxima back, before
    ``optimizer_step`` returns. ``LlamaModule``'s: each MoE block's selection-bias range."""

    def step_maxima(self) -> Tensor: ...

    def agree_step_maxima(self, maxima: Tensor) -> None: ...


@runtime_checkable
class AuxLossModel(Protocol):
    """Optional beside :class:`StagedModel`: a model whose blocks add an auxiliary loss (MoE balancing)
    hands a pipeline stage the sum its ``blocks`` recorded in the last forward, or None."""

    def pop_aux_loss(self, blocks: Sequence[str]) -> Tensor | None: ...


@runtime_checkable
class SwappableAttention(Protocol):
    """An attention module whose kernel context parallelism replaces (ring or all-to-all attention):
    ``attention_fn(q, k, v)`` on ``[batch, heads, seq, head_dim]`` tensors."""

    attention_fn: Callable[..., Tensor]


@runtime_checkable
class RoutedExperts(Protocol):
    """A mixture-of-experts module that expert parallelism splits: its stacked ``experts`` and the
    ``dispatcher(experts, rows, counts)`` it routes through, which expert parallelism replaces."""

    experts: nn.Module
    dispatcher: Callable[..., Tensor]


@runtime_checkable
class SequenceStatistics(Protocol):
    """A module with per-sequence statistics (MoE balancing counts, capacity): context parallelism sets
    its ``sequence_split`` so it counts over the whole sequence, whichever chunks its rank holds."""

    sequence_split: SequenceSplit | None


@runtime_checkable
class SharesTokens(Protocol):
    """A module that runs its tensor-parallel rank's share of the tokens (MoE parallel folding,
    ``ModelSpec.moe_folds_tp``): tensor parallelism tells it ``share_tokens(parts, part, group)``, its share of
    ``parts`` and the group of the ranks holding one sequence's pieces (``cp x tp``), so it counts per-sequence
    statistics over all of them and scales its gradients for the average over ``tp`` too."""

    def share_tokens(self, parts: int, part: int, group: Any) -> None: ...


def declares(obj: object, protocol: type) -> bool:
    """Whether ``obj`` has every member ``protocol`` declares, its methods callable: the contract's check
    of a model, block or LightningModule against one of the protocols above.

    Not ``isinstance(obj, protocol)``: from Python 3.12 on that looks members up statically and misses
    what an ``nn.Module`` holds in its registries (a submodule ``experts``, a ``loss_fn`` set to an
    ``nn.Module``), so the same model would pass on one Python and be refused on another.

    Example:
        >>> from lightning_ultrascale.models import build_model
        >>> model = build_model("llama_tiny", device="meta")
        >>> declares(model, StagedModel), declares(model.layers["0"].attention, SwappableAttention)
        (True, True)
        >>> declares(nn.Linear(2, 2), StagedModel)
        False
    """
    for name, method in _members(protocol):
        try:
            value = getattr(obj, name)
        except AttributeError:
            return False
        if method and not callable(value):  # (a method set to None opts out of it)
            return False
    return True


@cache
def _members(protocol: type) -> tuple[tuple[str, bool], ...]:
    """``protocol``'s members and whether each is a method (else an attribute: present is enough)."""
    found: dict[str, bool] = {}
    for cls in protocol.__mro__:
        if cls in (Protocol, Generic, object):
            continue
        found.update((n, False) for n in getattr(cls, "__annotations__", {}) if not n.startswith("_"))
        found.update((n, callable(v)) for n, v in vars(cls).items() if not n.startswith("_"))
    return tuple(sorted(found.items()))


def piece(model: nn.Module, name: str) -> nn.Module | None:
    """The module at the (possibly dotted) ``name`` of a spec (``"model.embed_tokens"``), or None
    where it is absent or dropped (a pipeline stage that does not run it)."""
    owner, _, attr = name.rpartition(".")
    try:
        parent = model.get_submodule(owner) if owner else model
    except AttributeError:
        return None
    found = getattr(parent, attr, None)
    return found if isinstance(found, nn.Module) else None


def drop_piece(model: nn.Module, name: str) -> None:
    """Set the module at the (possibly dotted) ``name`` to None: a pipeline stage that does not run it."""
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attr, None)


def spec_of(module: object) -> ModelSpec | None:
    """The :class:`ModelSpec` that ``module`` declares in its ``spec`` attribute, or None: the one place
    the library asks an object whether it is a model of the contract.

    Example:
        >>> from lightning_ultrascale.models import build_model
        >>> spec_of(build_model("llama_tiny", device="meta")).name, spec_of(nn.Linear(2, 2))
        ('llama_tiny', None)
    """
    spec = getattr(module, "spec", None)
    return spec if isinstance(spec, ModelSpec) else None


def require_spec(model: nn.Module) -> ModelSpec:
    """The model's :class:`ModelSpec`, or a ``TypeError`` that says how to provide one."""
    spec = spec_of(model)
    if spec is None:
        raise TypeError(
            f"{type(model).__name__} has no `spec: ModelSpec` attribute; lightning_ultrascale needs it to "
            "parallelise the model (see lightning_ultrascale.models.spec.ModelSpec)"
        )
    return spec


def find_model(root: nn.Module) -> tuple[nn.Module, str]:
    """The outermost module under ``root`` that declares a :class:`ModelSpec`, and its name there."""
    for name, module in root.named_modules():
        if spec_of(module) is not None:
            return module, name
    raise ContractError(
        f"{type(root).__name__} holds no model with a `spec: ModelSpec`, which UltraScaleStrategy needs to "
        "parallelise it; valid: our Llama (lightning_ultrascale.models), a Hugging Face causal LM of a tested family "
        "(adapted as it is), or your own model with a spec and init_weights(seed) (docs/models.md, 'Your own model'), "
        "built on the meta device: in LightningModule.configure_model (Trainer) or under "
        "fabric.init_module(empty_init=True) (Fabric)"
    )
