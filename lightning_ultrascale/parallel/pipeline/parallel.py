"""PipelineParallel: the playbook's pipeline parallelism inside Lightning's training loop.

The model's blocks are split into ``pp x v`` stages (``v`` virtual stages per rank for the
interleaved and V-shaped schedules); a rank builds only its stages (the split happens on the
meta device). Every batch is cut into ``microbatches``; a ``torch.distributed.pipelining``
schedule runs their forwards and backwards across the ranks, the activations and their
gradients travelling point to point between neighbouring stages.

The strategy runs the schedule in place of the LightningModule's ``training_step`` (which would
run the whole model on one rank), so the module provides the loss instead:

* ``loss_fn(logits, labels) -> Tensor``: the mean loss over the tokens whose label is not -100,
  computed on the last stage for each microbatch;
* optionally ``pipeline_step_end(loss, batch, batch_idx, split)`` (``split`` is ``"train"`` or
  ``"val"``), called on every rank with the batch's mean loss, to log it.

Each microbatch's loss is weighted by its share of the batch's tokens, so gradients equal those
of one pass over the whole batch for any number of microbatches (``scale_grads=False`` in torch's
terms). Lightning's automatic optimisation keeps working: optimizer step, gradient clipping
(the norm is summed over the stages), LR schedulers, gradient accumulation on top of the
microbatches, validation (a forward-only schedule) and checkpoints.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_ultrascale.errors import ConfigError, divisors, require_positive_int
from lightning_ultrascale.models.spec import ModelSpec, require_spec
from lightning_ultrascale.parallel.dims import ParallelDims
from lightning_ultrascale.parallel.mesh import ParallelMesh
from lightning_ultrascale.parallel.pipeline.schedules import (
    resolve_virtual_stages,
    schedule_info,
    stage_ranks,
    validate_microbatches,
)
from lightning_ultrascale.parallel.pipeline.split import plan_stages, stages_from_split_points
from lightning_ultrascale.parallel.pipeline.stage import StageModule, first_param_device, prune_to_stages
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.utils.loss import IGNORE_INDEX


class PipelineParallel(ParallelPlugin):
    """Pipeline parallelism over the ``pp`` mesh dim with a named schedule.

    Args:
        size: pipeline ranks (``pp``).
        schedule: ``"afab"`` (GPipe), ``"1f1b"``, ``"interleaved_1f1b"``, ``"looped_bfs"``,
            ``"zero_bubble"``, ``"zbv"`` or ``"dualpipev"``
            (see :mod:`lightning_ultrascale.parallel.pipeline.schedules`).
        microbatches: microbatches per batch (default: the number of stages, the fewest every
            schedule accepts). More microbatches, smaller bubble: ``(pp-1)/microbatches`` for 1F1B.
        virtual_stages: stages per rank (interleaved / looped schedules; default 2 for them, 1
            for ``zero_bubble``; V-shaped schedules always use 2).
        split_points: module names before which a stage begins (``["layers.10", "layers.20"]``),
            ``pp x virtual_stages - 1`` of them; default: balance the stages' compute, the
            embedding and the head counted.

    Example:
        >>> from lightning_ultrascale import PipelineParallel, UltraScaleStrategy, ZeRO
        >>> strategy = UltraScaleStrategy(PipelineParallel(4, "interleaved_1f1b", microbatches=16), ZeRO(stage=1))
    """

    applies_at = "pipeline"

    def __init__(
        self,
        size: int,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        split_points: Sequence[str] | None = None,
    ) -> None:
        require_positive_int("parallel.pp", size)
        self.info = schedule_info(schedule)
        self.size = size
        self.schedule = schedule
        self.virtual_stages = resolve_virtual_stages(schedule, virtual_stages)
        self.n_stages = size * self.virtual_stages
        self.microbatches = self.n_stages if microbatches is None else microbatches
        if size > 1:
            validate_microbatches(schedule, size, self.virtual_stages, self.microbatches)
        self.split_points = list(split_points) if split_points is not None else None
        self._stage_ranks = stage_ranks(schedule, size, self.virtual_stages)
        self._model: nn.Module | None = None
        self._spec: ModelSpec | None = None
        self._ranges: list[range] = []
        self._local: list[int] = []
        self._group: dist.ProcessGroup | None = None
        self._pp_rank = 0
        self._stages: list[StageModule] | None = None
        self._torch_schedule: Any = None
        self._tied: tuple[nn.Parameter, dist.ProcessGroup] | None = None
        self._tied_group: dist.ProcessGroup | None = None  # this rank's embedding group, if it is in one
        self._loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._token_scale = torch.ones(())

    # ----------------------------------------------------------------------------- configuration
    def mesh_sizes(self) -> dict[str, int | None]:
        return {"pp": self.size}

    def settings(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "microbatches": self.microbatches, "virtual_stages": self.virtual_stages}

    @property
    def runs_step(self) -> bool:
        return self.size > 1

    def validate(self, dims: ParallelDims, spec: ModelSpec) -> None:
        if spec.n_layers < self.n_stages:
            raise ConfigError(
                f"parallel.pp={self.size} x parallel.pp_virtual_stages={self.virtual_stages} = {self.n_stages} "
                f"stages, but model {spec.name} has n_layers={spec.n_layers}: every stage needs a block; valid: "
                f"pp x virtual stages <= {spec.n_layers}"
            )
        if self.split_points is not None:
            stages_from_split_points(spec, self.split_points, self.n_stages)

    def validate_data(self, seq_len: int, micro_batch_size: int) -> None:
        if self.runs_step and micro_batch_size % self.microbatches:
            valid = [d * self.microbatches for d in (1, 2, 3)]
            raise ConfigError(
                f"data.micro_batch_size={micro_batch_size} (the batch each data-parallel rank runs per step) must be "
                f"divisible by parallel.pp_microbatches={self.microbatches}: data.global_batch_size must be a "
                f"multiple of dp x microbatches; valid micro_batch_size: {', '.join(map(str, valid))}, ... "
                f"(or microbatches among the divisors {', '.join(map(str, divisors(micro_batch_size)))})"
            )

    # ----------------------------------------------------------------------------- model
    def apply(self, model: nn.Module, mesh: ParallelMesh) -> nn.Module:
        if not self.runs_step:
            return model
        spec = require_spec(model)
        if not callable(getattr(model, "forward_stage", None)):
            raise TypeError(
                f"{type(model).__name__} has no forward_stage(x, position_ids, blocks, embed=, head=); "
                "pipeline parallelism runs the model stage by stage through it (see models/llama.py)"
            )
        pp_mesh = mesh["pp"]
        self._group = pp_mesh.get_group()
        self._pp_rank = pp_mesh.get_local_rank()
        self._ranges = plan_stages(model, spec, self.n_stages, self.split_points)
        self._local = [s for s, r in enumerate(self._stage_ranks) if r == self._pp_rank]
        last = self.n_stages - 1
        tied = self._tied_weights(model, spec)
        prune_to_stages(
            model,
            spec,
            {b for s in self._local for b in self._ranges[s]},
            first=0 in self._local,
            last=last in self._local,
        )
        if tied and self._stage_ranks[0] != self._stage_ranks[last]:
            self._make_tied_group(mesh)
        self._model, self._spec = model, spec
        # Data-parallel wrapping (FSDP) treats each stage as the root of its own unit.
        model._ultrascale_parts = self.stage_modules  # type: ignore[assignment]
        return model

    @staticmethod
    def _tied_weights(model: nn.Module, spec: ModelSpec) -> bool:
        embedding, head = getattr(model, spec.embedding, None), getattr(model, spec.head, None)
        return embedding is not None and head is not None and head.weight is embedding.weight

    def _make_tied_group(self, mesh: ParallelMesh) -> None:
        # Tied embedding and head on different ranks (Megatron's "embedding group"): the two
        # copies sum their gradients each step, so they stay one parameter. Every rank creates
        # every group, in the same order (new_group is collective).
        ranks = mesh.root.mesh  # [pp, dp_replicate, dp_shard, cp, tp] -> global rank
        first, last = self._stage_ranks[0], self._stage_ranks[-1]
        for index in itertools.product(*(range(n) for n in ranks.shape[1:])):
            pair = [int(ranks[(first, *index)]), int(ranks[(last, *index)])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                self._tied_group = group

    def stage_modules(self) -> list[StageModule]:
        """This rank's stages, in stage order (built once, from the model's current pieces)."""
        if self._stages is None:
            assert self._model is not None and self._spec is not None, "apply() first"
            last = self.n_stages - 1
            self._stages = [
                StageModule(self._model, self._spec, s, self._ranges[s], first=s == 0, last=s == last)
                for s in self._local
            ]
        return self._stages

    def on_materialized(self, model: nn.Module) -> None:
        if not self.runs_step:
            return
        assert self._spec is not None
        if self._torch_schedule is None:
            self._torch_schedule = self._build_schedule()
        if self._tied_group is not None:
            # Marks live on parameter objects, which materialisation and .to() replace: set anew.
            owner = getattr(model, self._spec.embedding, None) or getattr(model, self._spec.head)
            self._tied = (owner.weight, self._tied_group)
            head = getattr(model, self._spec.head, None)
            if head is not None and self._stage_ranks[0] != self._pp_rank:
                # The last stage's copy is the same parameter: count it once in the gradient norm.
                head.weight._ultrascale_norm_skip = True

    def _build_schedule(self) -> Any:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        stages = [
            PipelineStage(module, module.index, self.n_stages, first_param_device(module), group=self._group)
            for module in self.stage_modules()
        ]
        schedule_class = get_schedule_class(self.info.torch_class)
        # Our loss is already weighted by token counts: torch must not divide by microbatches.
        return schedule_class(
            stages if self.info.multi else stages[0],
            n_microbatches=self.microbatches,
            loss_fn=self._microbatch_loss,
            scale_grads=False,
        )

    # ----------------------------------------------------------------------------- the step
    def _microbatch_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        loss = self._loss_fn(logits, labels)
        return loss * ((labels != IGNORE_INDEX).sum() * self._token_scale)

    def run_step(
        self,
        module: Any,
        batch: dict[str, torch.Tensor],
        train: bool,
        accumulate: int = 1,
        loss_scale: float | torch.Tensor = 1.0,
    ) -> torch.Tensor:
        """Run the schedule on ``batch`` (forward and backward if ``train``); return its mean loss on every rank.

        Gradients accumulate into ``.grad`` (the caller zeroes them and reduces them over data
        parallelism); ``accumulate`` is the number of such calls per optimizer step; the loss is
        multiplied by ``loss_scale`` (this rank's token weight over the data-parallel ranks).
        """
        loss_fn = getattr(module, "loss_fn", None)
        if not callable(loss_fn):
            raise TypeError(
                f"{type(module).__name__} has no loss_fn(logits, labels): with pipeline parallelism the loss is "
                "computed on the last stage, per microbatch, by that method"
            )
        tokens, labels = batch["input_ids"], batch["labels"]
        if tokens.shape[0] % self.microbatches:
            raise ConfigError(
                f"a batch of {tokens.shape[0]} samples cannot be split into parallel.pp_microbatches="
                f"{self.microbatches}; valid batch sizes: multiples of {self.microbatches}"
            )
        position_ids = batch.get("position_ids")
        if position_ids is None:
            # Every stage needs the positions for RoPE; a hidden state under sequence
            # parallelism is a sequence shard and cannot tell them.
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        self._loss_fn = loss_fn
        n_tokens = (labels != IGNORE_INDEX).sum().clamp(min=1)
        self._token_scale = loss_scale / (n_tokens * accumulate)
        losses: list[torch.Tensor] = []
        args = (tokens,) if 0 in self._local else ()
        holds_last = self.n_stages - 1 in self._local
        target = labels if holds_last else None
        schedule = self._torch_schedule
        if train:
            schedule.step(*args, target=target, losses=losses, return_outputs=False, position_ids=position_ids)
        else:
            schedule.eval(*args, target=target, losses=losses, position_ids=position_ids)
        loss = torch.zeros((), device=tokens.device)
        if holds_last:
            loss = torch.stack([_value(x) for x in losses]).sum() * accumulate
        # Every rank reports the loss (Lightning logs and callbacks run everywhere).
        dist.broadcast(loss, group=self._group, group_src=self._stage_ranks[-1])
        return loss

    def sync_gradients(self) -> None:
        if self._tied is None:
            return
        weight, group = self._tied
        grad = weight.grad
        if grad is None:
            grad = torch.zeros_like(weight)
            weight.grad = grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)

    def grad_norm_groups(self) -> tuple[dist.ProcessGroup, ...]:
        return (self._group,) if self.runs_step and self._group is not None else ()


def _value(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()
