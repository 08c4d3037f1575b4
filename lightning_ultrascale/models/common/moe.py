"""Mixture of experts: the feed-forward of an MoE block (Mixtral and DeepSeek-V3 routing).

``MoE(x) = sum_k w_k expert_{e_k}(x) + shared_experts(x)``: a router picks ``top_k`` of
``n_routed_experts`` SwiGLU experts per token, with weights ``w``; shared experts (DeepSeek) see
every token. Two routers:

- ``softmax`` (Mixtral): ``p = softmax(logits)``, top-k of ``p``, weights renormalised over the k;
- ``sigmoid`` (DeepSeek-V3): ``s = sigmoid(logits)``; experts are chosen by ``s + bias``, first the
  ``topk_group`` of ``n_group`` groups with the largest sum of their two best scores, then the
  top-k inside them; weights are ``s`` of the chosen (normalised if ``norm_topk_prob``) times
  ``routed_scaling_factor``.

Load balancing (any mix):

- auxiliary loss ``aux_loss_coeff * sum_i f_i P_i`` with ``f_i = E / (k T) * tokens routed to i``
  and ``P_i`` the mean (normalised) router probability, over a window of ``T`` tokens: the
  micro-batch (``"switch"``, Switch/GShard) or each sequence (``"sequence"``, DeepSeek-V3's
  sequence-wise loss). Written per token, ``l_t = coeff * sum_i f_i p_ti``, it adds up over tokens
  like the cross-entropy, so it is weighted by the same token counts in every layout; ``f`` is a
  count (no gradient), so a sequence split over context-parallel ranks only sums its counts over
  them (:attr:`MoE.sequence_split`);
- router z-loss ``z_loss_coeff * logsumexp(logits)^2`` per token (ST-MoE);
- aux-loss-free balancing (DeepSeek-V3): a per-expert ``expert_bias`` used for selection only,
  moved by ``+-bias_update_rate`` after every optimizer step, towards the mean load counted over
  the whole global batch (:meth:`Router.update_bias`), so it is the same on every rank.

Dispatch is dropless by default: tokens are sorted by expert and each expert runs on its
contiguous rows (one grouped GEMM, ``torch._grouped_mm``, or a loop). An optional
``capacity_factor`` keeps at most ``ceil(factor * S * k / E)`` tokens of each sequence (``S`` its
length) per expert, the first ones in position order (GShard's rule, per sequence so that drops are
the same in every layout: micro-batching, pipelining and context parallelism change what a rank
sees of a batch, never a sequence), and counts the rest as dropped. A "sequence" is the packed window
the sampler delivers, with or without document masking (``data.documents=mask``): the sequence-wise
loss and the capacity count per window, as Megatron and DeepSeek-V3 do, not per document, so the
statistics do not depend on where documents fall. Expert parallelism replaces the
local :class:`Dispatcher` by one that moves tokens to the ranks holding their experts
(``parallel/expert/``).

Example:
    >>> import torch
    >>> cfg = MoEConfig(n_routed_experts=4, top_k=2, moe_ffn_dim=32, aux_loss="switch")
    >>> moe = MoE(16, cfg).train()
    >>> for p in moe.parameters(): _ = torch.nn.init.normal_(p, std=0.02)
    >>> moe(torch.randn(2, 8, 16)).shape, moe.pop_aux_loss().shape
    (torch.Size([2, 8, 16]), torch.Size([]))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_ultrascale.errors import ConfigError, divisors, is_positive_int
from lightning_ultrascale.kernels import cuda
from lightning_ultrascale.models.common.layers import FeedForward
from lightning_ultrascale.models.spec import WHOLE_SEQUENCE, SequenceSplit
from lightning_ultrascale.utils.tensors import local_tensor

__all__ = [
    "AUX_LOSSES",
    "ROUTERS",
    "Dispatcher",
    "ExpertStats",
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "Router",
    "Routing",
    "attach_aux_loss",
]

ROUTERS = ("softmax", "sigmoid")
AUX_LOSSES = ("none", "switch", "sequence")
EXPERT_KERNELS = ("auto", "grouped_mm", "loop")


@dataclass(frozen=True)
class MoEConfig:
    """The MoE part of a model config (``LlamaConfig.moe``); blocks ``first_k_dense..`` are MoE blocks.

    Example:
        >>> MoEConfig(n_routed_experts=8, top_k=2, moe_ffn_dim=64).validate(n_layers=4)
        >>> MoEConfig(n_routed_experts=8, top_k=9, moe_ffn_dim=64).validate(n_layers=4)
        Traceback (most recent call last):
        ...
        lightning_ultrascale.errors.ConfigError: model.moe.top_k=9 must be at most ... valid: 1..8
    """

    n_routed_experts: int
    top_k: int
    moe_ffn_dim: int
    n_shared_experts: int = 0
    first_k_dense: int = 0
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    aux_loss: str = "none"
    aux_loss_coeff: float = 0.01
    z_loss_coeff: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float | None = None
    expert_kernel: str = "auto"

    def validate(self, n_layers: int) -> None:
        """Raise :class:`ConfigError` naming the first setting that cannot build the layer."""
        for name in ("n_routed_experts", "top_k", "moe_ffn_dim", "n_group", "topk_group"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ConfigError(f"model.moe.{name}={value!r} must be a positive integer")
        e = self.n_routed_experts
        if self.top_k > e:
            raise ConfigError(
                f"model.moe.top_k={self.top_k} must be at most model.moe.n_routed_experts={e}; valid: 1..{e}"
            )
        if e % self.n_group:
            raise ConfigError(
                f"model.moe.n_group={self.n_group} must divide model.moe.n_routed_experts={e}; "
                f"valid: {', '.join(map(str, divisors(e)))}"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(
                f"model.moe.topk_group={self.topk_group} must be at most model.moe.n_group={self.n_group}; "
                f"valid: 1..{self.n_group}"
            )
        if self.n_group > 1 and self.topk_group * (e // self.n_group) < self.top_k:
            raise ConfigError(
                f"model.moe.topk_group={self.topk_group} groups of {e // self.n_group} experts cannot hold "
                f"model.moe.top_k={self.top_k} experts; raise topk_group or lower top_k"
            )
        if self.n_shared_experts < 0 or not 0 <= self.first_k_dense <= n_layers:
            raise ConfigError(
                f"model.moe.n_shared_experts={self.n_shared_experts} must be >= 0 and model.moe.first_k_dense="
                f"{self.first_k_dense} in 0..{n_layers} (model.n_layers)"
            )
        choices = {"router": ROUTERS, "aux_loss": AUX_LOSSES, "expert_kernel": EXPERT_KERNELS}
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ConfigError(f"model.moe.{name}={getattr(self, name)!r} is unknown; valid: {', '.join(valid)}")
        for name in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"model.moe.{name}={getattr(self, name)!r} must be >= 0")
        if not self.routed_scaling_factor > 0:
            raise ConfigError(f"model.moe.routed_scaling_factor={self.routed_scaling_factor!r} must be > 0")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(
                f"model.moe.capacity_factor={self.capacity_factor!r} must be > 0 (e.g. 1.25), or null for dropless"
            )

    def is_moe_block(self, layer: int) -> bool:
        return layer >= self.first_k_dense

    def expert_params(self, dim: int) -> int:
        """Parameters of one routed expert (a SwiGLU of width ``moe_ffn_dim``)."""
        return 3 * dim * self.moe_ffn_dim

    def block_params(self, dim: int, active: bool = False) -> int:
        """Feed-forward parameters of one MoE block (router, routed and shared experts); ``active``: per token."""
        routed = self.top_k if active else self.n_routed_experts
        return dim * self.n_routed_experts + (routed + self.n_shared_experts) * self.expert_params(dim)


class ExpertStats(NamedTuple):
    """What the MoE blocks counted since the last look: ``loads [MoE blocks, experts]`` (tokens routed
    to each expert), ``dropped`` (tokens over an expert's capacity) and ``aux`` (the auxiliary losses
    summed over tokens: divided by the labelled tokens it is the loss's balancing part)."""

    loads: Tensor
    dropped: Tensor
    aux: Tensor


class Routing(NamedTuple):
    """A router's decision for ``T`` tokens: ``experts [T, k]`` and their fp32 ``weights [T, k]``.

    ``probs [T, E]`` are the normalised affinities the auxiliary loss uses, ``logits [T, E]`` the
    raw ones (z-loss).
    """

    experts: Tensor
    weights: Tensor
    probs: Tensor
    logits: Tensor


class Router(nn.Module):
    """Top-k routing, Mixtral (softmax) or DeepSeek-V3 (sigmoid, group-limited), in fp32.

    ``expert_bias`` (HF's ``e_score_correction_bias``) shifts the choice, never the weights.
    """

    def __init__(self, dim: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, dim))
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> Routing:
        cfg = self.cfg
        # fp32 logits whatever the compute dtype (DeepSeek-V3 and torchtitan do): in bf16 near
        # ties between experts flip from rank to rank and layout to layout. Autocast would run
        # this linear in bf16 all the same: it is turned off here.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        if cfg.router == "softmax":
            scores = logits.softmax(dim=-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(-1, keepdim=True)
        choice = scores.detach() + self.expert_bias
        if cfg.n_group > 1:
            grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        experts = choice.topk(cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob and cfg.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if cfg.router == "sigmoid" else 0.0))
        return Routing(experts, weights * cfg.routed_scaling_factor, probs, logits)

    @torch.no_grad()
    def update_bias(self, load: Tensor) -> None:
        """Aux-loss-free balancing: move each expert's bias by ``+-rate`` towards the mean ``load`` (global counts)."""
        self.expert_bias += self.cfg.bias_update_rate * torch.sign(load.float().mean() - load.float())


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts as stacked weights ``w1, w3 [n, hidden, dim]``, ``w2 [n, dim, hidden]``.

    One global expert dim: expert parallelism shards it (``Shard(0)``) and checkpoints reshard it.
    :meth:`forward` runs the experts this rank holds on rows sorted by expert.
    """

    def __init__(self, n: int, dim: int, hidden: int, kernel: str = "auto") -> None:
        super().__init__()
        self.kernel = kernel
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))

    def forward(
        self,
        x: Tensor,
        counts: Tensor,
        grad_scale: float = 1.0,
        place: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> Tensor:
        """``x [n, dim]``: rows of local expert ``i`` contiguous and ``counts[i]`` of them, then rows of none.

        Rows past ``sum(counts)`` (tokens over capacity) are left undefined: the caller masks them.
        Under autocast the experts run in its dtype: ``_grouped_mm`` is not an autocast op, and on
        CUDA only bf16 takes its grouped fast path (fp32 falls back to a loop reading offsets).
        ``place`` maps this rank's ``w1, w2, w3`` to the weights the rows run with (expert placement:
        ``parallel/expert/comms.py``), inside this forward, where a ZeRO-3 unit has gathered them.
        """
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        if place is not None:
            w1, w2, w3 = place(w1, w2, w3)
        w1, w2, w3 = (_scale_grad(w, grad_scale) for w in (w1, w2, w3))
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        if self._grouped(x, w1):
            offsets = counts.cumsum(0).to(torch.int32)
            h = F.silu(cuda.grouped_mm(x, w1.transpose(-2, -1), offsets))
            h = h * cuda.grouped_mm(x, w3.transpose(-2, -1), offsets)
            return cuda.grouped_mm(h, w2.transpose(-2, -1), offsets)
        # The fallback reads the counts on the host. unbind: one backward op stacks the experts'
        # gradients (indexing w[i] would add a full-size zero-padded gradient per expert).
        sizes = counts.tolist()
        groups = x.split([*sizes, x.shape[0] - sum(sizes)])
        experts = zip(groups, w1.unbind(0), w2.unbind(0), w3.unbind(0))
        outs = [F.linear(F.silu(F.linear(r, a)) * F.linear(r, c), b) for r, a, b, c in experts]
        outs.append(x.new_zeros(groups[-1].shape[0], w2.shape[1]))
        return torch.cat(outs)

    def _grouped(self, x: Tensor, w: Tensor) -> bool:
        if self.kernel == "loop" or not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
            return False
        # _grouped_mm needs row strides that are multiples of 16 bytes (checked on CPU, torch 2.13).
        aligned = all(d * x.element_size() % 16 == 0 for d in (w.shape[1], w.shape[2]))
        if self.kernel == "grouped_mm" and not aligned:
            raise ConfigError(
                f"model.moe.expert_kernel=grouped_mm needs dim and moe_ffn_dim x {x.element_size()} bytes to be "
                f"multiples of 16, got {w.shape[2]} and {w.shape[1]}; use expert_kernel=loop or auto"
            )
        return aligned


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None  # type: ignore[attr-defined]


def _scale_grad(x: Tensor, scale: float) -> Tensor:
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


class _AttachAux(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, aux: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(scale)
        # Not a view (``view_as``): the split-backward pipeline schedules (zero bubble, ZBV,
        # DualPipeV) ``detach_()`` a stage's output, which autograd refuses for a custom
        # Function's view. ``detach`` shares the storage without making one.
        return x.detach()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (scale,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad, scale.reshape(()).float(), None


def attach_aux_loss(x: Tensor, aux: Tensor, scale: Tensor | float) -> Tensor:
    """``x`` unchanged, but backward through it also backpropagates ``scale * aux``.

    How an auxiliary loss computed inside a pipeline stage joins the objective without being
    carried to the last stage's loss (Megatron's ``MoEAuxLossAutoScaler``): ``scale`` is the weight
    the step gives to one token's loss.

    Example:
        >>> x, aux = torch.ones(2, requires_grad=True), torch.tensor(3.0, requires_grad=True)
        >>> attach_aux_loss(x, aux * 2, 0.5).sum().backward()
        >>> float(aux.grad)
        1.0
    """
    return _AttachAux.apply(x, aux, torch.as_tensor(scale, device=x.device))


class Dispatcher:
    """Runs routed tokens through the experts, all of them local (no expert parallelism).

    :meth:`__call__` takes the rows sorted by expert and the count per expert; expert parallelism
    subclasses it to send them to the ranks that hold the experts and back.
    """

    def __call__(self, experts: GroupedExperts, x: Tensor, counts: Tensor) -> Tensor:
        return experts(x, counts)

    def observe(self, load: Tensor) -> None:
        """The step's global tokens per expert of this block, after each optimizer step (an expert placement's
        input: ``parallel/expert/comms.py``); nothing here."""


def _in_backward() -> bool:
    # Activation checkpointing reruns forward inside backward: statistics are counted once.
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """The MoE feed-forward of a block: router, routed experts, shared experts; see the module docstring.

    During training each forward records its auxiliary loss (summed over its tokens; read once by
    :meth:`pop_aux_loss`) and adds its tokens per expert to ``load`` (read by the balancing update
    and the metrics, then reset).
    """

    def __init__(self, dim: int, cfg: MoEConfig) -> None:
        super().__init__()

        self.cfg = cfg
        self.router = Router(dim, cfg)
        self.experts = GroupedExperts(cfg.n_routed_experts, dim, cfg.moe_ffn_dim, cfg.expert_kernel)
        self.shared_experts = FeedForward(dim, cfg.n_shared_experts * cfg.moe_ffn_dim) if cfg.n_shared_experts else None
        self.dispatcher = Dispatcher()
        #: How context parallelism splits each sequence, for the per-sequence counts.
        self.sequence_split: SequenceSplit | None = None
        #: Under tensor parallelism with MoE parallel folding: ``(tp, this rank's share, the cp x tp group)``.
        self.token_share: tuple[int, int, object] | None = None
        self.register_buffer("load", torch.zeros(cfg.n_routed_experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.register_buffer("aux_sum", torch.zeros(()), persistent=False)
        self._aux: Tensor | None = None

    def share_tokens(self, parts: int, part: int, group: object) -> None:
        """Run share ``part`` of ``parts`` of every sequence's tokens (tensor parallelism's sequence shards: MoE
        parallel folding); ``group``: the ranks holding one sequence's pieces (``cp x tp``).

        The router, shared experts and experts then see ``1/parts`` of the tokens: their gradients are the
        ``parts`` ranks' sum, which the layout's average over ``dp x cp x tp`` makes right by their scale here.
        """
        self.token_share = (parts, part, group)

    @property
    def split(self) -> SequenceSplit | None:
        """How this rank's tokens cut every sequence: context parallelism's chunks, then tensor parallelism's shares."""
        if self.token_share is None:
            return self.sequence_split
        parts, part, group = self.token_share
        return (self.sequence_split or WHOLE_SEQUENCE).split_further(parts, part, group)

    def forward(self, x: Tensor) -> Tensor:
        fold = 1 if self.token_share is None else self.token_share[0]
        # Folded over tp: every parameter's gradient times tp (the layout averages it over the tp shares: their
        # sum), the input's gradient unchanged (1/tp in, tp out; powers of two are exact).
        out = self._forward(_scale_grad(x, 1.0 / fold))
        return _scale_grad(out, float(fold))

    def _forward(self, x: Tensor) -> Tensor:
        b, s, dim = x.shape
        tokens = x.reshape(-1, dim)
        routing = self.router(tokens)
        cfg = self.cfg
        flat, e = routing.experts.reshape(-1), cfg.n_routed_experts
        kept = None
        if cfg.capacity_factor is not None:
            kept = self.within_capacity(routing.experts, b).reshape(-1)
            if self.training and not _in_backward():  # a recomputed forward counts nothing again
                self.dropped += (~kept).sum()
            flat = flat.masked_fill(~kept, e)  # dropped slots sort last, under no expert
        # No host reads (shapes stay T x k): bincount and boolean indexing would sync with the GPU.
        order = flat.argsort(stable=True)
        counts = torch.zeros(e + 1, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        counts = counts[:e]
        if self.training:
            self._observe(routing, b)
        rows = order // cfg.top_k
        routed = tokens[rows]
        if kept is not None:
            # The dropped rows at the end: no expert runs them, and _grouped_mm leaves their output
            # and input gradient unwritten. Selecting (not multiplying) keeps that garbage out.
            kept_rows = kept[order, None]
            routed = torch.where(kept_rows, routed, 0.0)
        y = self.dispatcher(self.experts, routed, counts)
        if kept is not None:
            y = torch.where(kept_rows, y, 0.0)
        weights = routing.weights.reshape(-1)[order, None]
        out = torch.zeros_like(tokens, dtype=torch.float32).index_add_(0, rows, y.float() * weights)
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(b, s, dim)

    def within_capacity(self, experts: Tensor, batch: int) -> Tensor:
        """Which routed slots ``experts [T, k]`` keep their expert: ``[T, k]`` bool.

        Capacity is per sequence, so drops never depend on the layout: an expert keeps each
        sequence's first ``ceil(factor * S * k / E)`` tokens routed to it, in position order, ``S``
        the whole sequence's tokens. Under context parallelism the ranks exchange how many tokens
        each of their chunks routes to each expert, and a chunk's tokens count after those of every
        chunk before it in the sequence (zig-zag included).
        """
        cfg = self.cfg
        e, split = cfg.n_routed_experts, self.split
        hits = torch.zeros(experts.shape[0], e, dtype=torch.int64, device=experts.device).scatter_(1, experts, 1)
        chunks = 1 if split is None else len(split.mine)
        per_chunk = hits.view(batch, chunks, -1, e)
        before = per_chunk.cumsum(2) - per_chunk  # [b, chunks, chunk length, E]
        seq_len = hits.shape[0] // batch
        if split is not None:
            counts = per_chunk.sum(2)  # [b, my chunks, E]
            every = counts.new_empty((split.world_size * batch, *counts.shape[1:]))
            dist.all_gather_into_tensor(every, counts.contiguous(), group=split.group)
            every = every.view(split.world_size, *counts.shape)
            in_order = counts.new_zeros(batch, split.chunks, e)
            for rank, held in enumerate(split.held):
                in_order[:, list(held)] = every[rank]
            earlier = in_order.cumsum(1) - in_order  # tokens of the chunks before each chunk
            before = before + earlier[:, list(split.mine), None, :]
            seq_len = seq_len // chunks * split.chunks
        capacity = math.ceil(cfg.capacity_factor * seq_len * cfg.top_k / e)  # type: ignore[operator]
        return before.view(-1, e).gather(1, experts) < capacity

    def _observe(self, routing: Routing, batch: int) -> None:
        cfg = self.cfg
        e, k = cfg.n_routed_experts, cfg.top_k
        hits = torch.zeros_like(routing.probs).scatter_(1, routing.experts, 1.0)  # [T, E]
        # A recomputed forward (activation checkpointing, inside backward) builds the same graph
        # but counts nothing again and leaves no loss behind (torchtitan counted tokens twice).
        recomputing = _in_backward()
        if not recomputing:
            self.load += hits.sum(0).detach()
        aux = routing.logits.new_zeros(())
        if cfg.aux_loss != "none" and cfg.aux_loss_coeff > 0:
            windows = batch if cfg.aux_loss == "sequence" else 1
            per_window = hits.view(windows, -1, e)
            counts = torch.cat((per_window.sum(1), per_window.new_full((windows, 1), per_window.shape[1])), 1)
            split = self.split
            if split is not None:
                dist.all_reduce(counts, group=split.group)
            f = counts[:, :e] * e / (k * counts[:, e:])  # [windows, E]
            probs = routing.probs.view(windows, -1, e)
            aux = aux + cfg.aux_loss_coeff * (probs * f[:, None, :]).sum()
        if cfg.z_loss_coeff > 0:
            aux = aux + cfg.z_loss_coeff * routing.logits.logsumexp(-1).pow(2).sum()
        if not recomputing:
            # (folded over tp: the gradient's aux times tp, as the forward's scale does for the main loss)
            self._aux = aux if self.token_share is None else aux * self.token_share[0]
            self.aux_sum += aux.detach()

    def pop_aux_loss(self) -> Tensor | None:
        """The auxiliary loss of the last training forward, summed over its tokens (once)."""
        aux, self._aux = self._aux, None
        return aux

    def pop_load(self) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's tokens per expert, tokens dropped and auxiliary losses' sum since the last call; then reset."""
        stats = self.load.clone(), self.dropped.clone(), self.aux_sum.clone()
        for counter in (self.load, self.dropped, self.aux_sum):
            counter.zero_()
        return stats
