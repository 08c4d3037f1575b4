"""Shims of torch's CUDA attention ops for :func:`~lightning_ultrascale.testing.cuda_contracts.emulate_cuda`.

Each shim checks what its kernel checks (the message is the kernel's, the source its file and
function under ``aten/src/ATen/native/transformers/cuda/``), then computes in fp32 on the CPU what the
kernel computes: FlashAttention's causal mask aligned to the bottom right, the memory-efficient
kernel's to the top left; the LSE in each kernel's own layout (flash: ``[b, h, s]``; memory-efficient:
rows padded to 32, the padding left unwritten, here NaN; variable-length: ``[h, tokens]``); the
backward from the output and LSE it is GIVEN, as the kernels do.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import Tensor

from lightning_ultrascale.kernels import cuda
from lightning_ultrascale.testing.cuda_rules import require

_FLASH_API = "flash_attn/flash_api.cpp"
_ATTENTION = "attention.cu"
_ATTENTION_BWD = "attention_backward.cu"
_KERNEL_FWD = "mem_eff_attention/kernel_forward.h check_supported"
_HALF = (torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------------------ reference math
def _expand(kv: Tensor, heads: int) -> Tensor:
    return kv.repeat_interleave(heads // kv.shape[1], dim=1) if kv.shape[1] != heads else kv


def _scores(q: Tensor, k: Tensor, scale: float, causal: str | None, bias: Tensor | None) -> Tensor:
    s = torch.matmul(q.float(), _expand(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.float()
    if causal is not None:
        sq, sk = s.shape[-2:]
        offset = sk - sq if causal == "bottom_right" else 0
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(offset + 1), float("-inf"))
    return s


def attend(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: str | None, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """fp32 ``(out, lse)`` of ``[b, h, s, d]`` attention (k, v may hold fewer heads); ``causal``: None, top/bottom."""
    s = _scores(q, k, scale, causal, bias)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), _expand(v, q.shape[1]).float()), lse


def attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: str | None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """fp32 dq, dk, dv from the given ``out`` and ``lse`` (FlashAttention-2's backward); dk, dv summed per kv head."""
    heads, kv_heads = q.shape[1], k.shape[1]
    p = torch.exp(_scores(q, k, scale, causal, bias) - lse.float()[..., None])
    dout = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), dout)
    delta = (dout * out.float()).sum(-1, keepdim=True)
    ds = p * (torch.matmul(dout, _expand(v, heads).float().transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, _expand(k, heads).float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale

    def fold(g: Tensor) -> Tensor:
        b, _, s, d = g.shape
        return g.view(b, kv_heads, heads // kv_heads, s, d).sum(2)

    return dq, fold(dk), fold(dv)


def _scale(q: Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _as_written(out: Tensor, dtype: torch.dtype) -> Tensor:
    # The kernels write [b, s, h, d]; the SDPA ops return its transpose.
    return out.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)


def _rng() -> tuple[Tensor, Tensor]:
    return torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)


# ------------------------------------------------------------------------------------ FlashAttention
def _flash_inputs(q: Tensor, k: Tensor, v: Tensor, where: str) -> None:
    """mha_fwd / mha_bwd's checks of q, k, v (given in the SDPA op's ``[b, h, s, d]``)."""
    capability = cuda.capability() or (0, 0)
    require(capability >= (8, 0), "FlashAttention only supports Ampere GPUs or newer.", where)
    require(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type", where)
    require(k.dtype == q.dtype, "query and key must have the same dtype", where)
    require(v.dtype == q.dtype, "query and value must have the same dtype", where)
    for t in (q, k, v):
        require(t.stride(-1) == 1, "Input tensor must have contiguous last dimension", where)
    b, heads, _, d = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    require(d % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!", where)
    require(d <= 256, "FlashAttention only supports head dimension at most 256", where)
    require(heads % kv_heads == 0, "Number of heads in key/value must divide number of heads in query", where)
    want = (b, kv_heads, sk, d)
    require(
        tuple(k.shape) == want and tuple(v.shape) == want,
        f"CHECK_SHAPE: key {tuple(k.shape)} and value {tuple(v.shape)} must both be {want} (q's head size)",
        where,
    )


def _flash_forward(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, is_causal: bool = False,
    return_debug_mask: bool = False, *, scale: float | None = None,
) -> tuple[Any, ...]:  # fmt: skip
    require(
        k.shape[2] == v.shape[2],
        "Key and Value must have the same sequence length",
        f"{_ATTENTION} _scaled_dot_product_flash_attention_cuda",
    )
    _flash_inputs(q, k, v, f"{_FLASH_API} mha_fwd")
    out, lse = attend(q, k, v, _scale(q, scale), "bottom_right" if is_causal else None)
    return (_as_written(out, q.dtype), lse, None, None, q.shape[2], k.shape[2], *_rng(), q.new_empty(0))


def _flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cum_seq_q: Tensor | None,
    cum_seq_k: Tensor | None, max_q: int, max_k: int, dropout_p: float, is_causal: bool, seed: Tensor,
    offset: Tensor, *, scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    if cum_seq_q is not None:
        _refuse_varlen_for_dense(q, cum_seq_q, cum_seq_k)
    where = f"{_FLASH_API} mha_bwd"
    _flash_inputs(q, k, v, where)
    require(out.dtype == q.dtype, "query and out must have the same dtype", where)
    require(dout.dtype == q.dtype, "query and dout must have the same dtype", where)
    require(out.stride(-1) == 1, "out tensor must have contiguous last dimension", where)
    require(out.shape == q.shape == dout.shape, f"CHECK_SHAPE: out and dout must be {tuple(q.shape)}", where)
    rows = (q.shape[0], q.shape[1], q.shape[2])
    require(
        lse.dtype == torch.float32 and tuple(lse.shape) == rows and lse.is_contiguous(),
        f"softmax_lse ({lse.dtype}, shape {tuple(lse.shape)}, strides {lse.stride()}) is read as a contiguous "
        f"float32 {rows} from its data pointer (set_params_dgrad(..., softmax_lse.data_ptr(), ...), no strides): "
        "anything else gives wrong dq/dk/dv without an error (torch's context parallel makes it contiguous)",
        where,
    )
    grads = attend_backward(dout, q, k, v, out, lse, _scale(q, scale), "bottom_right" if is_causal else None)
    return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)


def _refuse_varlen_for_dense(q: Tensor, cum_seq_q: Tensor, cum_seq_k: Tensor | None) -> None:
    where = (
        f"{_FLASH_API} mha_varlen_bwd, which {_ATTENTION_BWD} _flash_attention_backward takes because "
        "cumulative_sequence_length_q.defined() (an empty tensor is defined: a dense batch passes None)"
    )
    require(cum_seq_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32", where)
    require(cum_seq_k is not None and cum_seq_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32", where)
    require(q.dim() == 3, f"CHECK_SHAPE(q, total_q, num_heads, head_size): got a dense {tuple(q.shape)}", where)


# ------------------------------------------------------------------------------------ memory-efficient
def _efficient_inputs(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, where: str) -> None:
    require(q.dtype in (*_HALF, torch.float32), f"unsupported dtype {q.dtype}", where)
    require(k.dtype == q.dtype and v.dtype == q.dtype, "query, key and value must have one dtype", where)
    b, heads, _, d = q.shape
    sk = k.shape[2]
    require(k.shape[0] == v.shape[0] == b, "TORCH_CHECK(query.size(0) == key.size(0)) (batch size)", where)
    require(v.shape[2] == sk, "TORCH_CHECK(key.size(1) == value.size(1)) (sequence length)", where)
    require(
        k.shape[1] == v.shape[1] == heads,
        f"TORCH_CHECK(query.size(2) == key.size(2)) (num heads): {heads} query and {k.shape[1]} key heads; "
        "this kernel has no grouped-query attention (expand K/V first)",
        where,
    )
    require(k.shape[3] == d, "TORCH_CHECK(query.size(3) == key.size(3)) (embedding per head)", where)
    for t in (q, k, v):
        require(t.stride(-1) == 1, "CHECK_NOSPARSE_LASTCONTIGUOUS_CUDA: last dimension not contiguous", where)
    if bias is not None:
        _efficient_bias(q, k, v, bias, where)


def _efficient_bias(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, where: str) -> None:
    b, heads, sq, _ = q.shape
    require(bias.dtype == q.dtype, "invalid dtype for bias - should match query's dtype", where)
    require(bias.dim() == 4, "Bias expected in BMHK format", where)
    want = (b, heads, sq, k.shape[2])
    require(tuple(bias.shape) == want, f"attn_bias: wrong shape {tuple(bias.shape)}, expected {want}", where)
    require(bias.stride(-1) == 1, "attn_bias: wrong alignment (last dimension must be contiguous)", where)
    # The aligned kernels (taken when q/k/v's row and head strides are 16-byte multiples) need the
    # same of the bias's batch, head and row strides.
    align = 16 // q.element_size()
    if all(t.stride(i) % align == 0 for t in (q, k, v) for i in (1, 2)):
        for dim, label in ((0, "strideB"), (1, "strideH"), (2, "strideM")):
            require(
                bias.shape[dim] <= 1 or bias.stride(dim) % align == 0,
                f"attn_bias is not correctly aligned ({label}). attn_bias.stride({dim}) = {bias.stride(dim)}, "
                f"and should be a multiple of {align}.",
                _KERNEL_FWD,
            )


def _efficient_forward(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, compute_log_sumexp: bool, dropout_p: float = 0.0,
    is_causal: bool = False, *, scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    _efficient_inputs(q, k, v, bias, f"{_ATTENTION} _efficient_attention_forward")
    out, lse = attend(q, k, v, _scale(q, scale), "top_left" if is_causal else None, bias)
    # kAlignLSE: the LSE rows are allocated padded to 32 (at::empty: the padding is never written).
    rows = -(-q.shape[2] // 32) * 32 if compute_log_sumexp else 0
    padded = torch.full((*lse.shape[:2], rows), float("nan"))
    if rows:
        padded[..., : q.shape[2]] = lse
    return _as_written(out, q.dtype), padded, *_rng()


def _efficient_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, out: Tensor, lse: Tensor, seed: Tensor,
    offset: Tensor, dropout_p: float, grad_input_mask: list[bool], is_causal: bool = False, *,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, None]:  # fmt: skip
    where = f"{_ATTENTION_BWD} _efficient_attention_backward"
    _efficient_inputs(q, k, v, bias, where)
    require(dout.shape[:3] == q.shape[:3] and dout.shape[3] == v.shape[3], "grad_out must match query / value", where)
    rows = -(-q.shape[2] // 32) * 32
    require(
        lse.dtype == torch.float32 and lse.stride(-1) == 1 and lse.shape[:2] == q.shape[:2] and lse.shape[2] >= rows,
        f"logsumexp {tuple(lse.shape)} {lse.dtype}: the kernel reads the forward's layout, fp32 rows padded to "
        f"{rows} (kAlignLSE), through its batch and head strides",
        where,
    )
    causal = "top_left" if is_causal else None
    grads = attend_backward(dout, q, k, v, out, lse[..., : q.shape[2]], _scale(q, scale), causal, bias)
    return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype), None


# ------------------------------------------------------------------------------------ variable length
def _varlen_inputs(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None, cu_k: Tensor | None, max_q: int, where: str
) -> list[int]:
    """mha_varlen_fwd / _bwd's checks; returns the sequences' boundaries."""
    require(cu_q is not None and cu_k is not None, "dense [b, s, h, d] input: not a call the package makes", where)
    assert cu_q is not None and cu_k is not None
    require(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32", where)
    require(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32", where)
    require(cu_q.dim() == 1 and cu_q.is_contiguous() and cu_k.is_contiguous(), "CHECK_CONTIGUOUS(cu_seqlens_q)", where)
    require(torch.equal(cu_q, cu_k), "the package passes one cu_seqlens for queries and keys", where)
    _flash_inputs(*(t.transpose(0, 1)[None] for t in (q, k, v)), where)
    bounds = cu_q.tolist()
    longest = max(b - a for a, b in itertools.pairwise(bounds))
    require(
        max_q >= longest,
        f"max_seqlen_q={max_q} is below the longest sequence ({longest}): the grid is sized by it, and the rows "
        "past it are never computed",
        where,
    )
    return bounds


def _per_sequence(bounds: list[int], *tensors: Tensor) -> list[list[Tensor]]:
    """``[tokens, h, d]`` tensors cut into ``[1, h, length, d]`` sequences."""
    return [[t[a:b].transpose(0, 1)[None] for t in tensors] for a, b in itertools.pairwise(bounds)]


def _varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None, cu_k: Tensor | None, max_q: int, max_k: int,
    dropout_p: float, is_causal: bool, return_debug_mask: bool, *, scale: float | None = None, **window: Any,
) -> tuple[Tensor, ...]:  # fmt: skip
    bounds = _varlen_inputs(q, k, v, cu_q, cu_k, max_q, f"{_FLASH_API} mha_varlen_fwd")
    causal = "bottom_right" if is_causal or window.get("window_size_right") == 0 else None
    outs, lses = [], []
    for qs, ks, vs in _per_sequence(bounds, q, k, v):
        out, lse = attend(qs, ks, vs, _scale(q, scale), causal)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1), *_rng(), q.new_empty(0)


def _varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor | None,
    cu_k: Tensor | None, max_q: int, max_k: int, dropout_p: float, is_causal: bool, rng_state: Tensor,
    unused: Tensor, *, scale: float | None = None, **window: Any,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    where = f"{_FLASH_API} mha_varlen_bwd"
    bounds = _varlen_inputs(q, k, v, cu_q, cu_k, max_q, where)
    require(
        lse.dtype == torch.float32 and tuple(lse.shape) == (q.shape[1], q.shape[0]), "softmax_lse: h x total_q", where
    )
    causal = "bottom_right" if is_causal or window.get("window_size_right") == 0 else None
    grads: list[list[Tensor]] = [[], [], []]
    for (qs, ks, vs, os, ds), (a, b) in zip(_per_sequence(bounds, q, k, v, out, dout), itertools.pairwise(bounds)):
        for i, g in enumerate(attend_backward(ds, qs, ks, vs, os, lse[None, :, a:b], _scale(q, scale), causal)):
            grads[i].append(g[0].transpose(0, 1))
    return tuple(torch.cat(g).to(t.dtype) for g, t in zip(grads, (q, k, v)))  # type: ignore[return-value]


aten = torch.ops.aten
SHIMS = {
    aten._scaled_dot_product_flash_attention.default: _flash_forward,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_backward,
    aten._scaled_dot_product_efficient_attention.default: _efficient_forward,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward,
    aten._flash_attention_forward.default: _varlen_forward,
    aten._flash_attention_backward.default: _varlen_backward,
}
