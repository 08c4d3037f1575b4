"""The pipeline's step runner: a ``torch.distributed.pipelining`` schedule in place of Lightning's step.

Lightning's automatic optimisation keeps working around it (optimizer step, clipping, LR
schedulers, accumulation, validation, checkpoints), but the schedule runs forward and backward
of every microbatch itself, so this runner, not Lightning:

- zeroes gradients at the first micro-step of an optimizer step (Lightning's own zero_grad and
  backward are skipped: its closure would wipe the gradients after ``training_step``);
- runs the schedule with every data-parallel reduction held back (the engines' ``no_sync``),
  then sums a tied embedding's two copies and reduces once after the last micro-step (zero-
  bubble weight gradients come from ``autograd.grad``, which fires no hooks);
- weights each microbatch's loss by its share of the batch's tokens and this rank's share of
  the ``dp x cp`` tokens, so gradients equal those of one pass over the global batch;
- broadcasts the batch's mean loss from the last stage to every rank: ``training_step``'s result
  everywhere (the module logs its own loss from ``loss_fn``, which runs on the last stage).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_ultrascale.errors import ConfigError, option
from lightning_ultrascale.models.common.decoder import MTP_KEYS, mtp_targets
from lightning_ultrascale.models.contract import check_batch
from lightning_ultrascale.models.spec import PipelineLoss, declares
from lightning_ultrascale.parallel.pipeline.buffers import FreeingStage, SendLedger, tracking_sends
from lightning_ultrascale.parallel.pipeline.stage import first_param_device
from lightning_ultrascale.parallel.step import Scorer, StepRunner, batch_and_index
from lightning_ultrascale.parallel.tied import sum_gradients
from lightning_ultrascale.utils.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from lightning_ultrascale.parallel.pipeline.parallel import PipelineParallel


class PipelineStep(StepRunner):
    """Runs each step's batch through ``pipeline``'s schedule; see the module docstring."""

    requires_sharded_checkpoint = True
    score_fixed = True

    def __init__(self, pipeline: PipelineParallel) -> None:
        super().__init__()
        self.pipeline = pipeline
        self._schedule: Any = None
        self._loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._token_scale: torch.Tensor | float = 1.0
        self._sends = SendLedger()  # what the rank's stages sent, freed once done (pipeline/buffers.py)
        self._scores: list[torch.Tensor] | None = None  # an evaluation's per-microbatch scores (:meth:`score`)
        self._scorer: Scorer | None = None
        self._eval_schedule: tuple[tuple[int, ...], Any] | None = None  # (batch shape, schedule) of score()

    # ----------------------------------------------------------------------------- Lightning's hooks
    def training_step(self, module: Any, lightning_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        args, kwargs = self._transform(args, kwargs)
        batch, batch_idx = batch_and_index(args, kwargs)
        trainer = module.trainer
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            for optimizer in trainer.optimizers:
                module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)
        weight = self.token_weight(batch)
        scale = 1.0 if weight is None else weight
        with self.layout.step_context(), self.no_sync():
            loss = self.run(module, batch, train=True, accumulate=accumulate, loss_scale=scale)
        if not trainer.fit_loop._should_accumulate():
            self.sync_gradients()
        return loss

    def validation_step(self, module: Any, lightning_step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        args, kwargs = self._transform(args, kwargs)
        with self.layout.step_context():
            return self.run(module, batch_and_index(args, kwargs)[0], train=False)

    @property
    def score_rows(self) -> int:
        """A :meth:`score` batch's rows must be a multiple of the microbatches."""
        return self.pipeline.microbatches

    @torch.no_grad()
    def score(self, module: Any, batch: dict[str, torch.Tensor], scorer: Scorer) -> torch.Tensor:
        """A forward only through a schedule's ``eval``: ``scorer`` runs on the last stage's logits of every
        microbatch, in place of the loss; the rows' scores are broadcast to every rank of the pipeline.

        The stages' receive buffers are sized by the first batch a schedule runs: a batch of another shape
        than the steps' gets a schedule of its own over the same stage modules (one kept, the last shape's).
        """
        shape = tuple(batch["input_ids"].shape)
        if self._eval_schedule is None or self._eval_schedule[0] != shape:
            self._eval_schedule = (shape, self._build_schedule())
        schedule = self._eval_schedule[1]
        pipeline = self.pipeline
        batch = self.layout.transform_batch(batch)
        holds_last = pipeline.n_stages - 1 in pipeline.local
        # The loss function sees (output, target) only: the positions travel beside the labels.
        target = torch.stack([batch["labels"], batch["position_ids"]], dim=-1) if holds_last else None
        args = (batch["input_ids"],) if 0 in pipeline.local else ()
        self._scores, self._scorer = [], scorer
        try:
            with self.layout.step_context():
                schedule.eval(*args, target=target, losses=[], **_stage_kwargs(batch))
            scores = self._scores
        finally:
            self._scores, self._scorer = None, None
        device = batch["input_ids"].device
        out = torch.cat(scores) if holds_last else torch.empty(0)
        sizes = torch.tensor(out.shape if holds_last else (0, 0), device=device)  # rows and the scorer's width
        dist.broadcast(sizes, group=pipeline.group, group_src=pipeline.stage_ranks[-1])
        if not holds_last:
            out = torch.empty(*sizes.tolist(), dtype=torch.float64, device=device)
        dist.broadcast(out, group=pipeline.group, group_src=pipeline.stage_ranks[-1])
        return out

    def on_train_start(self, module: Any) -> None:
        if not module.automatic_optimization:
            raise ConfigError(
                f"{self.pipeline!r} runs forward and backward itself; it needs automatic optimisation "
                f"(set {type(module).__name__}.automatic_optimization = True)"
            )
        # The schedule has run backward inside training_step; Lightning must neither zero the
        # gradients after it nor run a backward of its own (the flag its SWA callback uses).
        module.trainer.fit_loop._skip_backward = True

    def sync_gradients(self) -> None:
        """After the last micro-step: sum a tied weight's two copies, then let every engine reduce."""
        if self.layout.tied_copies:
            assert self.pipeline.model is not None
            sum_gradients(self.pipeline.model, self.layout.tied_copies, self.layout.grad_syncs)
        for sync in self.layout.grad_syncs:
            sync.reduce()

    # ----------------------------------------------------------------------------- the schedule
    def run(
        self,
        module: Any,
        batch: dict[str, torch.Tensor],
        train: bool,
        accumulate: int = 1,
        loss_scale: float | torch.Tensor = 1.0,
    ) -> torch.Tensor:
        """Run the schedule on ``batch`` (forward and backward if ``train``); return its mean loss on every rank.

        Gradients accumulate into ``.grad``; ``accumulate`` is the number of such calls per
        optimizer step; the loss is multiplied by ``loss_scale`` (this rank's token weight over
        the data-parallel ranks).
        """
        pipeline = self.pipeline
        tokens, labels = check_batch(batch, repr(pipeline), also=MTP_KEYS)["input_ids"], batch["labels"]
        self._loss_fn = _loss_fn_of(module)
        if tokens.shape[0] % pipeline.microbatches:
            raise ConfigError(
                f"a batch of {tokens.shape[0]} samples cannot be split into "
                f"{option(pipeline, 'microbatches', pipeline.microbatches)}; "
                f"valid batch sizes: multiples of {pipeline.microbatches}"
            )
        n_tokens = (labels != IGNORE_INDEX).sum().clamp(min=1)
        self._token_scale = loss_scale / (n_tokens * accumulate)
        losses: list[torch.Tensor] = []
        args = (tokens,) if 0 in pipeline.local else ()
        holds_last = pipeline.n_stages - 1 in pipeline.local
        target = labels if holds_last else None
        schedule = self._torch_schedule()
        kwargs = _stage_kwargs(batch)
        depth = pipeline.spec.mtp_depth if pipeline.spec is not None else 0
        if depth:  # the tokens and labels ahead travel to the last stage (made before context parallelism's cut)
            kwargs |= {k: batch[k] for k in MTP_KEYS if k in batch} or mtp_targets(tokens, labels, depth)
        if train:
            with tracking_sends(self._sends):
                schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        else:
            schedule.eval(*args, target=target, losses=losses, **kwargs)
        loss = torch.zeros((), device=tokens.device)
        if holds_last:
            loss = torch.stack([_value(x) for x in losses]).sum()
        # Every rank reports the loss (Lightning logs and callbacks run everywhere).
        dist.broadcast(loss, group=pipeline.group, group_src=pipeline.stage_ranks[-1])
        if train and pipeline.spec is not None and pipeline.spec.moe_blocks:
            loss = loss + self._aux_total(loss)
        return loss * accumulate

    def _aux_total(self, like: torch.Tensor) -> torch.Tensor:
        """The weighted auxiliary losses of every stage (MoE balancing), summed over the pipeline's ranks."""
        total = torch.zeros_like(like)
        for stage in self.pipeline.stages:
            if stage.aux_total is not None:
                total += stage.aux_total.to(total.dtype)
            stage.aux_total = None
        dist.all_reduce(total, group=self.pipeline.group)
        return total

    def _torch_schedule(self) -> Any:
        """Built at the first step, once the stages' parameters have storage."""
        if self._schedule is None:
            self._schedule = self._build_schedule()
        return self._schedule

    def _build_schedule(self) -> Any:
        """A schedule over the pipeline's stage modules (stages of its own: their buffers fit its first batch)."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        pipeline = self.pipeline
        stage_class = _stage_class()
        # A stage running multi-token prediction computes its weight gradients with its input gradients (torch's
        # split of a backward into the two fails on the MTP chain of depth >= 2): its W is a no-op.
        stages = [
            stage_class(m, m.index, pipeline.n_stages, first_param_device(m), group=pipeline.group,
                        dw_builder=_nothing_left if m.mtp_names and pipeline.splits_backward else None)
            for m in pipeline.stages
        ]  # fmt: skip
        for stage in stages:
            stage.init_freeing(self._sends)
        for module in pipeline.stages:
            module.aux_loss_scale = lambda: self._token_scale
        schedule_class = get_schedule_class(pipeline.info.torch_class)
        # Our loss is already weighted by token counts: torch must not divide by microbatches.
        return schedule_class(
            stages if pipeline.info.multi else stages[0],
            n_microbatches=pipeline.microbatches,
            loss_fn=self._microbatch_loss,
            scale_grads=False,
        )

    def _microbatch_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._scorer is not None:  # an evaluation forward (:meth:`score`): labels and positions stacked
            assert self._scores is not None
            self._scores.append(self._scorer(logits, labels[..., 0], labels[..., 1]).to(torch.float64))
            return torch.zeros((), device=labels.device)
        assert self._loss_fn is not None
        loss = self._loss_fn(logits, labels)
        return loss * ((labels != IGNORE_INDEX).sum() * self._token_scale)


def _stage_class() -> type:
    """torch's ``PipelineStage``, whose metadata inference leaves our stage's statistics untouched.

    torch 2.13 infers shapes by running each stage once on uninitialised tensors (with grad), and
    the loss once on the last stage's garbage output (torch 2.11 runs each stage on zeros): MoE
    token counts, auxiliary losses and the module's loss sums from that run would be garbage, so the stage runs
    :meth:`StageModule.untracked` and the loss is a stand-in with the same graph.

    torch 2.13's V-shaped schedules (ZBV, DualPipeV) hand input gradients between a rank's two
    stages even in ``eval``, where the backward itself is skipped and the hand-over asserts: every
    validation crashed. Without a backward the hand-over is skipped too.

    Each microbatch's buffers are freed as soon as it is done with them (:class:`FreeingStage`).
    """
    from torch.distributed.pipelining import PipelineStage

    class Stage(FreeingStage, PipelineStage):
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            with self.submod.untracked():
                return super()._forward_metadata_inference(*args, **kwargs)

        def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:  # torch 2.11's name: a forward on zeros
            with self.submod.untracked():
                return super()._shape_inference(*args, **kwargs)

        def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("loss_fn") is not None:
                kwargs["loss_fn"] = _shape_only_loss
            return super()._backward_metadata_inference(*args, **kwargs)

        def get_local_bwd_output(self, mb_index: int) -> Any:
            return super().get_local_bwd_output(mb_index) if self.has_backward else ()

        def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
            if self.has_backward:
                super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    return Stage


def _stage_kwargs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What every stage gets of its microbatch beside the hidden state (split with the tokens):
    the positions (RoPE needs them, and a hidden state under sequence parallelism is a sequence
    shard that cannot tell them) and the document ids, where the batch has them."""
    tokens, position_ids = batch["input_ids"], batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    kwargs = {"position_ids": position_ids, "document_ids": batch.get("document_ids")}
    return {k: v for k, v in kwargs.items() if v is not None}


def _nothing_left() -> Callable[[], None]:
    """A W action with nothing to do (the stage's I ran the whole backward)."""
    return lambda: None


def _shape_only_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.float().sum() * 0.0


def _loss_fn_of(module: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if not declares(module, PipelineLoss):
        raise TypeError(
            f"{type(module).__name__} has no loss_fn(logits, labels): with pipeline parallelism the loss is "
            "computed on the last stage, per microbatch, by that method"
        )
    return module.loss_fn


def _value(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()
