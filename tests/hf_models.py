"""Tiny random Hugging Face causal LMs in a LightningModule written as an HF user writes one: the model
built by ``AutoModelForCausalLM.from_config`` in ``configure_model``, no spec, no plan, no hook."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_ultrascale.models.hf.adapter import adapt

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=None)  # fmt: skip
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": True},  # q/k/v biases, tied head
    "qwen3": {"head_dim": 16},  # per-head q/k norms, head_dim != hidden / heads
    "mistral": {"sliding_window": None},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 8,
                  "norm_topk_prob": True},
}  # fmt: skip


def hf_config(family: str, **overrides: Any) -> Any:
    return AutoConfig.for_model(family, **(COMMON | FAMILIES[family] | overrides))


class HFModule(L.LightningModule):
    def __init__(
        self,
        family: str = "llama",
        lr: float = 0.1,
        directory: str | None = None,
        loss: str = "logits",
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.family, self.overrides, self.lr, self.model = family, overrides, lr, None
        #: "logits": cross-entropy of the logits; "hf": transformers' own loss (labels= the tokens,
        #: shift_labels= the batch's labels, shifted already); "hf_labels": labels= alone (HF shifts them).
        self.loss = loss
        if directory is not None:  # loaded whole on every rank, before the strategy's meta device
            self.model = AutoModelForCausalLM.from_pretrained(directory)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = AutoModelForCausalLM.from_config(hf_config(self.family, **self.overrides))
            if not any(p.is_meta for p in self.model.parameters()):  # one process: the same weights as any layout
                adapt(self.model).init_weights(0)

    def loss_fn(self, logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        tokens, positions = batch["input_ids"], batch.get("position_ids")
        if self.loss == "hf":
            return self.model(
                input_ids=tokens, position_ids=positions, labels=tokens, shift_labels=batch["labels"]
            ).loss
        if self.loss == "hf_labels":
            return self.model(input_ids=tokens, position_ids=positions, labels=tokens).loss
        out = self.model(input_ids=tokens, position_ids=positions)
        return self.loss_fn(out.logits, batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)
