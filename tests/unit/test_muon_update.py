"""Muon in one process: Moonlight's update against a textbook copy, the parameters it takes, what it refuses."""

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_ultrascale import OptimConfig
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model
from lightning_ultrascale.parallel.muon import Muon, muon_param_groups, orthogonalize, update_scale


def _textbook_newton_schulz(g: torch.Tensor) -> torch.Tensor:
    """Moonlight's ``zeropower_via_newtonschulz5``, one matrix, written out here as published."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = g.clone()
    if g.size(0) > g.size(1):
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


def _textbook_steps(model: nn.Module, batches: list[torch.Tensor], lr: float, wd: float) -> list[torch.Tensor]:
    """Moonlight's Muon for the blocks' matrices and torch's AdamW for the rest, one matrix at a time."""
    groups = muon_param_groups(model, wd)
    muon = [p for g in groups if g["use_muon"] for p in g["params"]]
    adamw = torch.optim.AdamW(
        [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups if not g["use_muon"]],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    momentum = {p: torch.zeros_like(p) for p in muon}
    for batch in batches:
        model.zero_grad()
        model(batch).square().mean().backward()
        with torch.no_grad():
            for p in muon:
                momentum[p].mul_(0.95).add_(p.grad)
                u = p.grad + 0.95 * momentum[p]
                matrices = u if u.dim() == 3 else u[None]
                o = torch.stack([_textbook_newton_schulz(m) for m in matrices]).reshape(p.shape)
                p.mul_(1 - lr * wd).sub_(lr * 0.2 * math.sqrt(max(p.shape[-2:])) * o)
        adamw.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("model_name", ["llama_tiny", "moe_tiny"])
def test_muon_steps_as_moonlight_writes_it(model_name):
    torch.manual_seed(0)
    batches = [torch.randint(0, 256, (2, 16)) for _ in range(3)]
    model = build_model(model_name)
    ours, theirs = model, build_model(model_name)
    theirs.load_state_dict(ours.state_dict())
    expected = _textbook_steps(theirs, batches, lr=1e-2, wd=0.1)
    optimizer = Muon(muon_param_groups(ours, 0.1), lr=1e-2)
    for batch in batches:
        optimizer.zero_grad()
        ours(batch).square().mean().backward()
        optimizer.step()
    # Batched against one-matrix GEMMs round differently, and the quintic's coefficients (3.4, -4.8,
    # 2.0) amplify each iteration's rounding: measured worst 2.6e-6 after 3 steps (wo, experts' w2).
    for (name, got), want in zip(ours.named_parameters(), expected):
        err = float((got.detach() - want).norm() / want.norm())
        assert err < 2e-5, f"{name}: {err:.2e}"
    # Each step orthogonalised every logical matrix of the blocks once (an expert stack: each expert).
    muon = [p for g in optimizer.param_groups if g["use_muon"] for p in g["params"]]
    matrices = sum(p.shape[0] if p.dim() == 3 else 1 for p in muon)
    assert sum(optimizer.orthogonalized.values()) == 3 * matrices


def test_newton_schulz_moves_every_singular_value_into_the_quintics_band():
    # The quintic trades exactness for speed: singular values land in about [0.7, 1.2], not at 1.
    g = torch.randn(3, 48, 160) * torch.logspace(-3, 1, 160)  # singular values spread over 4 decades
    o = orthogonalize(g, (48, 160)) / update_scale(48, 160)
    s = torch.linalg.svdvals(o)
    assert float(s.min()) > 0.6 and float(s.max()) < 1.25, (float(s.min()), float(s.max()))
    tall = orthogonalize(g.mT, (160, 48)) / update_scale(160, 48)  # transposed inside, then back
    torch.testing.assert_close(tall, o.mT, rtol=1e-5, atol=1e-6)


def test_update_scale_matches_adamws_update_rms():
    # Moonlight's 0.2*sqrt(max(A, B)): an orthogonal update of RMS 1/sqrt(max(A, B)) scaled to RMS 0.2.
    o = orthogonalize(torch.randn(1, 64, 256), (64, 256))
    assert 0.14 < float(o.square().mean().sqrt()) < 0.24


def test_a_fused_gate_up_matrix_is_orthogonalised_as_its_two_logical_matrices():
    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(2, 2 * 24, 32))  # HF's stacked [gate; up] per expert
            self.down_proj = nn.Parameter(torch.randn(2, 32, 24))

    model = nn.Module()
    model.layers = nn.ModuleDict({"0": Experts()})
    from lightning_ultrascale.models.spec import ModelSpec

    model.spec = ModelSpec(name="toy", n_layers=1, n_heads=1, n_kv_heads=1, dim=32, vocab_size=8)
    groups = muon_param_groups(model, 0.0)
    assert [(g["split"], len(g["params"])) for g in groups if g["use_muon"]] == [(1, 1), (2, 1)]
    w = model.layers["0"].gate_up_proj
    w.grad = torch.randn_like(w)
    expected = w.detach() - 0.1 * orthogonalize(w.grad.reshape(4, 24, 32), (24, 32)).reshape(w.shape)
    optimizer = Muon([g for g in groups if g["use_muon"] and g["split"] == 2], lr=0.1, momentum=0.0, weight_decay=0.0)
    optimizer.step()
    torch.testing.assert_close(w.detach(), expected)
    assert optimizer.orthogonalized == {(24, 32): 4}


