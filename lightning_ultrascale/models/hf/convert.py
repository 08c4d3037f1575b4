"""Convert configs and weights from and to Hugging Face ``transformers``.

The architecture-independent part: dispatch by architecture, key renames, expert splitting and
fusing, loading by shards. Each family's config translation is its own: ``models/llama/hf.py``
(Llama, Qwen2), ``models/mixtral/hf.py`` (Mixtral's experts), ``models/deepseek/hf.py`` (DeepSeek-V3),
``models/common/hf.py`` (the keys all spell alike).

Five architectures: ``LlamaForCausalLM`` (dense; ``Qwen2ForCausalLM`` with q/k/v biases),
``MixtralForCausalLM`` (softmax-routed experts), ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` (per-head
query/key norms, heads of their own width; the MoE one softmax-routed) and ``DeepseekV3ForCausalLM``
(multi-head latent attention, sigmoid group-limited router with its ``e_score_correction_bias``, shared
experts, dense first blocks; also Moonlight and other models saved as ``deepseek_v3``).
:func:`hf_architecture` says which one a config is.

Our RoPE uses HF's ``rotate_half`` layout (and MLA de-interleaves DeepSeek's rotary rows at run
time), so weights convert by renaming keys only: no permutation, no copy, except that HF fuses each
layer's expert gate and up projections into one ``gate_up_proj [E, 2I, H]`` that we keep as
``w1`` / ``w3`` (split as views, fused by one concatenation). ``transformers`` is imported only by
:func:`load_hf_pretrained`; the other functions work on plain configs and state dicts.

Example (fine-tune from a downloaded checkpoint):
    >>> from lightning_ultrascale.models.hf.convert import load_hf_pretrained, state_dict_to_hf
    >>> model = load_hf_pretrained("/models/Llama-3.2-1B")  # doctest: +SKIP
    >>> # ... train ...
    >>> hf_sd = state_dict_to_hf(model.state_dict(), model.config)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.common.decoder import Llama, LlamaConfig
from lightning_ultrascale.models.common.hf import hf_field
from lightning_ultrascale.models.common.mla import MLA_HF_NAMES
from lightning_ultrascale.models.deepseek.hf import deepseek_v3_from_hf, deepseek_v3_to_hf
from lightning_ultrascale.models.hf.parts import RankParts
from lightning_ultrascale.models.llama.hf import llama_from_hf, llama_to_hf
from lightning_ultrascale.models.mixtral.hf import mixtral_from_hf, mixtral_to_hf
from lightning_ultrascale.models.qwen3.hf import QWEN3_TYPES, qwen3_from_hf, qwen3_to_hf

log = logging.getLogger(__name__)

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "hf_architecture",
    "hf_file_tensors",
    "load_hf_pretrained",
    "load_hf_weights",
    "state_dict_from_hf",
    "state_dict_to_hf",
]

# (HF LlamaForCausalLM key, our key); "{}" stands for the layer index.
_KEY_PAIRS = (
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.layers.{}.input_layernorm.weight", "layers.{}.attention_norm.weight"),
    ("model.layers.{}.self_attn.q_proj.weight", "layers.{}.attention.wq.weight"),
    ("model.layers.{}.self_attn.k_proj.weight", "layers.{}.attention.wk.weight"),
    ("model.layers.{}.self_attn.v_proj.weight", "layers.{}.attention.wv.weight"),
    ("model.layers.{}.self_attn.o_proj.weight", "layers.{}.attention.wo.weight"),
    # Qwen2's q/k/v biases (LlamaConfig.qkv_bias).
    ("model.layers.{}.self_attn.q_proj.bias", "layers.{}.attention.wq.bias"),
    ("model.layers.{}.self_attn.k_proj.bias", "layers.{}.attention.wk.bias"),
    ("model.layers.{}.self_attn.v_proj.bias", "layers.{}.attention.wv.bias"),
    ("model.layers.{}.post_attention_layernorm.weight", "layers.{}.ffn_norm.weight"),
    ("model.layers.{}.mlp.gate_proj.weight", "layers.{}.feed_forward.w1.weight"),
    ("model.layers.{}.mlp.down_proj.weight", "layers.{}.feed_forward.w2.weight"),
    ("model.layers.{}.mlp.up_proj.weight", "layers.{}.feed_forward.w3.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
    # Mixture of experts (MixtralForCausalLM, DeepseekV3ForCausalLM). HF fuses each expert's gate
    # and up projections into one [E, 2I, H] tensor: :func:`_split_experts` unfuses it into the
    # two pseudo keys below first (views, no copy), :func:`_fuse_experts` fuses them back.
    ("model.layers.{}.mlp.gate.weight", "layers.{}.feed_forward.router.weight"),
    ("model.layers.{}.mlp.gate.e_score_correction_bias", "layers.{}.feed_forward.router.expert_bias"),
    ("model.layers.{}.mlp.experts.gate_proj", "layers.{}.feed_forward.experts.w1"),
    ("model.layers.{}.mlp.experts.up_proj", "layers.{}.feed_forward.experts.w3"),
    ("model.layers.{}.mlp.experts.down_proj", "layers.{}.feed_forward.experts.w2"),
    ("model.layers.{}.mlp.shared_experts.gate_proj.weight", "layers.{}.feed_forward.shared_experts.w1.weight"),
    ("model.layers.{}.mlp.shared_experts.down_proj.weight", "layers.{}.feed_forward.shared_experts.w2.weight"),
    ("model.layers.{}.mlp.shared_experts.up_proj.weight", "layers.{}.feed_forward.shared_experts.w3.weight"),
    # Multi-head latent attention (DeepseekV3ForCausalLM); q_proj and o_proj are the pairs above.
    *(
        (f"model.layers.{{}}.self_attn.{hf}.weight", f"layers.{{}}.attention.{ours}.weight")
        for ours, hf in MLA_HF_NAMES.items()
        if ours not in ("wq", "wo")
    ),
)
# DeepSeek-V3's multi-token-prediction layers (``model.layers.{n_layers + k}``, LlamaConfig.mtp_depth): the block's keys
# are the pairs above; its own norms and projection; ``shared_head.norm`` is the norm before the shared head.
_MTP_PAIRS = (
    ("model.layers.{}.enorm.weight", "layers.{}.enorm.weight"),
    ("model.layers.{}.hnorm.weight", "layers.{}.hnorm.weight"),
    ("model.layers.{}.eh_proj.weight", "layers.{}.eh_proj.weight"),
    ("model.layers.{}.shared_head.norm.weight", "layers.{}.post_norm.weight"),
)
_KEY_PAIRS = _KEY_PAIRS + _MTP_PAIRS
# Qwen3's per-head query and key norms (LlamaConfig.qk_norm): our ``attention.q_norm`` is MLA's latent query norm
# (HF ``q_a_layernorm``) in a DeepSeek model, so these pairs apply to qk_norm models only (:func:`_key_pairs`).
_QK_NORM_PAIRS = (
    ("model.layers.{}.self_attn.q_norm.weight", "layers.{}.attention.q_norm.weight"),
    ("model.layers.{}.self_attn.k_norm.weight", "layers.{}.attention.k_norm.weight"),
)


def _key_pairs(cfg: LlamaConfig) -> list[tuple[str, str]]:
    """(HF key, our key) of ``cfg``'s architecture (the first pair that matches a key renames it)."""
    return [*(_QK_NORM_PAIRS if cfg.qk_norm else ()), *_KEY_PAIRS]


