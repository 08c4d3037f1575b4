"""Our models against Hugging Face's Llama, Qwen2, Mixtral, Qwen3 and DeepSeek-V3: same config, weights and logits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from llama_runs import DEEPSEEK_V3_TINY, MIXTRAL_TINY, QWEN3_MOE_TINY

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import MODEL_CONFIGS, Llama, LlamaConfig, build_model, get_model_config
from lightning_ultrascale.models.hf.convert import (
    config_from_hf,
    config_to_hf,
    hf_architecture,
    hf_file_tensors,
    load_hf_pretrained,
    state_dict_from_hf,
    state_dict_to_hf,
)

transformers = pytest.importorskip("transformers")

TINY = get_model_config("llama_tiny")
TINY_TIED = replace(TINY, tie_embeddings=True, name="llama_tiny_tied")
# Qwen2: q/k/v biases, a tied head, default RoPE.
QWEN2_TINY = replace(TINY, qkv_bias=True, tie_embeddings=True, rope_scaling=None, name="qwen2_tiny")
# Qwen3: per-head q/k norms, heads wider than dim / n_heads, a tied head; Qwen3-MoE: softmax top-2 of 8 in every
# block, the weights not renormalised (HF's default), no z-loss (transformers' Qwen3-MoE has none to keep).
QWEN3_TINY = replace(
    TINY, qk_norm=True, attention_head_dim=32, tie_embeddings=True, rope_scaling=None, name="qwen3_tiny"
)
QWEN3_MOE = replace(
    QWEN3_MOE_TINY, rope_scaling=None, moe=replace(QWEN3_MOE_TINY.moe, z_loss_coeff=0.0, norm_topk_prob=False)
)
# fp32. With HF's "sdpa" attention the logits come out bit-identical on this CPU (HF "eager"
# differs by ~2e-7: another softmax); the tolerance leaves room for other kernels. Logits are
# O(0.01-1), so the absolute floor of 1e-6 only matters for entries near 0, where rtol cannot.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _hf_model(cfg: LlamaConfig, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config_class, model_class = (getattr(transformers, c) for c in hf_architecture(cfg))
    hf_config = config_class(**config_to_hf(cfg), attn_implementation="sdpa")
    model = model_class(hf_config).eval()
    # HF initialises every norm to 1 and DeepSeek's selection bias to 0; perturb them so that
    # swapping attention_norm and ffn_norm in the key map, or losing the bias, would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):  # (HF starts biases at 0)
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return model


def _tokens(seq: int = 24) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))


def _hf_logits(model: transformers.LlamaForCausalLM, tokens: torch.Tensor, **kwargs: object) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False, **kwargs).logits


def _ours_from_hf(hf: transformers.LlamaForCausalLM, cfg: LlamaConfig) -> Llama:
    model = build_model(cfg, device="meta")
    model.load_state_dict(state_dict_from_hf(hf.state_dict(), cfg), assign=True)
    model.init_buffers()
    model.tie_weights()
    return model


@pytest.mark.parametrize(
    "cfg",
    [
        TINY,
        TINY_TIED,
        replace(TINY, rope_scaling=None),
        QWEN2_TINY,
        MIXTRAL_TINY,
        DEEPSEEK_V3_TINY,
        QWEN3_TINY,
        QWEN3_MOE,
    ],
    ids=["tiny", "tied", "no-scaling", "qwen2", "mixtral", "deepseek_v3", "qwen3", "qwen3_moe"],
)
def test_hf_weights_give_hf_logits(cfg: LlamaConfig) -> None:
    hf = _hf_model(cfg)
    ours = _ours_from_hf(hf, cfg)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), _hf_logits(hf, tokens), **TOL)


def test_hf_parity_with_context_parallel_position_ids() -> None:
    # Row 0 holds zig-zag chunks 0 and 3 of a 48-token sequence (context-parallel rank 0 of 2),
    # row 1 every other position. An all-ones attention_mask stops HF from reading the position
    # jumps as boundaries of packed sequences: both sides then apply plain causal attention over
    # the local tokens, with RoPE at the given positions.
    hf = _hf_model(TINY)
    ours = _ours_from_hf(hf, TINY)
    tokens = _tokens()
    position_ids = torch.stack([torch.cat([torch.arange(12), torch.arange(36, 48)]), torch.arange(24) * 2 + 5])
    expected = _hf_logits(hf, tokens, position_ids=position_ids, attention_mask=torch.ones_like(tokens))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens, position_ids), expected, **TOL)
    # The positions do reach RoPE: logits differ from those of positions 0 .. 23.
    assert not torch.allclose(expected, _hf_logits(hf, tokens), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(
    "cfg",
    [TINY, TINY_TIED, QWEN2_TINY, MIXTRAL_TINY, DEEPSEEK_V3_TINY, QWEN3_TINY, QWEN3_MOE],
    ids=["tiny", "tied", "qwen2", "mixtral", "deepseek_v3", "qwen3", "qwen3_moe"],
)
def test_our_weights_give_hf_the_same_logits(cfg: LlamaConfig) -> None:
    ours = build_model(cfg, seed=5)
    with torch.no_grad():  # a trained selection bias, as aux-loss-free balancing leaves it (DeepSeek)
        for name, b in ours.named_buffers():
            if name.endswith("router.expert_bias") and cfg.moe.router == "sigmoid":
                b.copy_(0.2 * torch.randn_like(b))
    hf = _hf_model(cfg, seed=99)
    hf.load_state_dict(state_dict_to_hf(ours.state_dict(), cfg), strict=True)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(hf, tokens), ours(tokens), **TOL)


def _convertible(cfg: LlamaConfig) -> bool:
    try:
        hf_architecture(cfg)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(n for n, c in MODEL_CONFIGS.items() if _convertible(c)))
def test_config_round_trips_through_hf(name: str) -> None:
    cfg = MODEL_CONFIGS[name]
    hf_config = getattr(transformers, hf_architecture(cfg)[0])(**config_to_hf(cfg))
    assert config_from_hf(hf_config, name=name) == cfg


def test_deepseek_v3_config_reads_deepseeks_config_json_spelling() -> None:
    # What deepseek-ai/DeepSeek-V3's config.json says (less its FP8 quantization_config), and
    # transformers builds the same parameter count from it, on the meta device.
    cfg = get_model_config("deepseek_v3")
    hf_json = config_to_hf(cfg)
    assert hf_json["rope_scaling"]["type"] == "yarn" and hf_json["rope_interleave"] is True
    assert config_from_hf(transformers.DeepseekV3Config(**hf_json), name="deepseek_v3") == cfg
    hf_config = transformers.DeepseekV3Config(**hf_json)
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(hf_config)
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_params() == 671_026_404_352
    with pytest.raises(ConfigError, match="hf quantization_config is set"):
        config_from_hf(transformers.DeepseekV3Config(**hf_json, quantization_config={"quant_method": "fp8"}))
    with pytest.raises(ConfigError, match="hf scoring_func='softmax' is not supported; valid: 'sigmoid'"):
        config_from_hf(transformers.DeepseekV3Config(**(hf_json | {"scoring_func": "softmax"})))


def test_models_without_an_hf_counterpart_say_which_ones_convert() -> None:
    with pytest.raises(ConfigError, match="model deepseek_v2_lite has no Hugging Face counterpart we convert"):
        hf_architecture(get_model_config("deepseek_v2_lite"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention_bias": True}, "hf attention_bias=True is not supported; valid: False"),
        ({"hidden_act": "gelu"}, "hf hidden_act='gelu' is not supported; valid: 'silu'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "hf rope_type='linear' is not supported"),
    ],
)
def test_unsupported_hf_config_is_refused(change: dict, message: str) -> None:
    hf_config = transformers.LlamaConfig(**(config_to_hf(TINY) | change))
    with pytest.raises(ConfigError, match=message):
        config_from_hf(hf_config)


def test_state_dict_conversion_renames_only() -> None:
    hf = _hf_model(TINY)
    hf_sd = hf.state_dict()
    sd = state_dict_from_hf(hf_sd, TINY)
    assert sd["layers.1.feed_forward.w1.weight"] is hf_sd["model.layers.1.mlp.gate_proj.weight"]
    assert sd.keys() == build_model(TINY, device="meta").state_dict().keys()
    back = state_dict_to_hf(sd, TINY)
    assert back.keys() == hf_sd.keys() and all(back[k] is hf_sd[k] for k in hf_sd)


def test_state_dict_conversion_reports_unknown_and_missing_keys() -> None:
    hf_sd = _hf_model(TINY).state_dict()
    with pytest.raises(KeyError, match="no Llama counterpart for 1 key"):
        state_dict_from_hf(hf_sd | {"model.layers.0.self_attn.rotary.weight": torch.ones(16)}, TINY)
    # Qwen3's query norm has a place in a qk_norm model only, MLA's latent projection in an MLA one: refused, not
    # dropped (the model would differ from the checkpoint's).
    with pytest.raises(KeyError, match=r"no Llama counterpart for 1 key\(s\): model.layers.0.self_attn.q_norm.weight"):
        state_dict_from_hf(hf_sd | {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, TINY)
    with pytest.raises(KeyError, match=r"1 key\(s\) model llama_tiny has no place for: layers.0.attention.wkv_a"):
        state_dict_from_hf(hf_sd | {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight": torch.ones(16)}, TINY)
    del hf_sd["model.layers.3.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match=r"misses 1 key\(s\) for n_layers=4: layers.3.feed_forward.w3.weight"):
        state_dict_from_hf(hf_sd, TINY)


def test_tied_hf_checkpoint_without_lm_head_loads() -> None:
    hf_sd = _hf_model(TINY_TIED).state_dict()
    del hf_sd["lm_head.weight"]  # what save_pretrained writes for tied models
    sd = state_dict_from_hf(hf_sd, TINY_TIED)
    assert sd["output.weight"] is sd["tok_embeddings.weight"]


@pytest.mark.parametrize(
    "cfg",
    [TINY, TINY_TIED, QWEN2_TINY, MIXTRAL_TINY, DEEPSEEK_V3_TINY, QWEN3_TINY, QWEN3_MOE],
    ids=["tiny", "tied", "qwen2", "mixtral", "deepseek_v3", "qwen3", "qwen3_moe"],
)
@pytest.mark.parametrize("source", ["model", "directory"])
def test_load_hf_pretrained(cfg: LlamaConfig, source: str, tmp_path: Path) -> None:
    hf = _hf_model(cfg)
    if source == "directory":
        hf.save_pretrained(tmp_path)
        # What the DCP path (model.init_from=hf:, ultrascale-export) reads and writes: the files' tensors.
        from safetensors import safe_open

        with safe_open(tmp_path / "model.safetensors", "pt") as f:
            assert set(f.keys()) == set(hf_file_tensors(cfg))
    model = load_hf_pretrained(tmp_path if source == "directory" else hf)
    assert replace(model.config, name=cfg.name) == cfg
    assert (model.output.weight is model.tok_embeddings.weight) == cfg.tie_embeddings
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), _hf_logits(hf, tokens), **TOL)
