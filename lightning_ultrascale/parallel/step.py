"""How a step runs: Lightning's own step (:class:`StepRunner`) or a pipeline schedule (``pipeline/step.py``).

The runner owns everything around forward and backward that depends on the layout, once for
every path:

- the batch this rank sees (the Layout's batch transforms: context parallelism keeps its tokens);
- the plugins' step contexts (loss parallel) around forward and backward;
- token weighting: each micro-step's loss is weighted by its labelled fraction and the step's
  gradients are rescaled after its last backward, so they are the mean over every labelled token
  of the global batch, across ``dp x cp`` ranks and accumulation micro-steps (``utils/loss.py``);
- gradient synchronisation: the data-parallel engines' ``no_sync`` on accumulation micro-steps, and
  after the last backward each DTensor gradient in its parameter's placements (:func:`settle_gradients`:
  DTensor hands a sequence-parallel norm a ``Partial`` gradient and a vocabulary-parallel embedding a
  ``Replicate`` one; left so, every op that met them redistributed them again, and AdamW's update
  all-reduced a norm's gradient three times);
- checkpoint options (a pipeline's stages keep parameters on some ranks only: sharded checkpoints).

Under Lightning's step, Lightning zeroes gradients and runs backward (with the engines' hooks);
a pipeline runner does both itself.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from lightning_ultrascale.utils.loss import TokenNormaliser

if TYPE_CHECKING:
    from lightning_ultrascale.parallel.layout import Layout

#: What :meth:`StepRunner.score` applies to a forward's logits where they are: ``(logits, labels, position_ids)``
#: to a small per-row tensor (the full logits never travel).
Scorer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class StepRunner:
    """Lightning's own training and validation step, with the layout's batch, contexts and token weight.

    The strategy calls it with Lightning's step (``lightning_step``, the LightningModule's
    ``training_step`` as Lightning wraps it) and the step's arguments.
    """

    #: Whether checkpoints must be sharded (DCP): ranks hold parameters no other rank has.
    requires_sharded_checkpoint: ClassVar[bool] = False
    #: Whether every :meth:`score` batch should have one shape (a pipeline's: each shape builds a schedule),
    #: and what its rows must be a multiple of (the microbatches).
    score_fixed: ClassVar[bool] = False
    score_rows: int = 1

    def __init__(self) -> None:
        self._layout: Layout | None = None
        self.tokens = TokenNormaliser()
        self._weight: torch.Tensor | None = None
        self._counted = False  # whether this step's counts went into the agreement

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("the step runner is bound to the layout at setup")
        return self._layout

    def bind(self, layout: Layout) -> None:
        self._layout = layout

    def training_step(self, module: Any, lightning_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        args, kwargs = self._transform(args, kwargs)
        with self.layout.step_context():
            output = lightning_step(*args, **kwargs)
        # Applied in backward (:meth:`weighted`): the loss Lightning shows and hands callbacks stays the mean.
        self.weigh(batch_and_index(args, kwargs)[0])
        return output

    def weigh(self, batch: Any) -> None:
        """Weight the next backward by ``batch``'s labelled fraction (this rank's part of a training micro-step)."""
        self._weight = self.token_weight(batch)

    def weighted(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward on: weighted by its micro-step's labelled fraction (``utils/loss.py``)."""
        weight, self._weight = self._weight, None
        return loss if weight is None else loss * weight.to(loss.dtype)

    def validation_step(self, module: Any, lightning_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        args, kwargs = self._transform(args, kwargs)
        with self.layout.step_context():
            return lightning_step(*args, **kwargs)

    @contextlib.contextmanager
    def backward_context(self) -> Iterator[None]:
        """Around Lightning's backward: the contexts the forward ran in (loss parallel's backward)."""
        with self.layout.step_context():
            yield

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Hold back gradient reductions (Lightning enters it on non-final accumulation micro-steps)."""
        return self.layout.no_sync()

    def on_train_start(self, module: Any) -> None:
        """Called when fitting starts."""

    def token_weight(self, batch: Any) -> torch.Tensor | None:
        """This micro-step's labelled fraction (1.0 when every token is labelled); :meth:`finish_step` completes it."""
        if not isinstance(batch, dict) or not isinstance(batch.get("labels"), torch.Tensor):
            return None
        return self.tokens.weight(batch["labels"])

    def finish_step(self, optimizer: torch.optim.Optimizer, accumulate: int) -> None:
        """After the step's last backward: gradients become the mean over every labelled token of the global batch."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.tokens.finish(grads, self.layout.mesh["dp_cp"].get_group(), accumulate)

    def take_counts(self) -> torch.Tensor | None:
        """This rank's labelled tokens and label slots of the step, for the step's agreement (then reset)."""
        counts = self.tokens.take_counts()
        self._counted = counts is not None
        return counts

    def count_group(self) -> Any:
        """The ranks whose labelled tokens one step's gradient averages: the ``dp x cp`` group."""
        return self.layout.mesh["dp_cp"].get_group()

    def scale_step(self, optimizer: torch.optim.Optimizer, totals: tuple[float, float] | None, accumulate: int) -> None:
        """:meth:`finish_step` from the step's token totals over :meth:`count_group` (as the agreement read
        them): the gradients scaled, or left alone where every slot was labelled."""
        if not self._counted:
            return
        self._counted = False
        assert totals is not None, "the agreement read no token totals for a step that counted tokens"
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.tokens.scale(grads, totals, accumulate)

    @torch.no_grad()
    def score(self, module: Any, batch: dict[str, torch.Tensor], scorer: Scorer) -> torch.Tensor:
        """A forward only, for evaluation: ``scorer(logits, labels, position_ids)`` of this rank's part of ``batch``
        (its ``input_ids``, ``labels`` and ``position_ids``; under context parallelism a sequence chunk of each)."""
        batch = self.layout.transform_batch(batch)
        with self.layout.step_context():
            logits = module(batch["input_ids"], batch["position_ids"])
        return scorer(logits, batch["labels"], batch["position_ids"])

    def _transform(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "batch" in kwargs:
            return args, {**kwargs, "batch": self.layout.transform_batch(kwargs["batch"])}
        if args:
            return (self.layout.transform_batch(args[0]), *args[1:]), kwargs
        return args, kwargs


def batch_and_index(args: tuple, kwargs: dict) -> tuple[Any, int]:
    """The batch and batch index of a step's arguments, however Lightning passed them."""
    batch = kwargs.get("batch", args[0] if args else None)
    batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
    return batch, int(batch_idx)


@torch.no_grad()
def settle_gradients(parameters: Iterable[nn.Parameter]) -> None:
    """Give each DTensor gradient its parameter's placements: the ``Partial`` sums over a 1-D mesh
    (sequence-parallel norms) in one all-reduce per mesh and dtype, the rest redistributed (a vocabulary-
    parallel embedding's ``Replicate`` gradient becomes its ``Shard(0)`` slice, no traffic).

    Every rank of the gradients' meshes calls it, after the step's last backward; a gradient already
    in its parameter's placements (every plain tensor) is left as it is.

    Example:
        >>> p = nn.Parameter(torch.ones(2)); p.grad = torch.ones(2)
        >>> settle_gradients([p]); p.grad.tolist()  # (a plain gradient: nothing to do)
        [1.0, 1.0]
    """
    sums: dict[tuple[object, torch.dtype], list[nn.Parameter]] = defaultdict(list)
    for p in parameters:
        grad = p.grad
        if not isinstance(grad, DTensor) or not isinstance(p, DTensor) or grad.placements == p.placements:
            continue
        if _sums_into(grad, p):
            sums[(grad.device_mesh, grad.dtype)].append(p)
        else:
            p.grad = grad.redistribute(p.device_mesh, p.placements)
    for (mesh, _), params in sums.items():
        pieces = [p.grad.to_local() for p in params]  # type: ignore[union-attr]
        flat = torch._utils._flatten_dense_tensors(pieces)
        dist.all_reduce(flat, group=mesh.get_group())  # type: ignore[attr-defined]
        for p, total in zip(params, torch._utils._unflatten_dense_tensors(flat, pieces)):
            p.grad = DTensor.from_local(
                total, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )


def _sums_into(grad: DTensor, param: DTensor) -> bool:
    """Whether ``grad`` is a sum of pieces over a 1-D mesh that ``param`` replicates."""
    return (
        grad.device_mesh == param.device_mesh
        and grad.device_mesh.ndim == 1
        and isinstance(grad.placements[0], Partial)
        and grad.placements[0].reduce_op == "sum"
        and param.placements[0].is_replicate()
    )
