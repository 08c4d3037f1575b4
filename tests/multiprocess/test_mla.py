"""Multi-head latent attention: equal to HF's DeepSeek-V3 attention, and trains alike under TP and CP."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from llama_runs import SGD, run_tiny_llama
from test_context import kernel_errors
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from lightning_ultrascale import ContextParallel, TensorParallel
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.models.common.mla import MLA_HF_NAMES, MLAConfig, MLAttention, YarnScaling, mla_inv_freq
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import assert_parity, relative_error

# v's head size (16) differs from q/k's (16 + 8): what context parallelism must carry through.
# YaRN with mscale != mscale_all_dim puts a factor on both the rotary logits and the softmax scale;
# with rope_theta 5e5 an original context of 256 puts the 4 rotary frequencies in all three bands.
YARN = YarnScaling(factor=4.0, original_max_position_embeddings=256, mscale=0.9, mscale_all_dim=0.7)
MLA = MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=48, yarn=YARN)
# norm_eps 1e-5 (HF's default rms_norm_eps is 1e-6): the latent norms keep 1e-6 either way.
TINY_MLA = dataclasses.replace(get_model_config("llama_tiny"), mla=MLA, name="llama_tiny_mla")


def _hf_attention(mla: MLAConfig) -> tuple[DeepseekV3Attention, DeepseekV3RotaryEmbedding]:
    rope: dict = {"rope_type": "default", "rope_theta": TINY_MLA.rope_theta}
    if mla.yarn is not None:
        rope |= {"rope_type": "yarn", **dataclasses.asdict(mla.yarn)}
    config = DeepseekV3Config(
        hidden_size=TINY_MLA.dim,
        num_attention_heads=TINY_MLA.n_heads,
        num_key_value_heads=TINY_MLA.n_heads,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rope_parameters=rope,
        rope_interleave=True,  # DeepSeek's checkpoints
    )
    config._attn_implementation = "eager"  # explicit matmul-softmax: independent of our SDPA call
    return DeepseekV3Attention(config, layer_idx=0), DeepseekV3RotaryEmbedding(config)


@pytest.mark.parametrize("yarn", [None, YARN], ids=["plain-rope", "yarn"])
@pytest.mark.parametrize("q_lora_rank", [48, None], ids=["q-lora", "full-rank-q"])
def test_mla_equals_hf_deepseek_v3_attention_renamed_weights(q_lora_rank, yarn):
    cfg = dataclasses.replace(TINY_MLA, mla=dataclasses.replace(MLA, q_lora_rank=q_lora_rank, yarn=yarn))
    ours = MLAttention(cfg)
    hf, hf_rope = _hf_attention(cfg.mla)
    g = torch.Generator().manual_seed(0)
    for name, p in ours.named_parameters():
        module, leaf = name.split(".")
        with torch.no_grad():  # norms away from 1 so that a missing or misplaced gain shows
            p.copy_(
                torch.rand(p.shape, generator=g) + 0.5 if "norm" in module else torch.randn(p.shape, generator=g) * 0.1
            )
        hf.get_parameter(f"{MLA_HF_NAMES[module]}.{leaf}").data.copy_(p)
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())
    torch.testing.assert_close(mla_inv_freq(cfg), hf_rope.inv_freq, rtol=0, atol=0)

    seq = 12
    x = torch.randn(2, seq, cfg.dim, generator=g)
    positions = torch.arange(seq).expand(2, seq)
    freqs = positions[..., None].float() * mla_inv_freq(cfg)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # as Llama._rope_angles builds them
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = ours(x_ours, angles.cos(), angles.sin())
    causal_mask = torch.full((seq, seq), float("-inf")).triu(1)
    expected = hf(x_hf, hf_rope(x, positions), causal_mask)[0]
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    expected.backward(dout)

    errors = {"output": relative_error(out.detach(), expected.detach()), "dx": relative_error(x_ours.grad, x_hf.grad)}
    for name, p in ours.named_parameters():
        module, leaf = name.split(".")
        errors[name] = relative_error(p.grad, hf.get_parameter(f"{MLA_HF_NAMES[module]}.{leaf}").grad)
    assert max(errors.values()) < 1e-5, errors


def test_deepseek_v3_yarn_puts_its_whole_temperature_on_the_softmax():
    y = YarnScaling(factor=40, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    assert y.rope_factor == 1.0
    assert y.softmax_factor == pytest.approx((0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)


def test_yarn_keeps_fast_frequencies_divides_slow_ones_by_factor_and_ramps_between():
    plain = mla_inv_freq(dataclasses.replace(TINY_MLA, mla=dataclasses.replace(MLA, yarn=None)))
    scaled = mla_inv_freq(TINY_MLA)
    assert scaled[0] == plain[0] and scaled[-1] == plain[-1] / YARN.factor
    assert ((scaled < plain) & (scaled > plain / YARN.factor)).any()


def test_parameter_count_counts_every_attention_parameter():
    from lightning_ultrascale.models import build_model

    for q_lora_rank in (48, None):
        cfg = dataclasses.replace(TINY_MLA, mla=dataclasses.replace(MLA, q_lora_rank=q_lora_rank))
        model = build_model(cfg, device="meta")
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"qk_rope_head_dim": 7}, "model.mla.qk_rope_head_dim=7 must be even (RoPE rotates pairs)"),
        ({"kv_lora_rank": 0}, "model.mla.kv_lora_rank=0 must be a positive integer"),
        ({"q_lora_rank": 0}, "model.mla.q_lora_rank=0 must be a positive integer, or None for a full-rank wq"),
        ({"yarn": {"factor": 0.5, "original_max_position_embeddings": 16}}, "model.mla.yarn.factor=0.5 must be >= 1"),
        ({"yarn": {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 1.0}},
         "model.mla.yarn.beta_fast=1.0 and model.mla.yarn.beta_slow=1.0 must satisfy beta_fast > beta_slow > 0"),
    ],
)  # fmt: skip
def test_invalid_mla_config_names_option_value_and_what_is_valid(change, message):
    mla = dataclasses.replace(MLA, **change)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mla.validate()
    from lightning_ultrascale.models import Llama

    with pytest.raises(ConfigError, match=r"model\.mla\."):
        Llama(dataclasses.replace(TINY_MLA, mla=mla))


# ------------------------------------------------------------------------------------ context kernels
@pytest.mark.parametrize(
    ("method", "kernel"),
    [("ring", "reference"), ("ring", "flash"), ("zigzag_ring", "reference"), ("zigzag_ring", "flash"),
     ("all_to_all", "flash")],  # Ulysses always runs torch's SDPA on whole sequences
)  # fmt: skip
def test_context_attention_with_v_narrower_than_qk_equals_full_attention(method, kernel):
    # MLA's head sizes: q/k 24, v 16.
    errors = run_pooled(kernel_errors, 2, method, 12, 4, 4, kernel, 24, 16)
    assert max(max(e) for e in errors) < 1e-5, f"{method}/{kernel}: output/dq/dk/dv relative errors {errors}"


# ------------------------------------------------------------------------------------ parity
@pytest.fixture(scope="module")
def reference_sgd():
    return run_tiny_llama(SGD, model=TINY_MLA, steps=3)


LAYOUTS = {
    # tp2 without sequence parallelism: test_full_rank_query_under_tp_matches_one_process, whose
    # kv path (a replicated down-projection, its latent norm, a column-split up-projection) is how
    # tp shards the low-rank query's.
    "tp2-sp": (lambda: [TensorParallel(2, sequence_parallel=True)]),
    "cp2-ring": (lambda: [ContextParallel(2, "ring")]),
    "cp2-zigzag": (lambda: [ContextParallel(2, "zigzag_ring", kernel="flash")]),
    "cp2-all-to-all": (lambda: [ContextParallel(2, "all_to_all")]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mla_model_under_tp_and_cp_matches_one_process(reference_sgd, layout):
    run = run_tiny_llama(SGD, LAYOUTS[layout], 2, dp=1, model=TINY_MLA, steps=3)
    assert_parity(run, reference_sgd, rtol=1e-5)


def test_full_rank_query_under_tp_matches_one_process():
    cfg = dataclasses.replace(TINY_MLA, mla=dataclasses.replace(MLA, q_lora_rank=None), name="llama_tiny_mla_q")
    reference = run_tiny_llama(SGD, model=cfg, steps=3)
    run = run_tiny_llama(SGD, lambda: [TensorParallel(2, sequence_parallel=False)], 2, dp=1, model=cfg, steps=3)
    assert_parity(run, reference, rtol=1e-5)
