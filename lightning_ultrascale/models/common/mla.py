"""Multi-head latent attention (MLA) of DeepSeek-V2 / V3, with its tensor-parallel plan.

Keys and values are rebuilt per head from one small latent per token (``kv_lora_rank``, the
only thing an inference cache keeps) plus one rotary key shared by all heads; queries optionally
go through a latent too (``q_lora_rank``). Module names are torchtitan's::

    wq                       (full-rank query, q_lora_rank=None: DeepSeek-V2-Lite)
    wq_a -> q_norm -> wq_b   (low-rank query)
    wkv_a -> [kv_norm -> wkv_b | rotary key]
    wo

:data:`MLA_HF_NAMES` maps them to HF's ``DeepseekV3Attention``. DeepSeek's checkpoints (HF
``rope_interleave=True``) store the rotary rows of ``q_b_proj`` / ``kv_a_proj_with_mqa`` with
pairs interleaved (``2i`` with ``2i+1``); :class:`MLAttention` de-interleaves the rotary slices at
run time (a copy of ``qk_rope_head_dim`` columns), then rotates in the model's ``rotate_half``
layout. So conversion from and to HF is a pure rename, and our weights ARE DeepSeek's weights; an
HF config with ``rope_interleave=False`` would need the rows permuted instead.

Example:
    >>> import torch
    >>> from dataclasses import replace
    >>> from lightning_ultrascale.models import build_model, get_model_config
    >>> mla = MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=48)
    >>> model = build_model(replace(get_model_config("llama_tiny"), mla=mla), seed=0)
    >>> model(torch.randint(0, 320, (2, 16))).shape
    torch.Size([2, 16, 320])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from lightning_ultrascale.errors import ConfigError, is_positive_int
from lightning_ultrascale.kernels.reference import apply_rope
from lightning_ultrascale.models.common.layers import RMSNorm, causal_attention

if TYPE_CHECKING:
    from lightning_ultrascale.models.common.decoder import LlamaConfig

__all__ = [
    "MLA_HF_NAMES",
    "MLAConfig",
    "MLAttention",
    "YarnScaling",
    "mla_inv_freq",
    "mla_num_params",
    "mla_tp_plan",
]

#: eps of the latent norms ``q_norm`` / ``kv_norm``: 1e-6 whatever ``norm_eps`` is, as in DeepSeek's
#: reference code and HF's ``DeepseekV3Attention`` (DeepSeek-V2-Lite's blocks use 1e-6 too, Moonlight 1e-5).
LATENT_NORM_EPS = 1e-6

#: Our attention sub-module names -> HF ``DeepseekV3Attention``'s (a checkpoint has ``wq`` or the
#: ``wq_a``/``q_norm``/``wq_b`` trio, never both).
MLA_HF_NAMES: dict[str, str] = {
    "wq": "q_proj",
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
    "wo": "o_proj",
}


def _yarn_mscale(factor: float, mscale: float) -> float:
    # YaRN's attention temperature sqrt(1/t) = 0.1 ln(s) + 1 (Peng et al. 2023, eq. 22), weighted.
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling as DeepSeek configures it (HF ``rope_type: yarn``).

    Frequencies that turn more than ``beta_fast`` times over ``original_max_position_embeddings``
    tokens are kept, those turning fewer than ``beta_slow`` times are divided by ``factor``, with a
    linear ramp between. ``mscale`` / ``mscale_all_dim`` say where YaRN's attention temperature goes
    (HF's rules: :attr:`rope_factor`, :attr:`softmax_factor`); DeepSeek sets them equal, which puts
    all of it on the softmax scale.

    Example:
        >>> y = YarnScaling(factor=40, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
        >>> y.rope_factor, round(y.softmax_factor, 4)  # DeepSeek-V3
        (1.0, 1.8739)
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None

    @property
    def rope_factor(self) -> float:
        """Multiplier of cos and sin (so of the rotary logits, squared): HF's ``attention_factor``."""
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor, 1.0)

    @property
    def softmax_factor(self) -> float:
        """Multiplier of the softmax scale ``1/sqrt(qk_head_dim)``: HF's ``yarn_apply_mscale``."""
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Shapes of multi-head latent attention; ``yarn`` may be given as a mapping (from YAML).

    Example:
        >>> MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        ...           q_lora_rank=1536).qk_head_dim  # DeepSeek-V3
        192
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    yarn: YarnScaling | None = None

    def __post_init__(self) -> None:
        if isinstance(self.yarn, Mapping):
            object.__setattr__(self, "yarn", YarnScaling(**self.yarn))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self, prefix: str = "model.mla") -> None:
        """Raise :class:`ConfigError` naming the first setting (as ``{prefix}.name``) that cannot work.

        Example:
            >>> MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=7, v_head_dim=16).validate()
            Traceback (most recent call last):
            ...
            lightning_ultrascale.errors.ConfigError: model.mla.qk_rope_head_dim=7 must be even (RoPE rotates pairs)
        """
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ConfigError(f"{prefix}.{name}={value!r} must be a positive integer")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{prefix}.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        q = self.q_lora_rank
        if q is not None and not is_positive_int(q):
            raise ConfigError(f"{prefix}.q_lora_rank={q!r} must be a positive integer, or None for a full-rank wq")
        y = self.yarn
        if y is None:
            return
        if not y.factor >= 1:
            raise ConfigError(f"{prefix}.yarn.factor={y.factor!r} must be >= 1 (the context extension ratio)")
        if not is_positive_int(y.original_max_position_embeddings):
            raise ConfigError(
                f"{prefix}.yarn.original_max_position_embeddings={y.original_max_position_embeddings!r} "
                "must be a positive integer"
            )
        if not y.beta_fast > y.beta_slow > 0:
            raise ConfigError(
                f"{prefix}.yarn.beta_fast={y.beta_fast!r} and {prefix}.yarn.beta_slow={y.beta_slow!r} "
                "must satisfy beta_fast > beta_slow > 0"
            )
        for name in ("mscale", "mscale_all_dim"):
            value = getattr(y, name)
            if value is not None and not value >= 0:
                raise ConfigError(f"{prefix}.yarn.{name}={value!r} must be >= 0, or None")