#: What DeepSeek's checkpoints store again in each MTP layer: copies of the shared embedding and head.
_MTP_COPIES = (("embed_tokens.weight", "tok_embeddings.weight"), ("shared_head.head.weight", "output.weight"))
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)gate_up_proj")
# Older HF checkpoints saved the RoPE frequencies; they are recomputed from the config.
_HF_IGNORED = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


#: transformers ``model_type`` of each model class we convert.
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def hf_architecture(cfg: LlamaConfig) -> tuple[str, str]:
    """The transformers ``(config class, model class)`` of ``cfg``: Llama (Qwen2), Mixtral, Qwen3 or DeepSeek-V3.

    Raises :class:`ConfigError` for an architecture none of them has (e.g. DeepSeek-V2's softmax
    router with MLA, or MLA in a dense model).

    Example:
        >>> from lightning_ultrascale.models import get_model_config
        >>> hf_architecture(get_model_config("mixtral_8x7b"))
        ('MixtralConfig', 'MixtralForCausalLM')
        >>> hf_architecture(get_model_config("deepseek_v3"))
        ('DeepseekV3Config', 'DeepseekV3ForCausalLM')
        >>> hf_architecture(get_model_config("qwen3_30b_a3b"))
        ('Qwen3MoeConfig', 'Qwen3MoeForCausalLM')
    """
    moe = cfg.moe
    if cfg.attention_head_dim is not None and not cfg.qk_norm:
        raise ConfigError(
            f"model {cfg.name}: heads of their own width (attention_head_dim) without per-head query/key norms have "
            "no Hugging Face counterpart we convert; valid: qk_norm=true (Qwen3), or attention_head_dim=null"
        )
    if cfg.mtp_depth and not (moe is not None and cfg.mla is not None and moe.router == "sigmoid"):
        raise ConfigError(
            f"model {cfg.name} with mtp_depth={cfg.mtp_depth}: multi-token prediction layers have a Hugging Face "
            "counterpart in DeepSeek-V3 only (MLA with a sigmoid router); valid: mtp_depth=0 for this architecture"
        )
    if cfg.qk_norm:
        return _qwen3_architecture(cfg)
    if moe is None and cfg.mla is None:
        return ("Qwen2Config", "Qwen2ForCausalLM") if cfg.qkv_bias else ("LlamaConfig", "LlamaForCausalLM")
    if cfg.qkv_bias:
        raise ConfigError(f"model {cfg.name}: q/k/v biases convert as Qwen2 (dense, standard attention) only")
    if moe is not None and cfg.mla is None:
        mixtral = moe.router == "softmax" and moe.norm_topk_prob and moe.routed_scaling_factor == 1.0
        if mixtral and not (moe.n_shared_experts or moe.first_k_dense or moe.n_group > 1):
            return "MixtralConfig", "MixtralForCausalLM"
    if moe is not None and cfg.mla is not None and moe.router == "sigmoid" and moe.first_k_dense < cfg.n_layers:
        return "DeepseekV3Config", "DeepseekV3ForCausalLM"
    raise ConfigError(
        f"model {cfg.name} has no Hugging Face counterpart we convert: Mixtral (softmax router, normalised "
        "top-k, no shared experts, dense blocks or expert groups, standard attention) and DeepSeek-V3 (MLA "
        "with a sigmoid router and at least one MoE block) do; DeepSeek-V2 (MLA with a softmax router) "
        "does not yet"
    )