def test_muon_takes_the_blocks_matrices_and_leaves_embedding_head_norms_and_router_to_adamw():
    model = build_model("moe_tiny")
    groups = muon_param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in groups if g["use_muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in groups if not g["use_muon"] for p in g["params"]}
    assert muon.isdisjoint(adamw) and muon | adamw == set(names.values())
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= adamw
    assert all(n.endswith("router.weight") or "norm" in n for n in adamw - {"tok_embeddings.weight", "output.weight"})
    assert any(n.endswith("router.weight") for n in adamw)
    assert any(n.endswith("experts.w1") for n in muon) and any(n.endswith("attention.wq.weight") for n in muon)


def test_a_flattened_matrix_in_a_muon_group_is_refused():
    flat = nn.Parameter(torch.zeros(64))
    flat.grad = torch.ones(64)
    optimizer = Muon([{"params": [flat], "use_muon": True}], lr=0.1)
    with pytest.raises(ConfigError, match="refuses a flattened one"):
        optimizer.step()


def test_a_piece_of_a_matrix_is_never_orthogonalised_alone():
    from lightning_ultrascale.parallel.muon import _split_orthogonalized

    group = {"split": 1, "ns_steps": 5}
    with pytest.raises(ValueError, match="whole 64x64 matrices; this rank holds"):
        _split_orthogonalized(torch.zeros(1, 32, 64), (64, 64), group, stats=None)  # a shard's rows


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"momentum": 1.0}, "optim.momentum=1.0: Muon's momentum must be in"),
        ({"ns_steps": 0}, "optim.ns_steps=0 must be >= 1"),
        ({"adamw_lr": 0.0}, "optim.adamw_lr=0.0 must be > 0"),
    ],
)
def test_bad_muon_settings_name_the_option(settings, message):
    with pytest.raises(ConfigError, match=message):
        OptimConfig(name="muon", **settings)


def test_the_planner_prices_newton_schulz_where_zero3_runs_it():
    from lightning_ultrascale.models import get_model_config
    from lightning_ultrascale.parallel.muon import muon_split, newton_schulz_flops
    from lightning_ultrascale.plan import Candidate, Workload, estimate, get_hardware

    model = build_model("llama3_8b", device="meta")
    flops = 0
    for name, p in model.named_parameters():
        if muon_split(name, p.shape, model.spec):
            flops += newton_schulz_flops(*p.shape)
    workload = Workload(get_model_config("llama3_8b"), 4096, 64, optimizer="muon")
    layout = Candidate.layout(dp=8, zero=3, micro_batch_size=1, recompute="full")
    [muon] = estimate(workload, layout, model, get_hardware("h100"), ranks=[0])
    [adamw] = estimate(replace(workload, optimizer="adamw"), layout, model, get_hardware("h100"), ranks=[0])
    priced = sum(sum(t.step_flops.values()) for t in muon.terms)
    assert abs(priced / (flops / 8) - 1) < 1e-3  # each of the 8 ranks orthogonalises an eighth
    # One moment instead of two for the blocks' matrices (fp32, an eighth of each on this rank).
    muon_numel = sum(p.numel() for n, p in model.named_parameters() if muon_split(n, p.shape, model.spec))
    saved = adamw.model_state["optimizer"] - muon.model_state["optimizer"]
    assert abs(saved / (4 * muon_numel / 8) - 1) < 1e-3
    assert muon.step_time > adamw.step_time  # 5 quintic iterations per matrix: ~2 TFLOP for each 4096 x 4096


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2"])
def test_hugging_face_families_give_muon_their_matrices_and_adamw_their_router(family):
    from hf_models import hf_config
    from transformers import AutoModelForCausalLM

    from lightning_ultrascale.models.hf.adapter import adapt

    model = adapt(AutoModelForCausalLM.from_config(hf_config(family)))
    names = {id(p): n for n, p in model.named_parameters()}
    by_group: dict[tuple[bool, int | None], set[str]] = {}
    for g in muon_param_groups(model, 0.1):
        key = (g["use_muon"], g["split"] if g["use_muon"] else None)
        by_group.setdefault(key, set()).update(names[id(p)] for p in g["params"])
    muon = by_group[True, 1] | by_group.get((True, 2), set())
    assert all(n.endswith(("proj.weight", "experts.down_proj", "experts.gate_up_proj")) for n in muon)
    adamw = by_group[False, None]
    assert "model.embed_tokens.weight" in adamw
    if family != "qwen2":  # the router (HF's mlp.gate) stays on AdamW; fused gate/up is two matrices
        matrices = {n for n in adamw if "norm" not in n} - {"model.embed_tokens.weight", "lm_head.weight"}
        assert matrices and all(n.endswith("mlp.gate.weight") for n in matrices)
        assert by_group[True, 2] and all(n.endswith("gate_up_proj") for n in by_group[True, 2])