def _mla(cfg: LlamaConfig) -> MLAConfig:
    if cfg.mla is None:
        raise ValueError(f"model {cfg.name} has no MLA (LlamaConfig.mla is None)")
    return cfg.mla


def mla_inv_freq(cfg: LlamaConfig, device: torch.device | str | None = None) -> Tensor:
    """RoPE inverse frequencies ``[qk_rope_head_dim // 2]`` in fp32, with YaRN if configured.

    Same arithmetic as HF's ``_compute_yarn_parameters`` (correction range truncated to whole
    dimensions), so logits match HF's.

    Example:
        >>> from dataclasses import replace
        >>> from lightning_ultrascale.models import get_model_config
        >>> mla = MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        ...                 yarn={"factor": 4.0, "original_max_position_embeddings": 64})
        >>> mla_inv_freq(replace(get_model_config("llama_tiny"), mla=mla)).shape
        torch.Size([4])
    """
    mla = _mla(cfg)
    dim, base = mla.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    y = mla.yarn
    if y is None:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, device=device).float() - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _deinterleave(x: Tensor) -> Tensor:
    # DeepSeek's rotary pairs (2i, 2i+1) -> the rotate_half pairs (i, i + d/2).
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """Causal multi-head latent attention: ``forward(x [b, s, dim], cos, sin) -> [b, s, dim]``.

    ``cos``/``sin`` are ``[b, 1, s, qk_rope_head_dim]`` in ``rotate_half`` layout, from
    :func:`mla_inv_freq`. Heads are read from the projections' outputs, so a tensor-parallel rank
    holding a slice of the heads runs unchanged. ``attention_fn(q, k, v)`` gets
    ``q, k [b, heads, s, qk_head_dim]`` and ``v [b, heads, s, v_head_dim]`` and must use the
    default scale ``1/sqrt(qk_head_dim)``: YaRN's extra softmax factor is folded into ``q``, so
    context parallelism swaps in ring / all-to-all attention with no MLA-specific argument.
    ``documents`` (``document_ids [b, s]``) keeps attention inside each packed document.

    Example:
        >>> import torch
        >>> from dataclasses import replace
        >>> from lightning_ultrascale.models import get_model_config
        >>> mla = MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        >>> cfg = replace(get_model_config("llama_tiny"), mla=mla)
        >>> attention = MLAttention(cfg)
        >>> freqs = torch.arange(10.0)[None, :, None] * mla_inv_freq(cfg)
        >>> angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        >>> attention(torch.randn(2, 10, 64), angles.cos(), angles.sin()).shape
        torch.Size([2, 10, 64])
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        mla = _mla(cfg)
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        heads = cfg.n_heads
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if mla.q_lora_rank is None:
            self.wq = nn.Linear(cfg.dim, heads * mla.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.dim, mla.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * mla.v_head_dim, cfg.dim, bias=False)
        # The rotary key, one per token, is shared by every head, so a tensor-parallel rank holding
        # some heads gets only their part of its gradient: mla_tp_plan sums the parts here.
        self.shared_k_rot = nn.Identity()
        self.rope_factor = 1.0 if mla.yarn is None else mla.yarn.rope_factor
        self.q_scale = 1.0 if mla.yarn is None else mla.yarn.softmax_factor
        self.attention_fn: Callable[[Tensor, Tensor, Tensor], Tensor] = causal_attention

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, documents: Tensor | None = None) -> Tensor:
        b, s, _ = x.shape
        if self.wq is not None:
            q = self.wq(x)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rot = (
            q.view(b, s, -1, self.nope_dim + self.rope_dim)
            .transpose(1, 2)
            .split([self.nope_dim, self.rope_dim], dim=-1)
        )
        latent, k_rot = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        if self.rope_factor != 1.0:
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        q_rot = apply_rope(_deinterleave(q_rot), cos, sin)
        k_rot = apply_rope(_deinterleave(k_rot[:, None]), cos, sin)  # one rotary key for every head
        q = torch.cat((q_nope, q_rot), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat((k_nope, self.shared_k_rot(k_rot).expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        out = self.attention_fn(q, k, v) if documents is None else self.attention_fn(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class _SumGradOverRanks(ParallelStyle):
    """Megatron's ``f`` on a module's inputs: identity forward, gradients summed over the mesh backward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod: nn.Module, inputs: tuple[Tensor, ...], mesh: DeviceMesh) -> tuple[Tensor, ...]:
            return tuple(
                DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
                for t in inputs
            )

        return distribute_module(module, device_mesh, input_fn=input_fn)


