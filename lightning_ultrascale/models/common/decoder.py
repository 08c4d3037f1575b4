"""The decoder every family of ours shares: Llama 3's (3.1 / 3.2), with mixture-of-experts blocks
(Mixtral, DeepSeek) and multi-head latent attention (DeepSeek-V2/V3) where its config asks. Each
family's folder (``models/llama``, ``models/mixtral``, ``models/deepseek``) holds its presets and its
Hugging Face translation; the tensor-parallel plan is :mod:`.tp_plan`, beside this module.

The module tree follows torchtitan's names, which are the :class:`ModelSpec` defaults::

    tok_embeddings
    layers.{i}.attention_norm  layers.{i}.attention.{wq,wk,wv,wo}
    layers.{i}.ffn_norm        layers.{i}.feed_forward.{w1,w2,w3}
    norm
    output

RoPE uses Hugging Face's ``rotate_half`` layout (dimension ``i`` pairs with ``i + head_dim/2``),
not Meta's interleaved one (``2i`` with ``2i+1``). HF checkpoints store ``q_proj``/``k_proj`` already
permuted for that layout, so converting from and to HF is a pure rename (``models/hf.py``); a
checkpoint in Meta's original format would need the q/k row permutation HF's conversion script does.

Example:
    >>> import torch
    >>> from lightning_ultrascale.models import build_model
    >>> model = build_model("llama_tiny", seed=0)
    >>> model(torch.randint(0, 320, (2, 16))).shape
    torch.Size([2, 16, 320])
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_ultrascale.errors import ConfigError, divisors, is_positive_int
from lightning_ultrascale.kernels import Kernels, get_kernels, reference
from lightning_ultrascale.kernels.reference import apply_rope
from lightning_ultrascale.models.common.layers import FeedForward, RMSNorm, causal_attention
from lightning_ultrascale.models.common.mla import MLAConfig, MLAttention, mla_inv_freq, mla_num_params
from lightning_ultrascale.models.common.moe import ExpertStats, MoE, MoEConfig
from lightning_ultrascale.models.common.tp_plan import llama_tp_plan
from lightning_ultrascale.models.shard_init import clean_name, init_parameter, param_seed
from lightning_ultrascale.models.spec import ModelSpec
from lightning_ultrascale.utils.loss import IGNORE_INDEX

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "RopeScaling",
    "TransformerBlock",
    "apply_rope",
    "llama_spec",
    "param_seed",
    "rope_inv_freq",
]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling ("llama3" rope type in HF; ``apply_scaling`` in Meta's code).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are kept,
    those longer than ``original_max_position_embeddings / low_freq_factor`` are stretched by
    ``factor``, and the band between is interpolated smoothly.

    Example:
        >>> RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        ...             original_max_position_embeddings=8192)  # Llama 3.1
        RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


#: The settings that decide the weights' shapes (and a router's meaning).
_SHAPE = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "tie_embeddings", "qkv_bias",
    "mtp_depth", "head_dim", "qk_norm",
)  # fmt: skip
_MOE_SHAPE = ("n_routed_experts", "moe_ffn_dim", "n_shared_experts", "first_k_dense", "router")


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama 3 model. ``validate()`` checks it; :class:`Llama` calls it.

    ``rope_scaling``, ``moe`` and ``mla`` may be given as mappings (as they come from a YAML file);
    they are turned into :class:`RopeScaling`, :class:`~lightning_ultrascale.models.common.moe.MoEConfig`
    and :class:`~lightning_ultrascale.models.common.mla.MLAConfig`. With ``moe`` the blocks from
    ``moe.first_k_dense`` on have a mixture-of-experts feed-forward (the others the dense SwiGLU of
    width ``ffn_hidden_dim``); with ``mla`` attention is DeepSeek's multi-head latent attention.

    Example:
        >>> from dataclasses import replace
        >>> from lightning_ultrascale.models import get_model_config
        >>> cfg = replace(get_model_config("llama_tiny"), n_layers=2)
        >>> cfg.head_dim, cfg.num_params()
        (16, 139584)
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    #: Biases on the q, k and v projections (Qwen2's attention); the output projection has none.
    qkv_bias: bool = False
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    #: Multi-token prediction (DeepSeek-V3's): this many extra blocks, block ``n_layers + k - 1`` predicting the
    #: token ``k + 1`` ahead (:class:`MTPBlock`); their mean cross-entropy enters the loss times ``mtp_loss_weight``.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.1
    name: str = "llama"
    #: Each head's width where it is not ``dim / n_heads`` (Qwen3's: 128 at any width); None: ``dim / n_heads``.
    attention_head_dim: int | None = None
    #: RMSNorm over each query and key head before RoPE (Qwen3's ``q_norm``, ``k_norm``).
    qk_norm: bool = False
    #: The fields that are configs of their own (``model.moe.top_k=4`` on the command line changes
    #: one of their settings), and what each is.
    PARTS: ClassVar[dict[str, str]] = {
        "moe": "mixture of experts",
        "mla": "multi-head latent attention",
        "rope_scaling": "rope scaling",
    }

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if isinstance(self.moe, Mapping):
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if isinstance(self.mla, Mapping):
            object.__setattr__(self, "mla", MLAConfig(**self.mla))

    @property
    def head_dim(self) -> int:
        """Each head's width: :attr:`attention_head_dim`, else ``dim / n_heads``."""
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def n_experts(self) -> int:
        return self.moe.n_routed_experts if self.moe is not None else 0

    def moe_blocks(self) -> tuple[int, ...]:
        """The blocks whose feed-forward is a mixture of experts."""
        if self.moe is None:
            return ()
        return tuple(i for i in range(self.n_layers + self.mtp_depth) if self.moe.is_moe_block(i))

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first setting that cannot build a model.

        Example:
            >>> from dataclasses import replace
            >>> from lightning_ultrascale.models import get_model_config
            >>> replace(get_model_config("llama_tiny"), n_kv_heads=3).validate()
            Traceback (most recent call last):
            ...
            lightning_ultrascale.errors.ConfigError: model.n_kv_heads=3 must divide model.n_heads=4; valid: 1, 2, 4
        """
        for option in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim", "max_seq_len"):
            value = getattr(self, option)
            if not is_positive_int(value):
                raise ConfigError(f"model.{option}={value!r} must be a positive integer")
        for option in ("norm_eps", "rope_theta"):
            if not getattr(self, option) > 0:
                raise ConfigError(f"model.{option}={getattr(self, option)!r} must be > 0")
        if not (isinstance(self.mtp_depth, int) and self.mtp_depth >= 0):
            raise ConfigError(f"model.mtp_depth={self.mtp_depth!r} must be an integer >= 0 (0: none)")
        if not self.mtp_loss_weight >= 0:
            raise ConfigError(f"model.mtp_loss_weight={self.mtp_loss_weight!r} must be >= 0")
        if self.moe is not None:
            self.moe.validate(self.n_layers)
        if self.mla is not None:
            self.mla.validate()
            if self.qkv_bias:
                raise ConfigError("model.qkv_bias=True is for standard attention; valid with model.mla: False")
        self._validate_heads()
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}; "
                f"valid: {', '.join(map(str, divisors(self.n_heads)))}"
            )
        s = self.rope_scaling
        if s is not None:
            if not s.factor > 0 or not 0 < s.low_freq_factor < s.high_freq_factor:
                raise ConfigError(f"model.rope_scaling={s} needs factor > 0 and 0 < low_freq_factor < high_freq_factor")
            if s.original_max_position_embeddings < 1:
                raise ConfigError(
                    f"model.rope_scaling.original_max_position_embeddings={s.original_max_position_embeddings} "
                    "must be a positive integer"
                )

    def _validate_heads(self) -> None:
        """RoPE rotates pairs of dimensions: each head's width must be even as well as whole (MLA sets its own)."""
        width = self.attention_head_dim
        if width is not None and not (is_positive_int(width) and width % 2 == 0):
            raise ConfigError(f"model.attention_head_dim={width!r} must be an even positive integer, or null")
        if self.mla is not None and (width is not None or self.qk_norm):
            raise ConfigError(
                "model.attention_head_dim and model.qk_norm are for standard attention (MLA sets its own head widths); "
                "valid with model.mla: null and False"
            )
        valid_heads = [h for h in divisors(self.dim) if (self.dim // h) % 2 == 0]
        if self.mla is None and width is None and self.n_heads not in valid_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} must divide model.dim={self.dim} into an even head_dim; "
                f"valid: {', '.join(map(str, valid_heads))} (or set model.attention_head_dim)"
            )

    def architecture_differences(self, other: LlamaConfig) -> list[str]:
        """``option=mine (model other: its)`` for every setting in which the weights' shapes or meaning differ.

        Example:
            >>> from lightning_ultrascale.models import get_model_config
            >>> get_model_config("llama_tiny").architecture_differences(get_model_config("llama_small"))[0]
            'dim=64 (model llama_small: 256)'
        """
        pairs = [(k, getattr(self, k), getattr(other, k)) for k in _SHAPE]
        pairs += [(k, getattr(self, k) is not None, getattr(other, k) is not None) for k in ("moe", "mla")]
        if self.moe is not None and other.moe is not None:
            pairs += [(f"moe.{k}", getattr(self.moe, k), getattr(other.moe, k)) for k in _MOE_SHAPE]
        if self.mla is not None and other.mla is not None:
            pairs += [(f"mla.{f.name}", getattr(self.mla, f.name), getattr(other.mla, f.name))
                      for f in dataclasses.fields(other.mla)]  # fmt: skip
        return [f"{k}={a} (model {other.name}: {b})" for k, a, b in pairs if a != b]

    def num_params(self, active: bool = False) -> int:
        """Parameter count of the whole model, a tied embedding counted once (no model needed).

        ``active``: the parameters one token runs through (an MoE block's ``top_k`` routed experts
        instead of all of them), the number TFLOP/s and MFU count.

        Example:
            >>> from lightning_ultrascale.models import get_model_config
            >>> get_model_config("llama3_8b").num_params()
            8030261248
        """
        if self.mla is not None:
            attention = mla_num_params(self)
        else:
            attention = self.dim * self.head_dim * 2 * (self.n_heads + self.n_kv_heads)
            attention += (self.n_heads + 2 * self.n_kv_heads) * self.head_dim if self.qkv_bias else 0
            attention += 2 * self.head_dim if self.qk_norm else 0
        blocks = 0
        for layer in range(self.n_layers + self.mtp_depth):
            if self.moe is not None and self.moe.is_moe_block(layer):
                ffn = self.moe.block_params(self.dim, active)
            else:
                ffn = 3 * self.dim * self.ffn_hidden_dim
            blocks += attention + ffn + 2 * self.dim
        # A multi-token-prediction block's own: enorm, hnorm, post_norm and eh_proj ([2 dim -> dim]).
        blocks += self.mtp_depth * (3 * self.dim + 2 * self.dim * self.dim)
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + blocks + self.dim + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at ``seq_len``, from the config alone.

        ``6 N + 12 L H Q T`` (PaLM, appendix B; torchtitan's ``get_dense_model_nparams_and_flops``):
        N the parameters that take part in a matmul, 6 = 2 FLOPs per multiply-add x (1 forward +
        2 backward); the attention term counts QK^T and AV without the causal half and without
        flash recomputation. The token embedding is a lookup and is left out; the output head is
        counted even when tied to it (torchtitan drops it then, but its matmul runs all the same,
        so leaving it out would overstate MFU of the tied 1B and 3B models).

        Example:
            >>> from lightning_ultrascale.models import get_model_config
            >>> f"{get_model_config('llama3_8b').flops_per_token(8192) / 1e9:.1f} GFLOP"
            '57.9 GFLOP'
        """
        matmul_params = self.num_params(active=True) - self.vocab_size * self.dim
        if self.tie_embeddings:
            matmul_params += self.vocab_size * self.dim
        matmul_params += self.mtp_depth * self.vocab_size * self.dim  # each MTP block's logits: the head again
        blocks = self.n_layers + self.mtp_depth
        if self.mla is not None:  # QK^T over the qk head dim, AV over the v head dim
            qk = self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
            attention = 6 * blocks * self.n_heads * (qk + self.mla.v_head_dim) * seq_len
        else:
            attention = 12 * blocks * self.n_heads * self.head_dim * seq_len
        return float(6 * matmul_params + attention)


def llama_spec(config: LlamaConfig) -> ModelSpec:
    """The :class:`ModelSpec` of the model ``config`` builds (no module needed: the planner reads it)."""
    return ModelSpec(
        name=config.name,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        # MLA expands its latent kv per head: tensor parallelism splits n_heads of both.
        n_kv_heads=config.n_heads if config.mla is not None else config.n_kv_heads,
        dim=config.dim,
        vocab_size=config.vocab_size,
        n_experts=config.n_experts,
        moe_blocks=config.moe_blocks(),
        mtp_depth=config.mtp_depth,
        expert_placement=True,
        moe_folds_tp=True,
        tp_plan=functools.partial(llama_tp_plan, config),
        **_priced_widths(config),
    )


def _priced_widths(cfg: LlamaConfig) -> dict[str, int]:
    """The :class:`ModelSpec` widths the planner prices: MLA's queries and keys are
    ``qk_nope + qk_rope`` wide per head, its values ``v_head_dim``, projected from its latents."""
    mla, moe = cfg.mla, cfg.moe
    qk = cfg.head_dim if mla is None else mla.qk_nope_head_dim + mla.qk_rope_head_dim
    widths = {
        "ffn_dim": cfg.ffn_hidden_dim,
        "head_dim": qk,
        "v_head_dim": cfg.head_dim if mla is None else mla.v_head_dim,
    }
    if mla is not None:
        widths |= {
            "kv_lora_rank": mla.kv_lora_rank,
            "q_lora_rank": mla.q_lora_rank or 0,
            "rope_head_dim": mla.qk_rope_head_dim,
        }
    if moe is not None:
        widths |= {"top_k": moe.top_k, "n_shared_experts": moe.n_shared_experts, "expert_ffn_dim": moe.moe_ffn_dim}
    return widths


def rope_inv_freq(cfg: LlamaConfig, device: torch.device | str | None = None) -> Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` in fp32, with Llama 3.1 scaling if configured.

    Same arithmetic as HF's ``_compute_llama3_parameters``, so logits match HF's.

    Example:
        >>> from lightning_ultrascale.models import get_model_config
        >>> rope_inv_freq(get_model_config("llama_tiny")).shape
        torch.Size([8])
    """
    if cfg.mla is not None:
        return mla_inv_freq(cfg, device=device)
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    old_len = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / s.low_freq_factor, inv_freq / s.factor, smoothed)
    return torch.where(wavelen < old_len / s.high_freq_factor, inv_freq, scaled)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE.

    Head counts are read from the projections' outputs (``view(..., -1, head_dim)``), so the
    module works unchanged when tensor parallelism leaves each rank a slice of the heads.
    ``attention_fn(q, k, v)`` is the attention itself (kv heads not expanded); context
    parallelism replaces it with ring or all-to-all attention over the sequence's ranks. With
    packed documents it is called ``attention_fn(q, k, v, documents)`` (the window's
    ``document_ids``, see :mod:`~lightning_ultrascale.models.common.documents`).
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Qwen3's per-head norms of queries and keys (before RoPE); tensor parallelism gives each rank its heads.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.attention_fn: Callable[[Tensor, Tensor, Tensor], Tensor] = causal_attention
        self.rope: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]] = reference.rope

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, documents: Tensor | None = None) -> Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        out = self.attention_fn(q, k, v) if documents is None else self.attention_fn(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``.

    ``feed_forward`` is the dense SwiGLU or, in the MoE blocks of an MoE config, an
    :class:`~lightning_ultrascale.models.common.moe.MoE`; ``attention`` is grouped-query attention or MLA.
    """

    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.mla is not None:
            self.attention: nn.Module = MLAttention(cfg)
        else:
            self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.moe is not None and cfg.moe.is_moe_block(layer):
            self.feed_forward: nn.Module = MoE(cfg.dim, cfg.moe)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, documents: Tensor | None = None) -> Tensor:
        # ``documents`` by keyword (the tensor-parallel plan prepares the positional inputs only),
        # and only when given: an attention of one's own keeps its (x, cos, sin).
        docs = {} if documents is None else {"documents": documents}
        h = x + self.attention(self.attention_norm(x), cos, sin, **docs)
        return h + self.feed_forward(self.ffn_norm(h))


#: Batch entries of multi-token prediction made before a sequence is cut (context parallelism): ``[b, s, depth]``.
MTP_KEYS = ("mtp_input_ids", "mtp_labels")


def mtp_targets(tokens: Tensor, labels: Tensor, depth: int) -> dict[str, Tensor]:
    """The tokens and labels ``k`` ahead of each position, ``k = 1 .. depth`` (``[b, s, depth]``; padded with
    token 0 and label -100): what depth ``k`` reads and predicts, made on whole sequences.

    Example:
        >>> t = torch.tensor([[5, 6, 7, 8]])
        >>> mtp_targets(t, torch.tensor([[6, 7, 8, -100]]), 1)["mtp_labels"][..., 0]
        tensor([[   7,    8, -100, -100]])
    """
    ahead = [F.pad(tokens[:, k:], (0, k)) for k in range(1, depth + 1)]
    targets = [F.pad(labels[:, k:], (0, k), value=IGNORE_INDEX) for k in range(1, depth + 1)]
    return {"mtp_input_ids": torch.stack(ahead, dim=-1), "mtp_labels": torch.stack(targets, dim=-1)}


class MTPBlock(TransformerBlock):
    """DeepSeek-V3's multi-token-prediction module of depth ``k``: ``post_norm(block(eh_proj([enorm(e); hnorm(h)])))``.

    ``h`` is the previous depth's output (depth 1: the main model's, after its final norm), ``e`` the
    embedding of the tokens ``k`` ahead; the result predicts the token ``k + 1`` ahead through the shared
    head and feeds depth ``k + 1``, as transformers' ``MtpLayer`` (``post_norm`` is the HF checkpoint's
    ``shared_head.norm``).
    """

    def __init__(self, cfg: LlamaConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.post_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(  # type: ignore[override]
        self, h: Tensor, embedded: Tensor, cos: Tensor, sin: Tensor, documents: Tensor | None = None
    ) -> Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(h)), dim=-1))
        return self.post_norm(super().forward(x, cos, sin, documents))


class Llama(nn.Module):
    """Llama 3 decoder: ``forward(tokens [b, s], position_ids [b, s] | None) -> logits [b, s, vocab]``.

    A pipeline stage holds a subset: ``tok_embeddings``, ``norm`` and ``output`` may be set to
    ``None`` and blocks deleted from ``layers`` (an ``nn.ModuleDict`` keyed ``"0" .. "n-1"``, so the
    remaining names do not change). A missing piece passes the hidden state through: without
    ``tok_embeddings`` the first argument is the hidden state ``[b, s, dim]``, without ``output``
    the result is.

    ``position_ids`` only set the RoPE angles (context parallelism passes each rank's positions);
    attention is causal over the local sequence, and also within documents when ``document_ids``
    (the whole window's, ``[b, s]``: :mod:`~lightning_ultrascale.models.common.documents`) are given.
    Positions default to ``0 .. s-1`` with ``s`` the length of the first argument, so a stage that
    receives sequence-sharded hidden states must pass them.

    The RoPE inverse frequencies are a non-persistent fp32 buffer: not in checkpoints, and
    recomputed by ``init_weights`` (after a meta-device build and ``to_empty``) or ``init_buffers``.

    Example:
        >>> import torch
        >>> from lightning_ultrascale.models import get_model_config
        >>> with torch.device("meta"):
        ...     model = Llama(get_model_config("llama_tiny"))
        >>> model.to_empty(device="cpu").init_weights(seed=0)
        >>> tokens = torch.randint(0, 320, (1, 8))
        >>> model(tokens, position_ids=torch.arange(100, 108)[None]).shape
        torch.Size([1, 8, 320])
    """

    def __init__(
        self, config: LlamaConfig, pretrained: Callable[[nn.Module], None] | None = None, kernels: Kernels | None = None
    ) -> None:
        super().__init__()
        config.validate()
        self.config = config
        #: A loader :meth:`init_weights` calls with the model instead of drawing new weights, e.g.
        #: ``functools.partial(lightning_ultrascale.models.hf.convert.load_hf_weights, path=DIR)``
        #: (each rank its shards).
        self.pretrained = pretrained
        self.spec = llama_spec(config)
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layers)})
        for i in range(config.n_layers, config.n_layers + config.mtp_depth):
            self.layers[str(i)] = MTPBlock(config, i)
        self._mtp_sums: Tensor | None = None
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)
        self.kernels: Kernels
        self.use_kernels(kernels or get_kernels("reference"))

    def use_kernels(self, kernels: Kernels) -> None:
        """Run RMSNorm, SwiGLU, RoPE and the loss with ``kernels`` (see :mod:`lightning_ultrascale.kernels`).

        MLA's rotary part and the routed experts' grouped GEMMs keep their own code.
        """
        self.kernels = kernels
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = kernels.rms_norm
            elif isinstance(module, FeedForward):
                module.swiglu = kernels.swiglu
            elif isinstance(module, Attention):
                module.rope = kernels.rope

    def forward(
        self,
        tokens: Tensor,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        document_ids: Tensor | None = None,
        mtp: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """Logits ``[b, s, vocab]``; with ``labels [b, s]`` the mean cross-entropy over those not -100 instead.

        With a fused linear cross-entropy kernel the loss never materialises the logits. ``mtp``: the
        :func:`mtp_targets` of whole sequences, where a rank holds a part of each (context parallelism).
        """
        n = self.config.n_layers
        blocks = [name for name in self.layers.keys() if int(name) < n]  # the main ones (MTP blocks follow)
        embed = self.tok_embeddings is not None
        docs = {"document_ids": document_ids}
        if labels is None:
            return self.forward_stage(tokens, position_ids, blocks, embed=embed, head=self.output is not None, **docs)
        assert self.norm is not None and self.output is not None, "a loss needs the final norm and the head"
        h = self.norm(self.forward_stage(tokens, position_ids, blocks, embed=embed, head=False, **docs))
        if self.config.mtp_depth:
            targets = mtp or mtp_targets(tokens, labels, self.config.mtp_depth)
            self._mtp_sums = self._multi_token_prediction(h, targets, position_ids, document_ids)
        return self._cross_entropy(h, labels)

    def _cross_entropy(self, h: Tensor, labels: Tensor) -> Tensor:
        """The head's mean cross-entropy of the normed hidden states ``h`` over the labels that are not -100."""
        assert self.output is not None
        fused = self.kernels.linear_cross_entropy
        # The head's weight is read inside this forward, where FSDP has gathered it.
        return fused(h, self.output.weight, labels) if fused else reference.cross_entropy(self.output(h), labels)

    def _multi_token_prediction(
        self, h: Tensor, targets: dict[str, Tensor], position_ids: Tensor | None, document_ids: Tensor | None
    ) -> Tensor:
        """``[cross-entropy sum, tokens]`` of the MTP blocks over every depth: depth ``k`` reads the embedding of
        the tokens ``k`` ahead and predicts the labels ``k`` ahead (:func:`mtp_targets`; the last ``k``
        positions of a sequence predict nothing)."""
        assert self.tok_embeddings is not None
        ahead, labels = targets["mtp_input_ids"], targets["mtp_labels"]
        if position_ids is None:
            position_ids = torch.arange(ahead.shape[1], device=ahead.device)[None]
        cos, sin = self._rope_angles(position_ids)
        docs = {} if document_ids is None else {"documents": document_ids}
        sums = torch.zeros(2, device=labels.device)
        for k in range(1, self.config.mtp_depth + 1):
            block = self.layers[str(self.config.n_layers + k - 1)]
            h = block(h, self.tok_embeddings(ahead[..., k - 1]), cos, sin, **docs)
            target = labels[..., k - 1]
            n = (target != IGNORE_INDEX).sum()
            mean = self._cross_entropy(h, target)
            mean = mean.full_tensor() if isinstance(mean, DTensor) else mean
            sums = sums + torch.stack((torch.where(n > 0, mean.float() * n, 0.0), n.float()))
        return sums

    def pop_mtp_sums(self) -> Tensor | None:
        """The last forward's multi-token-prediction ``[cross-entropy sum, tokens]`` over its depths (once)."""
        sums, self._mtp_sums = self._mtp_sums, None
        return sums

    def forward_stage(
        self,
        x: Tensor,
        position_ids: Tensor | None,
        blocks: Sequence[str],
        *,
        embed: bool,
        head: bool,
        document_ids: Tensor | None = None,
        mtp: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """Run a part of the model: a pipeline stage (see :mod:`lightning_ultrascale.parallel.pipeline`).

        Embeds ``x`` (tokens) if ``embed``, else takes it as the hidden state; runs the named
        blocks in order; applies the final norm and the output head if ``head``. The MoE blocks'
        auxiliary losses wait for :meth:`pop_aux_loss`. With ``head`` and ``mtp`` (the microbatch's
        :func:`mtp_targets`: the last stage of a pipeline) the MTP blocks run on the normed hidden state and
        their sums wait for :meth:`pop_mtp_sums`.
        """
        h = self.tok_embeddings(x) if embed else x
        if position_ids is None:
            # From the input, not from h: under sequence parallelism h holds a sequence shard.
            position_ids = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = self._rope_angles(position_ids)
        # Only with documents: a block wrapped or replaced by code of one's own keeps its (x, cos, sin).
        docs = {} if document_ids is None else {"documents": document_ids}
        for name in blocks:
            h = self.layers[name](h, cos, sin, **docs)
        if head:
            h = self.norm(h)
            if mtp is not None and self.config.mtp_depth:
                self._mtp_sums = self._multi_token_prediction(h, mtp, position_ids, document_ids)
            h = self.output(h)
        return h

    def moe_layers(self, blocks: Sequence[str] | None = None) -> dict[str, MoE]:
        """The MoE feed-forwards this rank holds, by block name (of ``blocks`` only, if given)."""
        names = self.layers.keys() if blocks is None else blocks
        found = {name: self.layers[name].feed_forward for name in names if name in self.layers}
        return {name: ffn for name, ffn in found.items() if isinstance(ffn, MoE)}

    def pop_aux_loss(self, blocks: Sequence[str] | None = None) -> Tensor | None:
        """The MoE auxiliary losses of the last training forward, summed over blocks and tokens (once).

        The cross-entropy is a mean over labelled tokens: add ``pop_aux_loss() / labelled tokens``.
        """
        losses = [aux for moe in self.moe_layers(blocks).values() if (aux := moe.pop_aux_loss()) is not None]
        return torch.stack(losses).sum() if losses else None

    @torch.no_grad()
    def expert_stats(self, reduce: Callable[[Tensor], Tensor] | None = None) -> ExpertStats:
        """What the MoE blocks counted since the last call: tokens per expert, dropped, aux losses' sum.

        ``loads`` is ``[MoE blocks of the config, experts]``.

        Rows of blocks another rank holds are zeros; ``reduce`` (a sum over the ranks of the global
        batch, each counted once) makes them global. Every rank gets the same tensor shape, so a
        pipeline rank without MoE blocks takes part in the reduction like the others. Under tensor
        parallelism the MoE layers fold (each tp rank counts its share of the tokens): ``reduce`` must then
        sum over the tp ranks too, over every rank (``LlamaModule`` does: ``split_step_sums``).
        """
        blocks = self.config.moe_blocks()
        loads = torch.zeros(len(blocks), max(self.config.n_experts, 1), device=self.rope_inv_freq.device)
        totals = torch.zeros(2, device=loads.device)  # dropped, aux
        for row, moe in self._held_moe_rows():
            load, dropped, aux = moe.pop_load()
            loads[row] = load
            totals += torch.stack((dropped, aux))
        flat = torch.cat((loads.flatten(), totals))
        if reduce is not None:
            flat = reduce(flat)
        return ExpertStats(flat[: loads.numel()].view_as(loads), flat[-2], flat[-1])

    @torch.no_grad()
    def update_expert_bias(self, loads: Tensor) -> None:
        """Aux-loss-free balancing step of every MoE block held, from global ``loads`` (:meth:`expert_stats`)."""
        for row, moe in self._held_moe_rows():
            moe.router.update_bias(loads[row])

    @torch.no_grad()
    def observe_expert_loads(self, loads: Tensor) -> None:
        """Hand every MoE block held its row of the step's global ``loads`` (:meth:`expert_stats`): an expert
        placement's dispatcher re-places its experts from them (``parallel/expert/comms.py``)."""
        for row, moe in self._held_moe_rows():
            moe.dispatcher.observe(loads[row])

    @torch.no_grad()
    def expert_bias_ranges(self) -> Tensor:
        """``max - min`` of each MoE block's selection bias ``[MoE blocks of the config]``; 0 for blocks not held."""
        ranges = torch.zeros(len(self.config.moe_blocks()), device=self.rope_inv_freq.device)
        for row, moe in self._held_moe_rows():
            bias = moe.router.expert_bias
            ranges[row] = bias.max() - bias.min()
        return ranges

    def _held_moe_rows(self) -> Iterator[tuple[int, MoE]]:
        """``(row, MoE layer)`` for the MoE blocks this rank holds; row indexes ``config.moe_blocks()``."""
        held = self.moe_layers()
        for row, block in enumerate(self.config.moe_blocks()):
            if str(block) in held:
                yield row, held[str(block)]

    def _rope_angles(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = self.rope_inv_freq
        if inv_freq.dtype != torch.float32:
            # `model.to(torch.bfloat16)` casts buffers too, and bf16 frequencies put far positions
            # at wrong angles; 64-ish numbers are cheap to recompute.
            inv_freq = rope_inv_freq(self.config)
        freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1 (heads), s, head_dim]
        return angles.cos(), angles.sin()

    def tie_weights(self) -> None:
        """Make ``output.weight`` the ``tok_embeddings.weight`` Parameter again, if the config ties them.

        ``to_empty`` and ``load_state_dict(assign=True)`` give each module its own Parameter,
        silently untying the two; ``init_weights`` calls this. (DTensor parameters are swapped in
        place and stay tied.)
        """
        if self.config.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE buffer, in fp32 on the CPU (same values everywhere), then move it; zero MoE token counts.

        ``device`` defaults to where the buffer is, or to the parameters' device if that is meta
        (as after ``load_state_dict(assign=True)`` into a meta-built model).
        """
        if device is None:
            device = self.rope_inv_freq.device
            if device.type == "meta":
                device = next((p.device for p in self.parameters()), device)
        self.rope_inv_freq = rope_inv_freq(self.config, device="cpu").to(device)
        for moe in self.moe_layers().values():  # the counters; the router's expert_bias is state
            moe.pop_load()

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from ``(seed, its fully qualified name)`` alone (or from :attr:`pretrained`).

        Each element's value is a pure function of :func:`param_seed` and its index in the full
        parameter (Philox, :mod:`~lightning_ultrascale.models.shard_init`), so each rank draws only
        the shard it holds (TP, FSDP2, expert shards), on the parameter's device, and a CPU build, a
        meta build materialised with ``to_empty`` and every layout agree bit for bit, whatever the
        rank or the other layers present. Embeddings and linears get N(0, 0.02); the projections
        back into the residual stream (wo, w2) N(0, 0.02 / sqrt(2 n_layers)) (GPT-2's scaled init);
        norms 1. Wrapper names (activation checkpointing, torch.compile) are removed from the names first.

        Example:
            >>> import torch
            >>> from lightning_ultrascale.models import build_model
            >>> a, b = build_model("llama_tiny", seed=1), build_model("llama_tiny", seed=1)
            >>> torch.equal(a.layers["0"].attention.wq.weight, b.layers["0"].attention.wq.weight)
            True
        """
        self.tie_weights()
        self.init_buffers()
        for moe in self.moe_layers().values():
            moe.router.expert_bias.zero_()
        if self.pretrained is not None:
            self.pretrained(self)
            return
        for fqn, param in self.named_parameters():
            name = clean_name(fqn)
            if self.config.tie_embeddings and name == "output.weight":
                name = "tok_embeddings.weight"  # a last pipeline stage holding only the tied head
            init_parameter(param, name, seed, self._init_std(name))

    def _init_std(self, name: str) -> float | None:
        """Standard deviation of a parameter's initial values; None for norms, which start at 1; 0 for biases."""
        if name.endswith("norm.weight"):
            return None
        if name.endswith(".bias"):
            return 0.0  # (q/k/v biases start at 0, as in HF's Qwen2)
        std = 0.02
        if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "shared_experts.w2.weight")):
            std /= math.sqrt(2 * self.config.n_layers)
        return std

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) of the whole model: see :meth:`LlamaConfig.flops_per_token`."""
        return self.config.flops_per_token(seq_len)
