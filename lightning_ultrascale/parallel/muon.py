"""Muon as Moonlight trains it, on whole matrices under every layout.

Muon (Jordan et al., 2024) replaces a hidden matrix's update by the orthogonalised Nesterov momentum:
``O = NS(g + mu*m)``, five quintic Newton-Schulz iterations that push every singular value towards
1. Moonlight (Liu et al., 2025, "Muon is Scalable for LLM Training") made it work at scale with
two changes, both here: decoupled weight decay as AdamW's, and the update scaled by
``0.2 * sqrt(max(A, B))`` for an ``A x B`` matrix so that its RMS matches AdamW's (then one learning
rate and one weight decay serve both optimizers). So, per step::

    m = mu*m + g;   u = g + mu*m (Nesterov)
    W = W*(1 - lr*wd) - lr * 0.2*sqrt(max(A, B)) * NS(u)

Which parameters (:func:`muon_param_groups`): the 2-D weights of the blocks' linears and the
stacked experts (each expert its own matrix); a fused matrix (HF's ``gate_up_proj``) split into its
logical matrices. The embedding, the output head, norms, biases and the MoE router stay on AdamW
(the same class steps them, with AdamW's rule).

**Whole matrices, never shards.** ``NS`` is not elementwise: run on a shard's rows it gives another
answer (DeepSpeed's first ZeRO Muon ran silently on flattened shards). Everything before and after
``NS`` is elementwise and runs on this rank's piece; ``NS`` itself runs on whole matrices:

- DTensors (ZeRO-3's FSDP2 shards, TP shards, EP's expert shards, any product of them): the
  same-shape matrices of a param group are stacked and redistributed so that the stack dimension
  is split over every mesh dimension and each matrix is whole on one rank (an all-to-all; DTensor
  takes the gloo fallback of all-gather and chunk on CPU). Each rank orthogonalises the matrices it
  now owns (the work divides instead of repeating), and the results go back by the reverse
  redistribution. A stack of ``n`` matrices over ``W`` ranks gives ``ceil(n/W)`` to the first ranks:
  balanced within a shape group, not across groups.
- ZeRO-1/2's flat shards (:class:`~lightning_ultrascale.parallel.data.sharded_optimizer.ZeroEngine`
  registers each with :meth:`Muon.register_flat_shard`): each bucket's update is all-gathered, each
  of its matrices is orthogonalised by one data rank (greedy by size, so the work divides), and the
  results are reduce-scattered back into the shards (each element is nonzero on its owner only).
- Replicas (data and context parallelism; the ZeRO-0 engine registers them with
  :meth:`Muon.register_replicas`): the same stacks, split over the replicas' ranks (a local slice),
  and the results all-gathered. A plain tensor nobody registered (one process, a pipeline stage's
  own blocks) is orthogonalised where it is.

A 1-D tensor in a Muon group that was not registered as a flat shard is refused: it could only be
a flattened matrix. :func:`orthogonalize` checks that every matrix it receives has its logical shape.

Example:
    >>> import torch
    >>> from lightning_ultrascale.models import build_model
    >>> model = build_model("llama_tiny")
    >>> optimizer = Muon(muon_param_groups(model, weight_decay=0.1), lr=1e-3)
    >>> [(g["use_muon"], len(g["params"])) for g in optimizer.param_groups]
    [(True, 28), (False, 2), (False, 9)]
    >>> model(torch.randint(0, 256, (1, 8))).sum().backward()
    >>> optimizer.step()
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.spec import ModelSpec, spec_of
from lightning_ultrascale.parallel.dims import DATA_DIMS
from lightning_ultrascale.parallel.layout import ShardPlan
from lightning_ultrascale.parallel.pricing import CostTerms, RankView, add_traffic, dim_name
from lightning_ultrascale.utils.tensors import local_tensor

__all__ = [
    "NS_COEFFICIENTS",
    "Muon",
    "muon_cost",
    "muon_matrices",
    "muon_param_groups",
    "muon_split",
    "newton_schulz_flops",
    "orthogonalize",
    "update_scale",
]

#: Logical matrices orthogonalised, by shape.
Stats = Counter[tuple[int, int]]

#: The quintic's coefficients (Jordan et al.; Moonlight's): fast growth of small singular values,
#: settling in [0.7, 1.2] rather than at exactly 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def update_scale(rows: int, cols: int) -> float:
    """Moonlight's factor for an ``rows x cols`` matrix: the orthogonalised update's RMS made AdamW's (0.2).

    Example:
        >>> update_scale(64, 256)
        3.2
    """
    return 0.2 * math.sqrt(max(rows, cols))


def orthogonalize(stack: Tensor, shape: tuple[int, int], steps: int = 5, dtype: torch.dtype | None = None) -> Tensor:
    """Quintic Newton-Schulz of a stack of whole ``shape`` matrices ``[k, *shape]``, scaled by :func:`update_scale`.

    ``dtype``: of the iteration (default bf16 on a GPU, fp32 elsewhere); the result has the input's.
    Raises ``ValueError`` for a stack of anything but whole ``shape`` matrices (a shard's rows).

    Example:
        >>> o = orthogonalize(torch.randn(1, 4, 8), (4, 8)) / update_scale(4, 8)
        >>> bool(torch.linalg.svdvals(o[0]).sub(1).abs().max() < 0.35)
        True
    """
    if stack.dim() != 3 or tuple(stack.shape[1:]) != tuple(shape):
        raise ValueError(f"Muon orthogonalises whole {shape[0]}x{shape[1]} matrices; got {tuple(stack.shape)}")
    if dtype is None:
        dtype = torch.bfloat16 if stack.is_cuda else torch.float32
    a, b, c = NS_COEFFICIENTS
    x = stack.to(dtype)
    if shape[0] > shape[1]:  # iterate on the short side: X X^T is the smaller square
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if shape[0] > shape[1]:
        x = x.mT
    return x.to(stack.dtype) * update_scale(*shape)


# ----------------------------------------------------------------------------- which parameters
def muon_split(name: str, shape: Sequence[int], spec: ModelSpec) -> int:
    """Logical matrices per matrix of parameter ``name`` (model-relative) if Muon takes it, else 0 (AdamW's).

    Muon takes the blocks' (``spec.layers``) 2-D weights but the MoE router's (a module named
    ``router`` or, as in HF's MoE blocks, ``gate``), and their 3-D weights (stacked experts:
    ``[experts, rows, cols]``, each expert its own matrix). A weight named ``gate_up_proj`` (HF's
    fused experts) stacks two logical matrices, gate and up, in its rows: 2. The rule reads only
    names and shapes, so the planner prices what the optimizer takes.

    Example:
        >>> from lightning_ultrascale.models import build_model
        >>> spec = build_model("moe_tiny", device="meta").spec
        >>> [muon_split(n, s, spec) for n, s in [("layers.1.attention.wq.weight", (64, 64)),
        ...     ("layers.1.feed_forward.router.weight", (8, 64)), ("layers.1.feed_forward.experts.w1", (8, 32, 64)),
        ...     ("tok_embeddings.weight", (256, 64)), ("layers.1.attention_norm.weight", (64,))]]
        [1, 0, 1, 0, 0]
    """
    if not name.startswith(f"{spec.layers}.") or len(shape) not in (2, 3):
        return 0
    module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    if module in ("router", "gate"):
        return 0
    return 2 if name.endswith("gate_up_proj") else 1


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> int:
    """FLOPs of :func:`orthogonalize` on one ``rows x cols`` matrix: per iteration ``X X^T`` (2a²b), its
    square (2a³) and the product with ``X`` (2a²b), ``a`` the shorter side.

    Example:
        >>> round(newton_schulz_flops(4096, 4096) / 1e12, 2)  # a Llama-3-8B attention matrix: 2 TFLOP a step
        2.06
    """
    a, b = sorted((rows, cols))
    return steps * (4 * a * a * b + 2 * a**3)


# ----------------------------------------------------------------------------- what it costs
def muon_matrices(plan: ShardPlan, spec: ModelSpec) -> dict[str, int]:
    """The parameters of ``plan`` that Muon takes, each with its logical matrices per matrix (:func:`muon_split`)."""
    splits = {name: muon_split(name, plan.whole.get(name, shape), spec) for name, shape in plan.shapes.items()}
    return {name: split for name, split in splits.items() if split}


#: Bytes per element of Muon's elementwise passes: momentum (read g and m, write m), Nesterov (read g
#: and m, write u), the update (read W and O, write W), and Newton-Schulz's cast in and out.
STEP_ACCESSES = 11


def muon_cost(rank: RankView, zero: int) -> CostTerms:
    """Muon's step on ``rank``: its Newton-Schulz GEMMs, its passes, the traffic that makes matrices whole.

    A rank orthogonalises its share of each matrix it holds a piece of (as :class:`Muon` divides them):
    its own shards' (ZeRO-3, TP, experts over EP), and of a flat range (ZeRO-1/2) or a whole replica (data
    parallelism) one in ``data ranks``. The traffic, after backward and so exposed: ZeRO-1/2 all-gather each
    bucket's update and reduce-scatter the results, replicas all-gather the results (the update's bytes,
    fp32 masters under ``bf16-mixed``); sharded matrices go to their owner and back (an all-to-all each way).
    """
    plan, spec = rank.plan, rank.spec
    element = 2 if rank.workload.precision == "bf16-true" else 4
    terms = CostTerms(in_step=False)
    for name, split in muon_matrices(plan, spec).items():
        local, whole = plan.shapes[name], plan.whole.get(name, plan.shapes[name])
        live = [d for d in plan.groups.get(name, DATA_DIMS) if plan.sizes[d] > 1]
        numel = math.prod(local)
        held = numel / math.prod(whole)  # this rank's piece: ZeRO-3, TP and EP shards
        flat = zero in (1, 2) or (zero == 0 and held == 1)  # a flat range, or a replica: divided over the group
        replicas = live if flat else [d for d in live if d == "dp_replicate" and zero == 3]  # (HSDP's replicas too)
        divided = math.prod(plan.sizes[d] for d in replicas)
        rows, cols = whole[-2] // split, whole[-1]
        count = (whole[0] if len(whole) == 3 else 1) * split
        width = min(rows, cols)
        flops = held / divided * count * newton_schulz_flops(rows, cols)
        terms.step_flops[width] = terms.step_flops.get(width, 0.0) + flops
        terms.step_bytes += STEP_ACCESSES * element * numel / (divided if zero in (1, 2) else 1)
        if replicas:  # the update gathered whole (ZeRO-1/2), the results gathered back (all but ZeRO-1/2's reduce)
            if zero in (1, 2):
                add_traffic(terms.traffic, dim_name(replicas), "all_gather", element * numel)
            add_traffic(terms.traffic, dim_name(replicas), "reduce_scatter" if zero in (1, 2) else "all_gather",
                        element * numel)  # fmt: skip
        sharded = [d for d in live if d != "dp_replicate"] if zero == 3 else []
        if numel < math.prod(whole) / math.prod(plan.sizes[d] for d in sharded) and plan.sizes["tp"] > 1:
            sharded.append("tp")  # (experts split over ep are whole on their rank)
        if sharded:
            add_traffic(terms.traffic, dim_name(sharded), "all_to_all", 2 * element * numel)
    return terms


def muon_param_groups(model: nn.Module, weight_decay: float, adamw_lr: float | None = None) -> list[dict[str, Any]]:
    """Param groups of ``model`` for :class:`Muon`: the matrices :func:`muon_split` names, and the rest for AdamW.

    AdamW takes the embedding, the head, norms, biases and the router, decayed as
    :class:`~lightning_ultrascale.LlamaModule` decays them (not the 1-D ones). ``adamw_lr``: the
    AdamW groups' learning rate, if not Muon's (Moonlight uses one for both).
    """
    spec = spec_of(model)
    if spec is None:
        raise ConfigError(f"optim.name=muon needs a model with a spec (its blocks); {type(model).__name__} has none")
    by_split: dict[int, list[nn.Parameter]] = defaultdict(list)
    rest = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            split = muon_split(name, p.shape, spec)
            (by_split[split] if split else rest).append(p)
    extra = {} if adamw_lr is None else {"lr": adamw_lr}
    groups: list[dict[str, Any]] = [
        {"params": ps, "use_muon": True, "split": split, "weight_decay": weight_decay}
        for split, ps in sorted(by_split.items())
    ]
    for decay, ps in ((weight_decay, [p for p in rest if p.dim() >= 2]), (0.0, [p for p in rest if p.dim() < 2])):
        groups.append({"params": ps, "use_muon": False, "weight_decay": decay, **extra})
    return groups


# ----------------------------------------------------------------------------- the optimizer
class Muon(torch.optim.Optimizer):
    """Muon with Moonlight's update scale and decoupled weight decay; AdamW for the groups with ``use_muon=False``.

    Args:
        params: param groups, as :func:`muon_param_groups` builds them (each with ``use_muon``;
            Muon groups may set ``split``: logical matrices stacked in each one's rows).
        lr: the learning rate of both (Moonlight's scale makes one rate fit both).
        momentum: Muon's momentum ``mu``; ``nesterov``: use ``g + mu*m`` (default) or ``m``.
        ns_steps: Newton-Schulz iterations.
        weight_decay: decoupled, both optimizers (groups may override it).
        betas, eps: AdamW's.

    Under ZeRO-1/2 the engine registers its flat shards (:meth:`register_flat_shard`); any other
    1-D tensor in a Muon group is refused at the step.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"optim.momentum={momentum}: Muon's momentum must be in [0, 1); Moonlight uses 0.95")
        if ns_steps < 1:
            raise ConfigError(f"optim.ns_steps={ns_steps} must be >= 1; the published iteration uses 5")
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay,
            betas=betas, eps=eps, use_muon=False, split=1,
        )  # fmt: skip
        super().__init__(params, defaults)
        #: ZeRO-1/2 flat shard -> the parameters it holds and where each starts in the bucket.
        self._flat: dict[Tensor, list[tuple[nn.Parameter, int]]] = {}
        #: Plain tensors that are whole replicas over a mesh's ranks (data parallelism): the work divides over it.
        self._replicas: dict[Tensor, DeviceMesh] = {}
        #: Logical matrices this rank orthogonalised, by shape, over every step (how the work divides).
        self.orthogonalized: Stats = Counter()

    def register_flat_shard(self, shard: Tensor, members: Sequence[tuple[nn.Parameter, int]]) -> None:
        """``shard`` (a ``Shard(0)`` DTensor of a flat bucket) holds ``members``: each parameter and its offset."""
        self._flat[shard] = list(members)

    def register_replicas(self, tensors: Sequence[Tensor], mesh: DeviceMesh) -> None:
        """``tensors`` hold the same values on every rank of ``mesh`` (after the gradient all-reduce): each rank
        orthogonalises a share of their matrices and the results are all-gathered."""
        for t in tensors:
            self._replicas[t] = mesh

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        load: list[int] = []  # ZeRO-1/2's owners: elements each data rank orthogonalises this step
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group, load)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any], load: list[int]) -> None:
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        params, updates = [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            params.append(p)
            updates.append(p.grad.add(buf, alpha=mu) if group["nesterov"] else buf.clone())
        for p, o in zip(params, self._orthogonalized(params, updates, group, load)):
            p.mul_(1 - lr * wd).sub_(o, alpha=lr)

    def _orthogonalized(
        self, params: list[Tensor], updates: list[Tensor], group: dict[str, Any], load: list[int]
    ) -> list[Tensor]:
        """Each update orthogonalised as whole matrices, as this rank's piece (the update's own type)."""
        out: list[Tensor | None] = [None] * len(updates)
        rest = []
        for i, (p, u) in enumerate(zip(params, updates)):
            if p in self._flat:
                out[i] = _flat_orthogonalized(u, self._flat[p], group, load, self.orthogonalized)
            elif u.dim() in (2, 3):
                rest.append(i)
            else:
                raise ConfigError(
                    f"Muon was given a {u.dim()}-D tensor of shape {tuple(u.shape)} in a Muon group: it orthogonalises "
                    "whole matrices and refuses a flattened one (a sharded optimizer that does not register its flat "
                    "shards with Muon.register_flat_shard); put 1-D parameters in a group with use_muon=False"
                )
        shared = [_replicated(updates[i], self._replicas.get(params[i])) for i in rest]
        for i, o in zip(rest, _whole_orthogonalized(shared, group, self.orthogonalized)):
            out[i] = o if isinstance(updates[i], DTensor) else local_tensor(o)
        return out  # type: ignore[return-value]

    def _adamw_step(self, group: dict[str, Any]) -> None:
        (beta1, beta2), lr, wd, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = float(state["step"])
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1 - lr * wd)
            exp_avg.lerp_(p.grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


# ----------------------------------------------------------------------------- whole matrices
def _whole_orthogonalized(updates: list[Tensor], group: dict[str, Any], stats: Stats) -> list[Tensor]:
    """Each of ``updates`` (2-D, or 3-D stacked experts; plain or DTensor) orthogonalised whole, as its own piece.

    The 2-D ones of one shape and layout go as one stack (the work divides over the ranks).
    """
    out: list[Tensor] = list(updates)
    stacks: dict[Any, list[int]] = defaultdict(list)
    for i, u in enumerate(updates):
        if u.dim() == 3:
            out[i] = _like(_stack_orthogonalized([u], group, stats), u)
        else:
            stacks[_stack_key(u)].append(i)
    for indices in stacks.values():
        done = _stack_orthogonalized([updates[i] for i in indices], group, stats)
        for i, o in zip(indices, _unstack(done, updates[indices[0]])):
            out[i] = o
    return out


def _replicated(u: Tensor, mesh: DeviceMesh | None) -> Tensor:
    """A plain tensor replicated over ``mesh`` as a DTensor of it (the work divides over its ranks), else ``u``."""
    if mesh is None or isinstance(u, DTensor):
        return u
    return DTensor.from_local(u, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _stack_key(u: Tensor) -> tuple[Any, ...]:
    if isinstance(u, DTensor):
        return (tuple(u.shape), u.dtype, id(u.device_mesh), u.placements)
    return (tuple(u.shape), u.dtype)


def _shifted(placements: Sequence[Placement]) -> list[Placement]:
    """The placements of a stack of tensors placed so: each sharded dimension one further."""
    out: list[Placement] = []
    for p in placements:
        if isinstance(p, _StridedShard):
            out.append(_StridedShard(p.dim + 1, split_factor=p.split_factor))
        elif isinstance(p, Shard):
            out.append(Shard(p.dim + 1))
        elif isinstance(p, Partial):
            raise ValueError("Muon cannot orthogonalise a partial sum (a DTensor with a Partial placement)")
        else:
            out.append(p)
    return out


def _stack_orthogonalized(updates: list[Tensor], group: dict[str, Any], stats: Stats) -> Tensor:
    """``updates`` (same shape and layout; 2-D each, or one 3-D stack) orthogonalised, as a local stack.

    A DTensor stack is redistributed so the stack dimension is split over every mesh dimension and
    each matrix is whole on the rank that holds it, orthogonalised there, and redistributed back.
    """
    first = updates[0]
    if first.dim() == 3:
        local, placements = local_tensor(first), list(first.placements) if isinstance(first, DTensor) else []
        shape = tuple(first.shape)
    else:
        local = torch.stack([local_tensor(u) for u in updates])
        placements = _shifted(first.placements) if isinstance(first, DTensor) else []
        shape = (len(updates), *first.shape)
    if not isinstance(first, DTensor):
        return _split_orthogonalized(local, shape[1:], group, stats)
    mesh: DeviceMesh = first.device_mesh
    stride = (shape[1] * shape[2], shape[2], 1)
    whole = [Shard(0)] * mesh.ndim
    stack = DTensor.from_local(local, mesh, placements, shape=torch.Size(shape), stride=stride, run_check=False)
    owned = stack.redistribute(mesh, whole).to_local()
    done = _split_orthogonalized(owned, shape[1:], group, stats)
    done = DTensor.from_local(done, mesh, whole, shape=stack.shape, stride=stride)
    return done.redistribute(mesh, placements).to_local()


def _split_orthogonalized(stack: Tensor, shape: Sequence[int], group: dict[str, Any], stats: Stats) -> Tensor:
    """A local stack of whole ``shape`` matrices, each ``group["split"]`` logical matrices stacked in its rows."""
    rows, cols = shape
    if tuple(stack.shape[1:]) != (rows, cols):
        raise ValueError(f"Muon orthogonalises whole {rows}x{cols} matrices; this rank holds {tuple(stack.shape)}")
    split = group["split"]
    if rows % split:
        raise ValueError(f"a Muon group with split={split} holds {rows}-row matrices: not {split} logical matrices")
    k = stack.shape[0] * split
    stats[(rows // split, cols)] += k
    logical = stack.reshape(k, rows // split, cols)
    return orthogonalize(logical, (rows // split, cols), group["ns_steps"]).reshape(stack.shape)


def _unstack(stack: Tensor, like: Tensor) -> list[Tensor]:
    """A local stack back into tensors of ``like``'s type and layout."""
    return [_like(t, like) for t in stack.unbind(0)]


def _like(local: Tensor, like: Tensor) -> Tensor:
    """``local`` as ``like``'s piece: a DTensor of its layout if it is one."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(), run_check=False
    )


def _flat_orthogonalized(
    update: Tensor,
    members: list[tuple[nn.Parameter, int]],
    group: dict[str, Any],
    load: list[int],
    stats: Stats,
) -> Tensor:
    """A ZeRO-1/2 flat shard's update, its bucket's matrices orthogonalised whole, as this rank's shard.

    The bucket's update is all-gathered; each matrix goes to the data rank with the least work so far
    (``load``: elements per rank, over the step's buckets in the same order on every rank), which
    orthogonalises it (with its tensor-parallel peers, for a TP piece); the results, zero elsewhere,
    are summed back into the shards: a reduce-scatter.
    """
    if not isinstance(update, DTensor):
        raise ValueError("a registered flat shard must be a DTensor over its bucket")
    mesh = update.device_mesh
    ranks, me = mesh.size(), mesh.get_local_rank()
    if len(load) < ranks:
        load.extend([0] * (ranks - len(load)))
    full = update.full_tensor()
    result = torch.zeros_like(full)
    owned: list[tuple[int, Tensor]] = []
    for p, offset in sorted(members, key=lambda m: -m[0].numel()):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        load[owner] += p.numel()
        if owner == me:
            piece = local_tensor(p).shape
            owned.append((offset, _like(full[offset : offset + math.prod(piece)].view(piece), p)))
    for (offset, _), o in zip(owned, _whole_orthogonalized([v for _, v in owned], group, stats)):
        o = local_tensor(o)
        result[offset : offset + o.numel()] = o.reshape(-1)
    summed = DTensor.from_local(result, mesh, [Partial()], shape=full.shape, stride=full.stride(), run_check=False)
    return summed.redistribute(mesh, [Shard(0)])