def _qwen3_architecture(cfg: LlamaConfig) -> tuple[str, str]:
    """Qwen3 (dense) or Qwen3-MoE: per-head query/key norms, no q/k/v biases; the experts softmax-routed, in every
    block, none shared, no expert groups, no scaling."""
    moe = cfg.moe
    if cfg.qkv_bias:
        raise ConfigError(f"model {cfg.name}: Qwen3 (qk_norm) has no q/k/v biases; valid: qkv_bias=false")
    if moe is None:
        return "Qwen3Config", "Qwen3ForCausalLM"
    qwen3 = moe.router == "softmax" and moe.routed_scaling_factor == 1.0 and moe.n_group == 1
    if qwen3 and not (moe.n_shared_experts or moe.first_k_dense):
        return "Qwen3MoeConfig", "Qwen3MoeForCausalLM"
    raise ConfigError(
        f"model {cfg.name}: Qwen3-MoE (qk_norm) routes with a softmax over every expert of every block (no shared "
        "experts, dense first blocks, expert groups or routed_scaling_factor); this MoE has no Hugging Face counterpart"
    )


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """Keyword arguments of ``transformers.LlamaConfig`` (Mixtral MoE: ``MixtralConfig``) for the same architecture.

    Uses the ``rope_theta`` / ``rope_scaling`` spelling, which transformers 4.x reads and 5.x
    converts to its ``rope_parameters``.

    Example:
        >>> import transformers
        >>> from lightning_ultrascale.models import get_model_config
        >>> hf_config = transformers.LlamaConfig(**config_to_hf(get_model_config("llama3_8b")))
        >>> hf_config.num_key_value_heads
        8
    """
    architecture = hf_architecture(cfg)[0]
    if architecture == "DeepseekV3Config":
        return deepseek_v3_to_hf(cfg)
    if architecture in ("Qwen3Config", "Qwen3MoeConfig"):
        return llama_to_hf(cfg) | qwen3_to_hf(cfg)
    return llama_to_hf(cfg) | mixtral_to_hf(cfg)


