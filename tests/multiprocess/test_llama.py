"""Llama: published sizes, layout-independent initialisation, pipeline pieces, TP plan, errors."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import MODEL_CONFIGS, Llama, build_model, get_model_config
from lightning_ultrascale.models.llama import param_seed, rope_inv_freq
from lightning_ultrascale.testing import run_workers

# Meta's model cards / the safetensors index of the HF checkpoints.
PUBLISHED_PARAMS = {
    "llama3_1b": 1_235_814_400,
    "llama3_3b": 3_212_749_824,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
}
TINY = get_model_config("llama_tiny")
TINY_TIED = replace(TINY, tie_embeddings=True, name="llama_tiny_tied")


def _tokens(batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _assert_same_params(actual: nn.Module, expected: nn.Module) -> None:
    expected_params = dict(expected.named_parameters())
    for name, p in actual.named_parameters():
        assert torch.equal(p, expected_params[name]), name


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_param_count_matches_published(name: str) -> None:
    model = build_model(name, device="meta")
    n = sum(p.numel() for p in model.parameters())
    rel = abs(n - PUBLISHED_PARAMS[name]) / PUBLISHED_PARAMS[name]
    assert rel < 0.005, f"{name}: {n:,} params vs published {PUBLISHED_PARAMS[name]:,} (rel. error {rel:.2%})"
    assert n == model.config.num_params()


def test_every_named_config_builds_and_is_named_after_its_key() -> None:
    for name, cfg in MODEL_CONFIGS.items():
        assert cfg.name == name
        assert build_model(name, device="meta").spec.n_layers == cfg.n_layers


def test_tiny_exercises_all_three_rope_scaling_bands() -> None:
    s = TINY.rope_scaling
    assert s is not None
    plain = rope_inv_freq(replace(TINY, rope_scaling=None))
    wavelen = 2 * math.pi / plain
    scaled = rope_inv_freq(TINY)
    kept = wavelen < s.original_max_position_embeddings / s.high_freq_factor
    stretched = wavelen > s.original_max_position_embeddings / s.low_freq_factor
    assert kept.any() and stretched.any() and (~kept & ~stretched).any()
    torch.testing.assert_close(scaled[kept], plain[kept], rtol=0, atol=0)
    torch.testing.assert_close(scaled[stretched], plain[stretched] / s.factor, rtol=0, atol=0)


def test_forward_shape_and_default_positions() -> None:
    model = build_model("llama_tiny", seed=0)
    tokens = _tokens()
    logits = model(tokens)
    assert logits.shape == (2, 16, TINY.vocab_size)
    torch.testing.assert_close(model(tokens, torch.arange(16).expand(2, 16)), logits, rtol=0, atol=0)


def test_rope_sees_only_relative_positions() -> None:
    # Shifting every position by the same offset rotates q and k alike: attention scores, hence
    # logits, stay the same up to rounding. That is what lets context parallelism hand each rank
    # its own positions.
    model = build_model("llama_tiny", seed=0)
    tokens = _tokens()
    shifted = model(tokens, torch.arange(100, 116).expand(2, 16))
    torch.testing.assert_close(shifted, model(tokens), rtol=1e-4, atol=1e-5)


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b = build_model("llama_tiny", seed=3), build_model("llama_tiny", seed=3)
    _assert_same_params(a, b)
    c = build_model("llama_tiny", seed=4)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


def test_init_std_and_norms() -> None:
    # Wide enough that the sample std is within a few percent of the target.
    small = build_model(replace(TINY, dim=256, n_heads=4, ffn_hidden_dim=512, vocab_size=4096), seed=0)
    std = small.tok_embeddings.weight.std().item()
    wo_std = small.layers["0"].attention.wo.weight.std().item()
    assert std == pytest.approx(0.02, rel=0.05)
    assert wo_std == pytest.approx(0.02 / (2 * small.config.n_layers) ** 0.5, rel=0.05)
    assert torch.equal(small.norm.weight, torch.ones(256))


def test_every_parameter_of_405b_gets_its_own_seed() -> None:
    names = [n for n, _ in build_model("llama3_405b", device="meta").named_parameters()]
    for seed in (0, 1):
        assert len({param_seed(seed, n) for n in names}) == len(names)
    assert param_seed(0, names[0]) != param_seed(1, names[0])


@pytest.mark.parametrize("cfg", [TINY, TINY_TIED], ids=["untied", "tied"])
def test_meta_build_materialised_equals_cpu_build(cfg) -> None:
    reference = build_model(cfg, seed=7)
    model = build_model(cfg, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=7)
    _assert_same_params(model, reference)
    torch.testing.assert_close(model.rope_inv_freq, reference.rope_inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(model(_tokens()), reference(_tokens()), rtol=0, atol=0)
    assert (model.output.weight is model.tok_embeddings.weight) == cfg.tie_embeddings


def test_param_value_does_not_depend_on_other_layers() -> None:
    full = build_model("llama_tiny", seed=0)
    # A pipeline stage: blocks 1 and 3 deleted, no head; built on meta, materialised, initialised.
    stage = build_model("llama_tiny", device="meta")
    del stage.layers["1"], stage.layers["3"]
    stage.norm = stage.output = None
    stage.to_empty(device="cpu")
    stage.init_weights(seed=0)
    _assert_same_params(stage, full)
    # A shallower model: the weights not scaled by depth are the same draws.
    shallow = build_model(replace(TINY, n_layers=2), seed=0)
    for name in ("tok_embeddings.weight", "layers.1.attention.wq.weight", "layers.0.feed_forward.w1.weight"):
        assert torch.equal(shallow.get_parameter(name), full.get_parameter(name)), name


def test_tied_head_alone_is_initialised_as_the_embedding() -> None:
    full = build_model(TINY_TIED, seed=0)
    last_stage = build_model(TINY_TIED, device="meta")
    last_stage.tok_embeddings = None
    last_stage.to_empty(device="cpu")
    last_stage.init_weights(seed=0)
    assert torch.equal(last_stage.output.weight, full.tok_embeddings.weight)


# torch.compile's import path warns about torch.jit internals: not ours.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("wrapper", ["checkpoint", "compile"])
def test_init_ignores_wrapper_names(wrapper: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    full = build_model("llama_tiny", seed=0)
    model = build_model("llama_tiny", device="meta")
    for key, block in model.layers.items():
        # torch.compile wraps lazily (nothing compiles before a call), so this stays fast.
        model.layers[key] = checkpoint_wrapper(block) if wrapper == "checkpoint" else torch.compile(block)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    assert any(("_checkpoint_wrapped_module" in n or "_orig_mod" in n) for n, _ in model.named_parameters())
    for (name, p), q in zip(model.named_parameters(), full.parameters()):
        assert torch.equal(p, q), name


def test_pipeline_stages_compose_to_the_full_model() -> None:
    full = build_model("llama_tiny", seed=0)
    first, last = copy.deepcopy(full), copy.deepcopy(full)
    del first.layers["2"], first.layers["3"]
    first.norm = first.output = None
    del last.layers["0"], last.layers["1"]
    last.tok_embeddings = None
    tokens = _tokens()
    hidden = first(tokens)
    assert hidden.shape == (2, 16, TINY.dim)
    torch.testing.assert_close(last(hidden), full(tokens), rtol=0, atol=0)


def test_flops_per_token_counts_every_matmul_weight_once() -> None:
    for cfg in (TINY, TINY_TIED):
        model = build_model(cfg, seed=0)
        # 6 x (every Linear weight, the output head even when tied, plus the norm gains as in
        # torchtitan; the embedding lookup is no matmul) + the attention score/value term.
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
        attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 128
        assert model.flops_per_token(128) == 6 * (linear + norms) + attention


def test_unknown_model_name_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"model=llama_huge is unknown; valid: llama_tiny, llama_small, .*_405b"):
        build_model("llama_huge")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_kv_heads": 3}, "model.n_kv_heads=3 must divide model.n_heads=4; valid: 1, 2, 4"),
        ({"n_heads": 5}, "model.n_heads=5 must divide model.dim=64 into an even head_dim; valid: 1, 2, 4, 8, 16, 32"),
        ({"n_heads": 64, "n_kv_heads": 1}, "model.n_heads=64 must divide model.dim=64 into an even head_dim"),
        ({"n_layers": 0}, "model.n_layers=0 must be a positive integer"),
        ({"rope_scaling": {"factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                           "original_max_position_embeddings": 64}}, "low_freq_factor < high_freq_factor"),
    ],
)  # fmt: skip
def test_invalid_config_names_option_value_and_valid_values(change: dict, message: str) -> None:
    cfg = replace(TINY, **change)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()
    with pytest.raises(ConfigError):
        Llama(cfg)


def _tp_worker(sequence_parallel: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    model = build_model("llama_tiny", device="meta")
    top, blocks = model.spec.tp_plan(sequence_parallel)
    parallelize_module(model, mesh, top)
    for name, layer in model.layers.items():
        parallelize_module(layer, mesh, blocks[name])
    model.to_empty(device="cpu")
    model.init_weights(seed=0)  # DTensor path: each rank copies in its shard of the full draw
    logits = model(_tokens())
    params = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    return logits.full_tensor(), params


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tp_plan_on_two_ranks_matches_one_process(sequence_parallel: bool) -> None:
    reference = build_model("llama_tiny", seed=0)
    expected = reference(_tokens())
    for logits, params in run_workers(_tp_worker, 2, sequence_parallel):
        for name, p in reference.named_parameters():
            assert torch.equal(params[name], p), name
        # Row-parallel matmuls sum two partial products: float reassociation, ~1e-7 here.
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
