"""A user's own model, in the shape of Lightning's ``examples/pytorch/tensor_parallel`` Llama (written
here): a plain ``nn.Module`` with its own blocks, head counts kept as attributes, its own RoPE.

The lines marked ``# contract`` are all it needs of lightning_ultrascale (docs/models.md, "Your own model"
counts them): a ``spec``, a name-seeded ``init_weights``, ``forward_stage`` for pipelines, the
``attention_fn`` attribute for context parallelism, ``position_ids`` taken and used, the TP plan
(the example's own ``parallelize`` plan, moved into the spec) and ``loss_fn`` on the module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from lightning_ultrascale.models.shard_init import init_by_name
from lightning_ultrascale.models.spec import ModelSpec

CONFIG = {"vocab_size": 320, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.attention_fn = causal_attention  # contract: context parallelism swaps it

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out = self.attention_fn(rotate(q, cos, sin), rotate(k, cos, sin), v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: dict[str, int]) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(cfg["dim"]), nn.RMSNorm(cfg["dim"])
        self.attention = Attention(cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"])
        self.feed_forward = FeedForward(cfg["dim"], cfg["ffn_dim"])

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


def tp_plan(sequence_parallel: bool) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Lightning's example plan (its ``parallelize``), keyed for the spec."""
    residual = Shard(1) if sequence_parallel else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    } | ({"norm": SequenceParallel()} if sequence_parallel else {})
    block = {
        "attention": PrepareModuleInput(input_layouts=(residual, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }  # fmt: skip
    if sequence_parallel:
        block |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    return top, {str(i): block for i in range(CONFIG["n_layers"])}


class Transformer(nn.Module):
    def __init__(self, cfg: dict[str, int], read_positions: bool = True, tied: bool = False) -> None:
        super().__init__()
        self.cfg, self.read_positions = cfg, read_positions
        self.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["dim"])
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg["n_layers"])})  # contract: a ModuleDict
        self.norm = nn.RMSNorm(cfg["dim"])
        self.output = nn.Linear(cfg["dim"], cfg["vocab_size"], bias=False)
        if tied:  # nanoGPT's way: one Parameter held by both modules, nothing else
            self.output.weight = self.tok_embeddings.weight
        self.spec = ModelSpec("own", cfg["n_layers"], cfg["n_heads"], cfg["n_kv_heads"], cfg["dim"],  # contract
                              cfg["vocab_size"], tp_plan=tp_plan, ffn_dim=cfg["ffn_dim"])  # fmt: skip

    def init_weights(self, seed: int) -> None:  # contract: from (seed, name) alone
        init_by_name(self, seed, lambda name: None if "norm" in name else 0.02)

    def rope(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        half = self.cfg["dim"] // self.cfg["n_heads"] // 2
        inv_freq = 1.0 / (10000.0 ** (torch.arange(half, device=position_ids.device).float() / half))
        angles = position_ids[..., None].float() * inv_freq
        return angles.cos()[:, None], angles.sin()[:, None]

    def forward(self, tokens: Tensor, position_ids: Tensor | None = None) -> Tensor:  # contract: position_ids
        return self.forward_stage(tokens, position_ids, list(self.layers), embed=True, head=True)

    def forward_stage(  # contract: pipelines run a part of the model
        self, x: Tensor, position_ids: Tensor | None, blocks: Sequence[str], *, embed: bool, head: bool
    ) -> Tensor:
        if position_ids is None or not self.read_positions:
            position_ids = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = self.rope(position_ids)
        h = self.tok_embeddings(x) if embed else x
        for name in blocks:
            h = self.layers[name](h, cos, sin)
        return self.output(self.norm(h)) if head else h


class ListTransformer(Transformer):
    """The same model holding its blocks in an ``nn.ModuleList``, indexed by number (as HF models do)."""

    def __init__(self, cfg: dict[str, int], read_positions: bool = True, tied: bool = False) -> None:
        super().__init__(cfg, read_positions, tied)
        self.layers = nn.ModuleList(list(self.layers.values()))  # type: ignore[assignment]

    def forward(self, tokens: Tensor, position_ids: Tensor | None = None) -> Tensor:
        names = [str(i) for i in range(self.cfg["n_layers"])]
        return self.forward_stage(tokens, position_ids, names, embed=True, head=True)

    def forward_stage(
        self, x: Tensor, position_ids: Tensor | None, blocks: Sequence[str], *, embed: bool, head: bool
    ) -> Tensor:
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = self.rope(position_ids)
        h = self.tok_embeddings(x) if embed else x
        for name in blocks:
            h = self.layers[int(name)](h, cos, sin)
        return self.output(self.norm(h)) if head else h


class OwnModule(L.LightningModule):
    def __init__(
        self, read_positions: bool = True, lr: float = 0.1, blocks_in_a_list: bool = False, tied: bool = False
    ) -> None:
        super().__init__()
        self.read_positions, self.lr, self.model, self.tied = read_positions, lr, None, tied
        self.model_class = ListTransformer if blocks_in_a_list else Transformer

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.model_class(CONFIG, self.read_positions, self.tied)
            if not any(p.is_meta for p in self.model.parameters()):  # (the strategy builds on meta, then inits)
                self.model.init_weights(0)

    def loss_fn(self, logits: Tensor, labels: Tensor) -> Tensor:  # contract: the pipeline's last stage calls it
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss_fn(self.model(batch["input_ids"], batch.get("position_ids")), batch["labels"])
        self.log("train_loss", loss, sync_dist=True)  # (a DTensor under loss parallelism)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)