def hf_config_json(cfg: LlamaConfig, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of ``cfg``'s HF model directory, its weights stored in ``dtype`` (``"float32"``, ...)."""
    model_class = hf_architecture(cfg)[1]
    return {
        **config_to_hf(cfg),
        "architectures": [model_class],
        "model_type": MODEL_TYPES[model_class],
        "torch_dtype": dtype,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def _check_supported(hf_config: Any, deepseek_v3: bool, qwen3: bool) -> None:
    """Refuse what our models do not have: biases (but Qwen2's q/k/v ones), another activation, a head_dim
    other than dim / n_heads (but Qwen3's), sliding windows."""
    unsupported = {
        "use_sliding_window": (getattr(hf_config, "use_sliding_window", False), False),
        "hidden_act": (getattr(hf_config, "hidden_act", "silu"), "silu"),
        "attention_bias": (getattr(hf_config, "attention_bias", False), False),
        "mlp_bias": (getattr(hf_config, "mlp_bias", False), False),
    }
    head_dim = getattr(hf_config, "head_dim", None)
    # DeepseekV3Config's head_dim is its rotary width; Qwen3's heads have a width of their own
    if head_dim is not None and not (deepseek_v3 or qwen3):
        unsupported["head_dim"] = (head_dim, hf_config.hidden_size // hf_config.num_attention_heads)
    for option, (value, supported) in unsupported.items():
        if value != supported:
            raise ConfigError(f"hf {option}={value!r} is not supported; valid: {supported!r}")


def config_from_hf(hf_config: Any, name: str | None = None) -> LlamaConfig:
    """Our :class:`LlamaConfig` from a transformers Llama (Qwen2), Mixtral, Qwen3 or DeepSeek-V3 config (4.x or 5.x).

    Raises :class:`ConfigError` for features our models do not have (biases, another activation,
    a head_dim other than dim / n_heads, a RoPE type other than default, llama3 or, with MLA, yarn).
    A DeepSeek-V3 config gets DeepSeek-V3's balancing settings (sequence-wise aux loss 1e-4,
    aux-loss-free bias step 1e-3), which its ``config.json`` does not record.

    Example:
        >>> import transformers
        >>> hf_config = transformers.AutoConfig.from_pretrained("/models/Llama-3.1-8B")  # doctest: +SKIP
        >>> config_from_hf(hf_config, name="llama3_8b").n_layers  # doctest: +SKIP
        32
    """
    _check_model_type(getattr(hf_config, "model_type", None), "hf config")
    deepseek_v3 = getattr(hf_config, "kv_lora_rank", None) is not None
    qwen3 = getattr(hf_config, "model_type", None) in QWEN3_TYPES
    _check_supported(hf_config, deepseek_v3, qwen3)
    moe, mla, head_dim = None, None, None
    if qwen3:
        (rope_theta, scaling), (head_dim, moe) = llama_from_hf(hf_config), qwen3_from_hf(hf_config)
    elif deepseek_v3:
        moe, mla = deepseek_v3_from_hf(hf_config)
        rope = hf_field(hf_config, "rope_parameters", default={})
        rope_theta, scaling = rope.get("rope_theta", hf_field(hf_config, "rope_theta", default=10000.0)), None
    else:
        (rope_theta, scaling), moe = llama_from_hf(hf_config), mixtral_from_hf(hf_config)
    return LlamaConfig(
        moe=moe,
        mla=mla,
        dim=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        vocab_size=hf_config.vocab_size,
        ffn_hidden_dim=hf_config.intermediate_size,
        norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        max_seq_len=hf_config.max_position_embeddings,
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        qkv_bias=getattr(hf_config, "model_type", None) == "qwen2",
        qk_norm=qwen3,
        attention_head_dim=head_dim,
        name=name or getattr(hf_config, "name_or_path", "") or "hf_llama",
    )


def _rename(sd: dict[str, Tensor], pairs: list[tuple[str, str]], ignore: re.Pattern[str] | None) -> dict[str, Tensor]:
    rules = [(re.compile(re.escape(src).replace(r"\{\}", r"(\d+)")), dst) for src, dst in pairs]
    out: dict[str, Tensor] = {}
    unknown = []
    for key, value in sd.items():
        for pattern, dst in rules:
            m = pattern.fullmatch(key)
            if m:
                out[dst.format(*m.groups())] = value
                break
        else:
            if ignore is None or not ignore.fullmatch(key):
                unknown.append(key)
    if unknown:
        raise KeyError(f"no Llama counterpart for {len(unknown)} key(s): {', '.join(unknown[:5])}")
    return out


def _our_keys(cfg: LlamaConfig) -> set[str]:
    """Every key of our state dict for ``cfg`` (a meta build: no memory)."""
    with torch.device("meta"):
        return set(Llama(cfg).state_dict().keys())


def _check_complete(sd: dict[str, Tensor], expected: set[str], cfg: LlamaConfig, where: str) -> None:
    missing = sorted(expected - sd.keys())
    if missing:
        raise KeyError(f"{where} misses {len(missing)} key(s) for n_layers={cfg.n_layers}: {', '.join(missing[:5])}")
    extra = sorted(sd.keys() - expected)
    if extra:  # (e.g. MLA's latent projections for a config without MLA: dropped, the model would differ)
        raise KeyError(f"{where} holds {len(extra)} key(s) model {cfg.name} has no place for: {', '.join(extra[:5])}")


def _split_experts(hf_sd: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for key, value in hf_sd.items():
        m = _FUSED.fullmatch(key)
        if m:
            out[m.group(1) + "gate_proj"], out[m.group(1) + "up_proj"] = value.chunk(2, dim=1)
        else:
            out[key] = value
    return out


def _fused_key(key: str) -> str:
    """The HF key a (pseudo) key ends up in: an expert's gate and up projections share ``gate_up_proj``."""
    for half in ("gate_proj", "up_proj"):
        if key.endswith(f"mlp.experts.{half}"):
            return key[: -len(half)] + "gate_up_proj"
    return key


def _fuse_experts(hf_sd: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for key, value in hf_sd.items():
        if key.endswith("mlp.experts.up_proj"):
            continue
        if key.endswith("mlp.experts.gate_proj"):
            out[_fused_key(key)] = torch.cat((value, hf_sd[key[: -len("gate_proj")] + "up_proj"]), dim=1)
        else:
            out[key] = value
    return out


def _softmax_router(cfg: LlamaConfig) -> bool:
    """Mixtral's router, which has no selection bias in HF's checkpoints."""
    return cfg.moe is not None and cfg.moe.router == "softmax"


def state_dict_from_hf(hf_sd: dict[str, Tensor], cfg: LlamaConfig) -> dict[str, Tensor]:
    """Rename an HF ``LlamaForCausalLM`` state dict to ours (same tensors, no copy).

    With tied embeddings a missing ``lm_head.weight`` (as ``save_pretrained`` writes it) becomes
    ``output.weight`` = the embedding, as in our own state dicts.

    Example:
        >>> from lightning_ultrascale.models import Llama
        >>> sd = state_dict_from_hf(hf_model.state_dict(), cfg)  # doctest: +SKIP
        >>> Llama(cfg).load_state_dict(sd)  # doctest: +SKIP
    """
    hf_sd = _check_mtp_copies(hf_sd, cfg)
    sd = _rename(_split_experts(hf_sd), _key_pairs(cfg), ignore=_HF_IGNORED)
    if cfg.tie_embeddings and "tok_embeddings.weight" in sd:
        sd.setdefault("output.weight", sd["tok_embeddings.weight"])
    expected = _our_keys(cfg)
    if _softmax_router(cfg):
        for key in expected - sd.keys():
            if key.endswith("router.expert_bias"):
                sd[key] = torch.zeros(cfg.n_experts)
    _check_complete(sd, expected, cfg, "the HF state dict")
    return sd


def state_dict_to_hf(sd: dict[str, Tensor], cfg: LlamaConfig) -> dict[str, Tensor]:
    """Rename our state dict to HF ``LlamaForCausalLM`` keys (same tensors, no copy).

    Example:
        >>> hf_model.load_state_dict(state_dict_to_hf(model.state_dict(), model.config))  # doctest: +SKIP
    """
    if _softmax_router(cfg):
        biases = {k: v for k, v in sd.items() if k.endswith("router.expert_bias")}
        if any(bool(v.any()) for v in biases.values()):
            raise ConfigError(
                "a softmax (Mixtral) router with a non-zero expert_bias has no HF counterpart; "
                "export with model.moe.bias_update_rate=0 or a sigmoid (DeepSeek-V3) router"
            )
        sd = {k: v for k, v in sd.items() if k not in biases}
    pairs = [(ours, hf) for hf, ours in _key_pairs(cfg)]
    hf_sd = _fuse_experts(_rename(sd, pairs, ignore=None))
    if cfg.tie_embeddings and "model.embed_tokens.weight" in hf_sd:
        hf_sd.setdefault("lm_head.weight", hf_sd["model.embed_tokens.weight"])
    ours = {k for k in _our_keys(cfg) if not (_softmax_router(cfg) and k.endswith("router.expert_bias"))}
    expected = {_fused_key(k) for k in _rename({k: k for k in ours}, pairs, ignore=None)}
    _check_complete(hf_sd, expected, cfg, "our state dict")
    for hf, key in _mtp_copy_names(cfg).items():  # as DeepSeek's checkpoints hold them
        hf_sd[hf] = sd[key]
    return hf_sd


def _mtp_copy_names(cfg: LlamaConfig) -> dict[str, str]:
    """HF name -> our key of the embedding and head copies in each MTP layer of ``cfg``'s checkpoint."""
    layers = range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth)
    return {f"model.layers.{i}.{hf}": ours for i in layers for hf, ours in _MTP_COPIES}


def _check_mtp_copies(hf_sd: dict[str, Tensor], cfg: LlamaConfig) -> dict[str, Tensor]:
    """``hf_sd`` without the MTP layers' copies of the embedding and head, each checked equal to the model's (ours
    shares them: a copy that differs would be dropped silently)."""
    copies = _mtp_copy_names(cfg)
    main = {"tok_embeddings.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    for hf, ours in copies.items():
        if hf not in hf_sd:
            continue  # (a checkpoint that stores them once)
        reference = hf_sd.get(main[ours], hf_sd.get("model.embed_tokens.weight"))
        if reference is None or not torch.equal(hf_sd[hf], reference):
            raise ConfigError(
                f"the HF state dict's {hf} differs from the model's {main[ours]}: our multi-token prediction shares "
                "the embedding and the head; valid: a checkpoint whose MTP copies equal them"
            )
    return {k: v for k, v in hf_sd.items() if k not in copies}


def load_hf_pretrained(path_or_model: str | os.PathLike[str] | nn.Module) -> Llama:
    """Our :class:`Llama` holding the weights of an HF Llama, Qwen2, Mixtral, Qwen3 or DeepSeek-V3 model or directory.

    A directory (``config.json`` + safetensors) is read with the architecture's
    ``from_pretrained(path, local_files_only=True)``: no download; fetch it first,
    e.g. with ``huggingface-cli download meta-llama/Llama-3.2-1B --local-dir ...``. The weights
    keep the checkpoint's dtype (cast with ``.float()`` for fp32 master weights) and are shared
    with the HF model, not copied. ``config.name`` is the HF ``name_or_path``.

    Example:
        >>> model = load_hf_pretrained("/models/Llama-3.2-1B")  # doctest: +SKIP
        >>> model.config.tie_embeddings, model.spec.n_layers  # doctest: +SKIP
        (True, 16)
    """
    if isinstance(path_or_model, (str, os.PathLike)):
        import transformers

        model_class = hf_architecture(hf_directory_config(path_or_model))[1]
        hf_model = getattr(transformers, model_class).from_pretrained(path_or_model, local_files_only=True)
    else:
        hf_model = path_or_model
    cfg = config_from_hf(hf_model.config)
    # Meta build + assign: no second allocation, no throw-away random init of billions of weights.
    with torch.device("meta"):
        model = Llama(cfg)
    model.load_state_dict(state_dict_from_hf(hf_model.state_dict(), cfg), assign=True)
    model.init_buffers()
    model.tie_weights()
    return model


#: The shape of an architecture: what an HF checkpoint and our config must agree on to load.
#: Our expert weights -> their names in an HF checkpoint's files, per architecture.
_FILE_EXPERTS = {
    "MixtralForCausalLM": ("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"}),
    "Qwen3MoeForCausalLM": ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
    "DeepseekV3ForCausalLM": ("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
}
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.\w+")


def hf_file_tensors(cfg: LlamaConfig) -> dict[str, tuple[str, int | None]]:
    """Each tensor in the safetensors files of ``cfg``'s HF checkpoint -> (our state-dict key, expert).

    Files keep the layout the models were released in (and ``save_pretrained`` writes): one 2D
    tensor per expert and projection (Mixtral ``block_sparse_moe.experts.{j}.w1.weight``,
    DeepSeek-V3 ``mlp.experts.{j}.gate_proj.weight``), which transformers fuses only when it loads.
    ``expert`` is ``j``, the index into our stacked ``[E, ...]`` weight, or None for the rest. A
    tied output head is saved once, as the embedding; a softmax (Mixtral) router's ``expert_bias``
    has no HF tensor.

    Example:
        >>> from lightning_ultrascale.models import get_model_config
        >>> hf_file_tensors(get_model_config("mixtral_8x7b"))["model.layers.0.block_sparse_moe.experts.7.w3.weight"]
        ('layers.0.feed_forward.experts.w3', 7)
    """
    ours = [
        k for k in _our_keys(cfg)
        if not (_softmax_router(cfg) and k.endswith("router.expert_bias"))
        and not (cfg.tie_embeddings and k == "output.weight")
    ]  # fmt: skip
    renamed = _rename({k: k for k in ours}, [(o, h) for h, o in _key_pairs(cfg)], ignore=None)
    copies: dict[str, tuple[str, int | None]] = {hf: (our, None) for hf, our in _mtp_copy_names(cfg).items()}
    if cfg.tie_embeddings:
        copies = {hf: ("tok_embeddings.weight", None) for hf in copies}
    if cfg.moe is None:
        return {hf: (our, None) for hf, our in sorted(renamed.items())} | copies
    block, names = _FILE_EXPERTS[hf_architecture(cfg)[1]]
    out: dict[str, tuple[str, int | None]] = {}
    for hf, our in sorted(renamed.items()):
        m = _EXPERTS.fullmatch(hf)
        if m:
            name = names[our.rsplit(".", 1)[1]]
            for j in range(cfg.n_experts):
                out[f"model.layers.{m.group(1)}.{block}.experts.{j}.{name}.weight"] = (our, j)
        else:
            out[hf.replace(".mlp.gate.", f".{block}.gate.")] = (our, None)
    return out | copies


def hf_directory_config(path: str | os.PathLike[str], option: str | None = None) -> LlamaConfig:
    """Our config of an HF model directory, from its ``config.json`` alone (no transformers needed).

    ``option``: how errors name the setting that gave ``path`` (default ``model.init_from=hf:PATH``).
    """
    where = option or f"model.init_from=hf:{path}"
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{where}: {config_file} not found; valid: an HF model directory")
    defaults = {"tie_word_embeddings": False, "num_key_value_heads": None, "max_position_embeddings": 2048}
    fields = {**defaults, **json.loads(config_file.read_text())}
    _check_model_type(fields.get("model_type"), where)
    config = config_from_hf(SimpleNamespace(**fields), name=Path(path).name)
    depth = int(fields.get("num_nextn_predict_layers") or 0) if config.mla is not None else 0
    if depth:
        from lightning_ultrascale.models.hf.files import file_keys

        if f"model.layers.{config.n_layers}.eh_proj.weight" not in file_keys(path):
            log.warning(
                "%s: config.json names %d multi-token-prediction layer(s) that its files do not hold (as "
                "transformers' save_pretrained writes DeepSeek-V3): read without them (mtp_depth=0)",
                where,
                depth,
            )
            depth = 0
    return dataclasses.replace(config, mtp_depth=depth)


def _check_loaded_copies(
    path: str | os.PathLike[str], copies: dict[str, str], files: dict[str, tuple[str, int | None]], loaded: dict
) -> None:
    """Read the MTP layers' copies of the embedding and head a directory holds (this rank's parts) and refuse
    one that differs from what was loaded as the model's own (ours shares them)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    from lightning_ultrascale.models.hf.files import file_keys

    main = {key: hf for hf, (key, expert) in files.items() if hf not in copies and expert is None}
    present = set(file_keys(path))
    wanted = {
        hf: torch.empty_like(loaded[main[key]]) for hf, key in copies.items() if hf in present and main[key] in loaded
    }
    if not wanted:
        return
    load(wanted, storage_reader=HuggingFaceStorageReader(str(path)))
    for hf, value in wanted.items():
        if not torch.equal(value, loaded[main[copies[hf]]]):
            raise ConfigError(
                f"model.init_from=hf:{path}: {hf} differs from the model's {main[copies[hf]]}: our multi-token "
                "prediction shares the embedding and the head; valid: a checkpoint whose MTP copies equal them"
            )


def _check_model_type(model_type: Any, where: str) -> None:
    if model_type not in MODEL_TYPES.values():
        raise ConfigError(
            f"{where} holds a model_type={model_type!r} model; valid: {', '.join(map(repr, MODEL_TYPES.values()))} "
            f"({', '.join(MODEL_TYPES)})"
        )


@torch.no_grad()
def load_hf_weights(model: Llama, path: str | os.PathLike[str]) -> None:
    """Copy an HF safetensors directory's weights into ``model`` through DCP, in any layout.

    Each rank reads only what it holds (a tensor-parallel, FSDP or expert-parallel shard, a pipeline
    stage's parameters): nothing is gathered. Expert weights are stored one expert per tensor
    (:func:`hf_file_tensors`): a rank reads just the experts it holds, straight into its shard.
    The directory's architecture must be the model's.

    Example:
        >>> load_hf_weights(model, "/models/Llama-3.2-1B")  # doctest: +SKIP
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    try:
        import safetensors  # noqa: F401  (DCP's HF reader opens the files with it)
    except ImportError:
        raise ConfigError(f"model.init_from=hf:{path} needs the safetensors package: pip install safetensors") from None
    theirs, ours = hf_directory_config(path), model.config
    wrong = theirs.architecture_differences(ours)
    if wrong:
        raise ConfigError(f"model.init_from=hf:{path} is another architecture: {', '.join(wrong)}")
    held = {n: p.detach() for n, p in model.named_parameters()}
    held |= {n: b for n, b in model.named_buffers() if n.endswith("router.expert_bias")}
    part = RankParts(held)
    copies = _mtp_copy_names(ours)
    files = hf_file_tensors(ours)
    targets = {
        hf: t for hf, (key, expert) in files.items() if hf not in copies and (t := part(key, expert)) is not None
    }
    load(targets, storage_reader=HuggingFaceStorageReader(str(path)))
    if copies:
        _check_loaded_copies(path, copies, files, targets)
