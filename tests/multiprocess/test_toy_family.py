"""A model family added as docs/_pending/adding_a_model_family.md says: a configuration and a module
whose ``spec`` declares its widths. The planner prices it from that spec alone (what it reads is
the spec: change the spec, not the module, and the prediction moves), and it trains under a
parallel layout like one process."""

import dataclasses
import math
from dataclasses import dataclass

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from own_model import CONFIG, Transformer
from torch import Tensor, nn

from lightning_ultrascale import UltraScaleDataModule, UltraScaleStrategy, ZeRO
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model
from lightning_ultrascale.models.common.layers import FeedForward, RMSNorm, causal_attention
from lightning_ultrascale.models.shard_init import init_by_name
from lightning_ultrascale.models.spec import ModelSpec
from lightning_ultrascale.plan import GPUS, Candidate, Workload, estimate, search
from lightning_ultrascale.testing.parity import assert_parity, record_run


# ----------------------------------------------------------------------------- the toy family
@dataclass(frozen=True)
class ToyConfig:
    """The family's configuration; its presets would sit beside it in its folder."""

    name: str = "toy"
    vocab_size: int = 320
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    head_dim: int = 24  # wider than dim // n_heads (as Qwen3's): the planner must read it from the spec
    ffn_dim: int = 96


class ToyAttention(nn.Module):
    """Multi-head attention without positions (no RoPE: the layouts below need none)."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.head_dim, width = cfg.head_dim, cfg.n_heads * cfg.head_dim
        self.wq, self.wk, self.wv = (nn.Linear(cfg.dim, width, bias=False) for _ in range(3))
        self.wo = nn.Linear(width, cfg.dim, bias=False)
        self.attention_fn = causal_attention

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(self.attention_fn(q, k, v).transpose(1, 2).reshape(b, s, -1))


class ToyBlock(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(cfg.dim, 1e-5), RMSNorm(cfg.dim, 1e-5)
        self.attention = ToyAttention(cfg)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Toy(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): ToyBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, 1e-5)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.spec = ModelSpec(
            cfg.name, cfg.n_layers, cfg.n_heads, cfg.n_heads, cfg.dim, cfg.vocab_size,
            ffn_dim=cfg.ffn_dim, head_dim=cfg.head_dim,
        )  # fmt: skip

    def init_weights(self, seed: int) -> None:
        init_by_name(self, seed, lambda name: None if "norm" in name else 0.02)

    def forward(self, tokens: Tensor, position_ids: Tensor | None = None) -> Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))


def meta_toy(**changes: int) -> Toy:
    with torch.device("meta"):
        return Toy(ToyConfig(**changes))


# ----------------------------------------------------------------------------- priced from its spec
def _workload(model: nn.Module) -> Workload:
    return Workload(model, seq_len=256, global_batch_size=8, precision="32-true")


def test_the_planner_searches_a_toy_family_from_its_spec():
    model = meta_toy()
    result = search(_workload(model), world_size=4, gpu="h100", space={"micro_batch_size": [1]})
    best = result.best.busiest
    assert result.best.fits and best.peak > 0 and best.step_time > 0 and 0 < best.mfu < 1
    assert best.view is not None and best.view.spec is model.spec
    assert (best.view.widths.f, best.view.widths.head_dim) == (96, 24)


def _activations_and_time(model: nn.Module, layout: Candidate) -> tuple[int, int, float]:
    # (an H100 whose collectives cost no latency: a toy's microseconds of compute would hide behind FSDP's
    # ~30 us a call, and the step time be the calls' alone, whatever the widths)
    gpu = dataclasses.replace(GPUS["h100"], collective_base_latency=0.0, intra_node_latency=0.0, inter_node_latency=0.0)
    [cost] = estimate(_workload(model), layout, model, gpu)
    return cost.memory["params"], cost.memory["activations"], cost.step_time


@pytest.mark.parametrize("width", ["ffn_dim", "head_dim"])
def test_a_wider_spec_alone_raises_the_predicted_activations_and_time(width):
    # Same module, same parameters: only the spec says wider. A planner reading anything but the
    # spec (a LlamaConfig, the module's own attributes) would predict the same.
    layout = Candidate.layout(dp=2, zero=3, micro_batch_size=4)
    model = meta_toy()
    params, activations, seconds = _activations_and_time(model, layout)
    model.spec = dataclasses.replace(model.spec, **{width: 4 * getattr(model.spec, width)})
    wider = _activations_and_time(model, layout)
    assert wider[0] == params and wider[1] > activations and wider[2] > seconds


def test_a_wider_toy_needs_more_memory():
    layout = Candidate.layout(dp=2, zero=3, micro_batch_size=4)
    narrow, wide = (estimate(_workload(m), layout, m)[0].peak for m in (meta_toy(), meta_toy(ffn_dim=384)))
    assert wide > narrow


def test_the_planner_reads_the_moe_counts_from_the_spec():
    layout = Candidate.layout(dp=2, zero=1, ep=2, micro_batch_size=4)
    model = build_model("moe_tiny", device="meta")
    workload = Workload(model, seq_len=256, global_batch_size=8, precision="32-true")
    [cost] = estimate(workload, layout, model)
    model.spec = dataclasses.replace(model.spec, top_k=4)
    [more] = estimate(workload, layout, model)
    assert more.memory["activations"] > cost.memory["activations"]
    assert more.comm["ep:all_to_all"] == 2 * cost.comm["ep:all_to_all"] - _split_sizes(model, workload, layout)


def _split_sizes(model: nn.Module, workload: Workload, layout: Candidate) -> int:
    """The part of the all-to-all payload that does not grow with top_k (one count per expert each way)."""
    spec = model.spec
    return 8 * spec.n_experts * len(spec.moe_blocks) * workload.global_batch_size // layout.micro_batch_size // 2


def test_a_spec_without_the_widths_the_planner_prices_is_refused_by_name():
    model = meta_toy()
    model.spec = dataclasses.replace(model.spec, ffn_dim=0)
    with pytest.raises(ConfigError, match=r"model toy's spec leaves ffn_dim=0"):
        _workload(model)


def test_mfu_counts_the_specs_flops_for_a_model_without_its_own_count():
    model = meta_toy()
    [cost] = estimate(_workload(model), Candidate.layout(dp=2, zero=1, micro_batch_size=4), model, GPUS["h100"])
    assert math.isfinite(cost.mfu) and cost.mfu > 0


def test_a_users_own_model_is_priced_from_its_spec():
    # tests/own_model.py, docs/models.md's "Your own model": its spec declares its FFN width.
    with torch.device("meta"):
        model = Transformer(CONFIG)
    [cost] = estimate(_workload(model), Candidate.layout(dp=2, zero=3, micro_batch_size=4), model, GPUS["h100"])
    assert cost.view is not None and cost.view.widths.f == CONFIG["ffn_dim"] and cost.step_time > 0


# ----------------------------------------------------------------------------- trains under a layout
class ToyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: Toy | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = Toy(ToyConfig())
            if not any(p.is_meta for p in self.model.parameters()):  # (the strategy builds on meta, then inits)
                self.model.init_weights(0)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _run(world_size: int, plugins=None):
    strategy = (lambda: UltraScaleStrategy(*plugins())) if plugins is not None else None
    return record_run(
        ToyModule,
        lambda: UltraScaleDataModule(seq_len=32, micro_batch_size=4 // world_size, seed=0),
        steps=2,
        strategy=strategy,
        world_size=world_size,
    )


def test_the_toy_family_trains_under_zero3_like_one_process():
    assert_parity(_run(2, lambda: [ZeRO(3)]), _run(1), rtol=1e-5)
