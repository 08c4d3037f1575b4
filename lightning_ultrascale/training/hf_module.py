"""The LightningModule that pretrains or fine-tunes a Hugging Face causal LM as it is (``model=hf``).

:class:`HFCausalLMModule` is :class:`~lightning_ultrascale.training.module.LlamaModule` (loss, metrics,
optimizer, LR schedule) around a ``transformers`` model of a supported family built from an HF
directory's ``config.json``: on the strategy's meta device, adapted in place
(:mod:`~lightning_ultrascale.models.hf.adapter`), then initialised per parameter name or, with
``pretrained``, loaded from the directory's safetensors by each rank's shards
(:mod:`~lightning_ultrascale.models.hf.weights`). Any size, any supported architecture: the
directory decides, not a preset.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.kernels import get_kernels, reference
from lightning_ultrascale.models.spec import ModelSpec
from lightning_ultrascale.training.module import LlamaModule, OptimConfig

__all__ = ["HFCausalLMModule", "hf_directory", "hf_meta_model"]


def hf_directory(path: str | Path, option: str = "model.path") -> Any:
    """The ``transformers`` config of an HF model directory, checked (a supported family) before any process group."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{option}={path}: {config_file} not found; valid: a directory HF's save_pretrained wrote")
    from transformers import AutoConfig

    from lightning_ultrascale.models.hf.adapter import FAMILIES, check_supported

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError) as err:  # a model_type this transformers does not know, or none
        try:
            kind = json.loads(config_file.read_text()).get("model_type")
        except (ValueError, AttributeError):
            raise ConfigError(f"{option}={path}: {config_file} is not a JSON object: {err}") from None
        raise ConfigError(
            f"{option}={path} holds model_type={kind!r}, which transformers does not know; valid: a directory of "
            f"one of the families trained as they are ({', '.join(FAMILIES)})"
        ) from None
    check_supported(config)
    return config


def hf_meta_model(config: Any) -> Any:
    """The HF causal LM of ``config`` on the meta device, adapted (its spec: what the strategy and the planner read)."""
    from transformers import AutoModelForCausalLM

    from lightning_ultrascale.models.hf.adapter import adapt

    with torch.device("meta"):
        return adapt(AutoModelForCausalLM.from_config(config))


class HFCausalLMModule(LlamaModule):
    """Causal-LM training of the Hugging Face model whose directory is ``path``, as transformers defines it.

    Args:
        path: an HF model directory (``config.json``, and safetensors if ``pretrained``).
        optim: optimizer and schedule settings.
        seed: weight-initialisation seed when not ``pretrained`` (``UltraScaleStrategy``'s rules under it).
        pretrained: start from the directory's weights (each rank reads its shards); else from
            HF's initial distributions, drawn per parameter name.

    Example:
        >>> import lightning as L
        >>> from lightning_ultrascale import HFCausalLMModule, UltraScaleDataModule, UltraScaleStrategy, ZeRO
        >>> module = HFCausalLMModule("/models/Qwen2.5-0.5B")  # doctest: +SKIP
        >>> trainer = L.Trainer(strategy=UltraScaleStrategy(ZeRO(3)), devices=8)  # doctest: +SKIP
        >>> trainer.fit(module, datamodule=UltraScaleDataModule(tokenizer="/models/Qwen2.5-0.5B"))  # doctest: +SKIP
    """

    def __init__(
        self, path: str | Path, optim: OptimConfig | None = None, seed: int = 0, pretrained: bool = True
    ) -> None:
        L.LightningModule.__init__(self)
        self.path, self.pretrained = str(path), pretrained
        self.hf_config = hf_directory(path)
        self.kernels = get_kernels("reference", None)
        self._warned_unfused = False
        self.optim = optim or OptimConfig()
        self.seed = seed
        self.model: Any = None
        self.expert_stats = None
        self._loss_sums: dict[str, torch.Tensor] = {}
        self._step_metrics: dict[str, torch.Tensor] = {}
        self._agreed_sums: torch.Tensor | None = None
        self.save_hyperparameters(
            {"model": f"hf:{self.path}", "hf_config": self.hf_config.to_dict(), "optim": vars(self.optim), "seed": seed}
        )

    @property
    def model_name(self) -> str:
        return f"{self.hf_config.model_type}:{Path(self.path).name}"

    @property
    def max_seq_len(self) -> int:
        return int(self.hf_config.max_position_embeddings)

    @functools.cached_property
    def _meta_model(self) -> Any:
        return hf_meta_model(self.hf_config)

    @property
    def model_spec(self) -> ModelSpec:
        """The model's spec, before the model is built (the strategy validates the layout with it)."""
        return self._meta_model.spec

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        from lightning_ultrascale.models.hf.adapter import adapt
        from lightning_ultrascale.models.hf.weights import load_hf_directory

        self.model = adapt(AutoModelForCausalLM.from_config(self.hf_config))
        if self.pretrained:  # read in init_weights, by each rank's shards, after the plugins
            self.model.pretrained = functools.partial(load_hf_directory, path=self.path)
        if not any(p.is_meta for p in self.model.parameters()):
            self.model.init_weights(self.seed)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert self.model is not None, "configure_model() builds the model"
        # (document_ids: the adapted model refuses them by name; HF's attention would ignore them)
        return self.model(input_ids=input_ids, position_ids=position_ids, document_ids=document_ids).logits

    def flops_per_token(self, seq_len: int) -> float:
        return float(self._meta_model.flops_per_token(seq_len))

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        logits = self(batch["input_ids"], batch.get("position_ids"), batch.get("document_ids"))
        loss = reference.cross_entropy(logits, labels)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        self._count_loss(loss, labels)
        return loss

    @torch.no_grad()
    def step_sums(self) -> torch.Tensor:
        return self._local_sums("train")

    def step_maxima(self) -> torch.Tensor:
        return torch.zeros(0, device=self.device)  # (no selection bias in transformers' routers)

    @torch.no_grad()
    def _step_end(self) -> dict[str, torch.Tensor]:
        sums = self._train_sums()
        return {"train/loss": sums[0] / sums[1].clamp(min=1)}