def mla_tp_plan(residual: Placement, mla: MLAConfig) -> dict[str, ParallelStyle]:
    """Tensor-parallel entries of an MLA block's attention, relative to the block (torchtitan's split).

    The up projections (``wq`` or ``wq_b``, ``wkv_b``) split heads (column-parallel), ``wo`` splits
    rows and reduces into the ``residual`` layout (``Shard(1)`` under sequence parallelism); ``mla``
    says which query projection exists. The down projections and latent norms stay whole on every
    rank and see the gathered input as a plain tensor, so their weights and outputs are replicated;
    backward sums over the ranks' heads what each head slice contributes to a replicated tensor:
    each latent's gradient (by the column-parallel projection reading it, as a Llama block does
    for ``x``) and the shared rotary key's (``shared_k_rot``).

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> mla = MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=48)
        >>> sorted(mla_tp_plan(Shard(1), mla))
        ['attention', 'attention.shared_k_rot', 'attention.wkv_b', 'attention.wo', 'attention.wq_b']
    """
    return {
        "attention": PrepareModuleInput(
            input_layouts=(residual, None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        "attention.wq" if mla.q_lora_rank is None else "attention.wq_b": ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.shared_k_rot": _SumGradOverRanks(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
    }


def mla_num_params(cfg: LlamaConfig) -> int:
    """Parameters of one block's attention (norms included).

    Example:
        >>> from dataclasses import replace
        >>> from lightning_ultrascale.models import get_model_config
        >>> mla = MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        ...                 q_lora_rank=1536)
        >>> mla_num_params(replace(get_model_config("llama_tiny"), dim=7168, n_heads=128, mla=mla))  # DeepSeek-V3
        187107328
    """
    mla, heads = _mla(cfg), cfg.n_heads
    if mla.q_lora_rank is None:
        q = cfg.dim * heads * mla.qk_head_dim
    else:
        q = cfg.dim * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * heads * mla.qk_head_dim
    kv = cfg.dim * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank
    kv += mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv + heads * mla.v_head_dim * cfg.dim
