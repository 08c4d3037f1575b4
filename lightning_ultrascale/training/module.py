"""The LightningModule that pretrains a Llama: loss, logging, optimizer and LR schedule.

It holds no distributed code: parallelism is entirely the strategy's business. The model is built
in ``configure_model`` under the strategy's init context (the meta device for
``UltraScaleStrategy``, which then materialises and initialises it; a real device otherwise, in
which case the module initialises it itself), so the same module trains on one CPU or on a 5D
mesh.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.kernels import check_kernels, get_kernels, reference
from lightning_ultrascale.models import LlamaConfig, get_model_config
from lightning_ultrascale.models.common.decoder import MTP_KEYS, Llama
from lightning_ultrascale.models.common.moe import ExpertStats
from lightning_ultrascale.models.spec import ModelSpec
from lightning_ultrascale.parallel.muon import Muon, muon_param_groups
from lightning_ultrascale.utils.loss import IGNORE_INDEX

OPTIMIZERS = ("adamw", "muon", "sgd")


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and LR schedule: linear warm-up, then cosine decay to ``min_lr_ratio x lr``.

    ``muon`` (:class:`~lightning_ultrascale.parallel.muon.Muon`): the blocks' matrices by Muon with
    ``momentum`` (Nesterov unless ``nesterov=False``) and ``ns_steps`` Newton-Schulz iterations,
    the rest by AdamW (``betas``, ``eps``) at ``adamw_lr`` (default: ``lr``, as Moonlight).
    """

    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    nesterov: bool = True
    ns_steps: int = 5
    adamw_lr: float | None = None

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optim.name={self.name!r} is unknown; valid: {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ConfigError(f"optim.lr={self.lr} must be > 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.name == "muon" and not 0 <= self.momentum < 1:
            raise ConfigError(f"optim.momentum={self.momentum}: Muon's momentum must be in [0, 1); Moonlight uses 0.95")
        if self.name == "muon" and self.ns_steps < 1:
            raise ConfigError(f"optim.ns_steps={self.ns_steps} must be >= 1; the published iteration uses 5")
        if self.adamw_lr is not None and not self.adamw_lr > 0:
            raise ConfigError(f"optim.adamw_lr={self.adamw_lr} must be > 0, or null (Muon's lr)")


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Warm-up then cosine decay, as a multiple of the peak LR."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _hf_directory(init_from: str | None, config: LlamaConfig) -> str | None:
    """``"hf:DIR"`` -> ``DIR``, checked before any process group: an HF directory of ``config``'s architecture."""
    if init_from is None:
        return None
    if not init_from.startswith("hf:"):
        raise ConfigError(f"model.init_from={init_from!r}; valid: hf:<directory of an HF model>, or null")
    from lightning_ultrascale.models.hf.convert import hf_directory_config

    wrong = hf_directory_config(init_from[3:]).architecture_differences(config)
    if wrong:
        raise ConfigError(
            f"model.init_from={init_from} is another architecture than model={config.name}: {', '.join(wrong)}. "
            f"To train the directory's own architecture: model=hf model.path={init_from[3:]}"
        )
    if not any(Path(init_from[3:]).glob("*.safetensors")):  # (a pickled pytorch_model.bin is code: never read)
        raise ConfigError(
            f"model.init_from={init_from} holds no *.safetensors files; valid: a directory save_pretrained wrote "
            "(weights as safetensors)"
        )
    return init_from[3:]


class LlamaModule(L.LightningModule):
    """Causal-LM pretraining of a Llama: next-token cross-entropy, mean over the batch's tokens.

    Args:
        model: a named config (``"llama_tiny"``, ``"llama3_8b"``, ...) or a ``LlamaConfig``.
        optim: optimizer and schedule settings.
        seed: weight-initialisation seed when the module builds the model itself (without
            ``UltraScaleStrategy``, whose ``seed`` argument rules otherwise).
        init_from: ``"hf:DIR"`` starts from the weights of an HF model directory (safetensors and
            ``config.json``, e.g. what ``ultrascale-export`` writes), read through DCP by every
            rank of any layout; the architecture must be ``model``'s.
        kernels: the kernel set of RMSNorm, SwiGLU, RoPE and the loss: ``"reference"`` (pure torch),
            ``"compile"``, ``"triton"`` or ``"liger"`` (see :mod:`lightning_ultrascale.kernels`).
        fused_cross_entropy: chunk the head and the loss so the ``[tokens, vocab]`` logits never
            exist (default: with every kernel set but ``"reference"``).

    Example:
        >>> import lightning as L
        >>> from lightning_ultrascale import LlamaModule, UltraScaleDataModule, UltraScaleStrategy
        >>> trainer = L.Trainer(strategy=UltraScaleStrategy(), accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> data = UltraScaleDataModule(seq_len=256, micro_batch_size=8)
        >>> trainer.fit(LlamaModule("llama_tiny"), datamodule=data)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str | LlamaConfig = "llama_tiny",
        optim: OptimConfig | None = None,
        seed: int = 0,
        init_from: str | None = None,
        kernels: str = "reference",
        fused_cross_entropy: bool | None = None,
    ) -> None:
        super().__init__()
        self.config = get_model_config(model) if isinstance(model, str) else model
        self.kernels = get_kernels(kernels, fused_cross_entropy)
        # The device is checked again by each fast op; this catches a GPU kernel set on a CPU machine now.
        check_kernels(kernels, "cuda" if torch.cuda.is_available() else "cpu")
        self._warned_unfused = False
        self.optim = optim or OptimConfig()
        self.seed = seed
        self.init_from = _hf_directory(init_from, self.config)
        self.model: Llama | None = None
        #: What the MoE blocks counted over the last optimizer step's global batch (MoE models):
        #: tokens per expert ``[MoE blocks, experts]``, tokens dropped, auxiliary losses' sum.
        self.expert_stats: ExpertStats | None = None
        #: ``[cross-entropy sum, labelled tokens]`` of the micro-batches since the last look, by split.
        self._loss_sums: dict[str, torch.Tensor] = {}
        self._step_metrics: dict[str, torch.Tensor] = {}
        self._agreed_sums: torch.Tensor | None = None
        self._agreed_maxima: torch.Tensor | None = None
        self.save_hyperparameters(
            {
                "model": self.config.name,
                "model_config": asdict(self.config),
                "optim": vars(self.optim),
                "seed": seed,
                "kernels": kernels,
                "fused_cross_entropy": self.kernels.linear_cross_entropy is not None,
            }
        )

    @property
    def model_spec(self) -> ModelSpec:
        """The model's spec, available before the model is built (the strategy validates with it)."""
        with torch.device("meta"):
            return Llama(self.config).spec

    @property
    def model_name(self) -> str:
        """The model's name, for messages."""
        return self.config.name

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the model takes."""
        return self.config.max_seq_len

    def configure_model(self) -> None:
        if self.model is not None:
            return
        pretrained = None
        if self.init_from is not None:  # an HF directory (checked in __init__): loaded in init_weights, by shards
            from lightning_ultrascale.models.hf.convert import load_hf_weights

            pretrained = functools.partial(load_hf_weights, path=self.init_from)
        self.model = Llama(self.config, pretrained=pretrained, kernels=self.kernels)
        if not any(p.is_meta for p in self.model.parameters()):
            self.model.init_weights(self.seed)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert self.model is not None, "configure_model() builds the model"
        return self.model(input_ids, position_ids, document_ids=document_ids)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), for TFLOP/s and MFU."""
        return self.config.flops_per_token(seq_len)

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over the tokens whose label is not -100, in fp32.

        Pipeline parallelism calls it on the last stage for every microbatch.
        """
        # fp32 loss whatever the compute precision: the softmax over a 128k vocab loses too much in bf16.
        if self.kernels.linear_cross_entropy is not None and not self._warned_unfused:
            rank_zero_warn(
                f"kernels={self.kernels.name}: the fused linear cross-entropy does not run under pipeline "
                "parallelism (the last stage hands its logits to loss_fn); the other kernels do"
            )
            self._warned_unfused = True
        loss = reference.cross_entropy(logits, labels)
        mtp = self.model.pop_mtp_sums() if self._mtp_depth and self.model is not None else None
        self._count_loss(loss, labels, mtp)
        if mtp is None:
            return loss
        # Vocab-sharded logits (tensor parallel) give a replicated DTensor; the MTP sums are plain: add values.
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss) + self._mtp_term(mtp, labels)

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        assert self.model is not None, "configure_model() builds the model"
        # ``document_ids`` (data.documents=mask): attention stays inside each packed document.
        ahead = {k: batch[k] for k in MTP_KEYS if k in batch} or None  # (made before context parallelism's cut)
        loss = self.model(batch["input_ids"], batch.get("position_ids"), labels=labels,
                          document_ids=batch.get("document_ids"), mtp=ahead)  # fmt: skip
        # Vocab-sharded logits (tensor parallel) give a replicated DTensor: hand Lightning its value.
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        mtp = self.model.pop_mtp_sums()
        self._count_loss(loss, labels, mtp)
        if mtp is not None:
            loss = loss + self._mtp_term(mtp, labels)
        aux = self.model.pop_aux_loss()
        if aux is not None:
            # MoE balancing losses are sums over tokens: weighted per token like the cross-entropy.
            loss = loss + aux / (labels != IGNORE_INDEX).sum().clamp(min=1)
        return loss

    def _mtp_term(self, mtp: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Multi-token prediction's share of the loss: DeepSeek-V3's weight / depth times each depth's cross-entropy,
        a sum over the main loss's tokens like it (so every layout, and a pipeline's microbatches, weigh it as one
        process does); logged per predicted token (``train/mtp_loss``)."""
        n = (labels != IGNORE_INDEX).sum().clamp(min=1)
        return self.config.mtp_loss_weight / self.config.mtp_depth * mtp[0] / n

    @torch.no_grad()
    def _count_loss(self, loss: torch.Tensor, labels: torch.Tensor, mtp: torch.Tensor | None = None) -> None:
        """Add a micro-batch's cross-entropy (a mean over its labelled tokens) to its split's sums, and with
        multi-token prediction its ``[cross-entropy sum, tokens]`` (``Llama.pop_mtp_sums``)."""
        n = (labels != IGNORE_INDEX).sum()
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        # A rank whose part holds no labelled token has a NaN mean: it adds nothing.
        sums = torch.stack((torch.where(n > 0, value.float() * n, 0.0), n.float()))
        if self._mtp_depth:
            sums = torch.cat((sums, torch.zeros(2, device=sums.device) if mtp is None else mtp.detach().float()))
        split = "train" if self.training else "val"
        self._loss_sums[split] = self._loss_sums[split] + sums if split in self._loss_sums else sums

    def _local_sums(self, split: str, more: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's ``[cross-entropy sum, labelled tokens, *more]`` of ``split`` since the last call."""
        local = self._loss_sums.pop(split, None)
        local = torch.zeros(self._n_loss_sums, device=self.device) if local is None else local
        return local if more is None else torch.cat((local, more.to(local.device)))

    def _global_sums(self, split: str, more: torch.Tensor | None = None) -> torch.Tensor:
        """``[cross-entropy sum, labelled tokens, *more]`` over the global batch (every rank calls it).

        ``UltraScaleStrategy`` sums over the ranks that hold different tokens (pipeline stages
        included: those without the head add zeros); tensor-parallel peers repeat them.
        """
        return self._sum_over_batch(self._local_sums(split, more))

    def _sum_over_batch(self, local: torch.Tensor) -> torch.Tensor:
        strategy = self.trainer.strategy
        reduce = getattr(strategy, "sum_over_batch", None) or (lambda t: strategy.reduce(t, reduce_op="sum"))
        return reduce(local)

    @torch.no_grad()
    def step_sums(self) -> torch.Tensor:
        """This rank's training sums of the step, taken once: ``[cross-entropy sum, labelled tokens]``, then
        for an MoE model its tokens per expert, dropped tokens and aux loss (``models.spec.StepSums``:
        ``UltraScaleStrategy`` sums them in the step's one control collective)."""
        stats = self.model.expert_stats() if self.model is not None and self.config.moe is not None else None
        more = None if stats is None else torch.cat((stats.loads.flatten(), stats.dropped[None], stats.aux[None]))
        return self._local_sums("train", more)

    @property
    def split_step_sums(self) -> int:
        """How many of the last :meth:`step_sums` tensor-parallel peers hold parts of (summed over them too): the
        MoE statistics where the MoE layers run each tp rank's share of the tokens (MoE parallel folding).

        The same on every rank, a pipeline stage without MoE blocks too: read from the layout, not the blocks held.
        """
        dims = getattr(self._trainer.strategy, "parallel_dims", None) if self._trainer is not None else None
        spec = getattr(self.model, "spec", None)
        folded = dims is not None and dims.tp > 1 and self.config.moe is not None and bool(spec and spec.moe_folds_tp)
        return len(self.config.moe_blocks()) * self.config.n_experts + 2 if folded else 0

    def agree_step_sums(self, sums: torch.Tensor) -> None:
        """The step's :meth:`step_sums` over the global batch (each token counted once), from the strategy."""
        self._agreed_sums = sums

    @torch.no_grad()
    def step_maxima(self) -> torch.Tensor:
        """This rank's ``max - min`` of each MoE block's selection bias, as the step routed with it (0 for a
        block another pipeline stage holds; none for a dense model): ``models.spec.StepMaxima``."""
        if self.model is None or self.config.moe is None:
            return torch.zeros(0, device=self.device)
        return self.model.expert_bias_ranges()

    def agree_step_maxima(self, maxima: torch.Tensor) -> None:
        """The step's :meth:`step_maxima` over the pipeline stages, from the strategy's agreement."""
        self._agreed_maxima = maxima

    def _train_sums(self) -> torch.Tensor:
        """The step's training sums over the global batch: as the strategy's agreement handed them, else
        reduced here (another strategy)."""
        sums, self._agreed_sums = self._agreed_sums, None
        return sums if sums is not None else self._sum_over_batch(self.step_sums())

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)  # every micro-batch of the step has run by now
        self._step_metrics = self._step_end()

    @torch.no_grad()
    def _step_end(self) -> dict[str, torch.Tensor]:
        """After an optimizer step: the step's loss over its global batch; MoE balancing and its metrics.

        ``train/loss`` is the cross-entropy of every labelled token of the global batch (all
        micro-batches, microbatches and data-parallel ranks), whatever the layout; the MoE balancing
        losses it trains with are ``train/aux_loss``, per token too.
        """
        assert self.model is not None
        sums = self._train_sums()
        tokens = sums[1].clamp(min=1)
        metrics = {"train/loss": sums[0] / tokens}
        if self._mtp_depth:
            metrics["train/mtp_loss"] = sums[2] / sums[3].clamp(min=1)
        if self.config.moe is not None:
            loads = sums[self._n_loss_sums : -2].view(len(self.config.moe_blocks()), -1)
            self.expert_stats = ExpertStats(loads, sums[-2], sums[-1])
            metrics |= self._balance_experts(loads, sums[-2])
            metrics["train/aux_loss"] = sums[-1] / tokens
        return metrics

    def _balance_experts(self, loads: torch.Tensor, dropped: torch.Tensor) -> dict[str, torch.Tensor]:
        """The aux-loss-free bias update from the step's global tokens per expert, and the balance metrics.

        The bias ranges are those the step routed with (before this update): under
        ``UltraScaleStrategy`` every pipeline stage's, from the step's one agreement; another strategy
        holds every block (no pipeline), so its own ranges are every block's.
        """
        assert self.model is not None and self.config.moe is not None
        ranges, self._agreed_maxima = self._agreed_maxima, None
        ranges = self.model.expert_bias_ranges() if ranges is None else ranges
        if self.config.moe.bias_update_rate > 0:
            self.model.update_expert_bias(loads)
        self.model.observe_expert_loads(loads)  # (expert placement: ExpertParallel(rebalance_every=N))
        imbalance = loads.max(-1).values / loads.mean(-1).clamp(min=1e-9)
        metrics = {"moe/max_over_mean": imbalance.max(), "moe/drop_rate": dropped / loads.sum().clamp(min=1)}
        metrics |= {f"moe/layer{b}/max_over_mean": v for b, v in zip(self.config.moe_blocks(), imbalance)}
        metrics["moe/bias_range"] = ranges.max()
        metrics |= {f"moe/layer{b}/bias_range": v for b, v in zip(self.config.moe_blocks(), ranges)}
        return metrics

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Logged here (Lightning does not log from optimizer_step); the values are global already,
        # the same on every rank, so every rank logs them (callbacks may monitor them anywhere).
        if self._step_metrics:
            metrics, self._step_metrics = self._step_metrics, {}
            self.log("train/loss", metrics.pop("train/loss"), prog_bar=True)
            self.log_dict(metrics)
            if "moe/max_over_mean" in metrics:
                self.log("imb", metrics["moe/max_over_mean"], prog_bar=True, logger=False)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def on_validation_epoch_end(self) -> None:
        # The cross-entropy of every labelled validation token, not a mean of per-batch means.
        sums = self._global_sums("val")
        self.log("val/loss", sums[0] / sums[1].clamp(min=1), prog_bar=True)
        if self._mtp_depth:
            self.log("val/mtp_loss", sums[2] / sums[3].clamp(min=1))

    @property
    def _n_loss_sums(self) -> int:
        """The loss sums of a split: ``[cross-entropy sum, tokens]``, then MTP's (with ``mtp_depth``)."""
        return 4 if self._mtp_depth else 2

    @property
    def _mtp_depth(self) -> int:
        """The model's multi-token-prediction depth (0 for a module without our config: ``HFCausalLMModule``)."""
        return int(getattr(getattr(self, "config", None), "mtp_depth", 0) or 0)

    def configure_optimizers(self) -> Any:
        o = self.optim
        if o.name == "muon":
            groups = muon_param_groups(self.model, o.weight_decay, o.adamw_lr)
            muon = Muon(
                groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, ns_steps=o.ns_steps, betas=o.betas, eps=o.eps
            )
            return self._with_schedule(muon)
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        # Norm gains are not decayed (standard for Llama pretraining).
        groups = [
            {"params": decay, "weight_decay": o.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if o.name == "adamw":
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
        else:
            optimizer = torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
        return self._with_schedule(optimizer)

    def _with_schedule(self, optimizer: torch.optim.Optimizer) -> Any:
        o = self.optim
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else 10**9
        schedule = LambdaLR(optimizer, lambda step: lr_multiplier(step, o.warmup_steps, total, o.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
