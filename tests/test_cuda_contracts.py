"""The CUDA branches on a CPU: every private CUDA op held to its kernel's rules, values against one process.

``emulate_cuda`` (``lightning_ultrascale/testing/cuda_contracts.py``) runs the package's CUDA code paths
with CPU tensors, each private op replaced by a shim that checks what the CUDA kernel checks in C++
and computes the result with a CPU reference. No GPU is needed; what a GPU would refuse, or misread
without a word, fails here.
"""

import pytest
import torch
import torch.distributed as dist

from lightning_ultrascale.kernels import cuda
from lightning_ultrascale.parallel.context.attention import KERNELS, local_positions, ring_attention
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.cuda_attention import attend
from lightning_ultrascale.testing.cuda_contracts import CudaContractError, emulate_cuda
from lightning_ultrascale.testing.parity import relative_error

BF16_TOL = 1e-2  # bf16 inputs and outputs against an fp32 reference on the same inputs: measured <= 3.1e-3


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# ------------------------------------------------------------------------------------ the shims themselves
def test_the_flash_backward_shim_refuses_what_the_kernel_refuses_or_misreads():
    q = _bf16(1, 4, 32, 16, seed=0)
    with emulate_cuda():
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True, False, scale=0.25)[:2]
        rng = torch.empty(0, dtype=torch.int64)
        args = (out, q, q, q, out)
        ok = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            *args, lse, None, None, 32, 32, 0.0, True, rng, rng, scale=0.25
        )
        assert [g.shape for g in ok] == [q.shape] * 3
        with pytest.raises(CudaContractError, match=r"cu_seqlens_q must have dtype int32.*an empty tensor is defined"):
            torch.ops.aten._scaled_dot_product_flash_attention_backward(
                *args, lse, rng, rng, 32, 32, 0.0, True, rng, rng, scale=0.25
            )
        wide = torch.cat([lse, lse], dim=-1)[..., :32]  # the right values, strided as a slice of a wider LSE
        with pytest.raises(CudaContractError, match="read as a contiguous float32"):
            torch.ops.aten._scaled_dot_product_flash_attention_backward(
                *args, wide, None, None, 32, 32, 0.0, True, rng, rng, scale=0.25
            )
        odd = q[..., :12]
        with pytest.raises(CudaContractError, match="head_size must be a multiple of 8"):
            torch.ops.aten._scaled_dot_product_flash_attention(odd, odd, odd, 0.0, True, False, scale=0.25)


def test_the_flash_shim_computes_what_the_kernel_computes():
    q, k, v = _bf16(2, 4, 24, 16, seed=1), _bf16(2, 2, 24, 16, seed=2), _bf16(2, 2, 24, 16, seed=3)
    with emulate_cuda() as calls:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=0.25)[:2]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1), is_causal=True, scale=0.25
    )
    assert relative_error(out.float(), expected) < BF16_TOL and lse.dtype == torch.float32
    assert calls.ops == {"_scaled_dot_product_flash_attention.default": 1}


# ------------------------------------------------------------------------------------ context parallel
def _cp_errors(method: str, seq: int, head_dim: int) -> list[float]:
    """Relative errors of this rank's bf16 ring attention (output, dq, dk, dv) against one process, on CUDA's path."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = (_bf16(2, n, seq, head_dim, seed=i) for i, n in enumerate((8, 2, 2, 8)))
    full = [t.float().requires_grad_() for t in (q, k, v)]
    ref, _ = attend(full[0], full[1], full[2], head_dim**-0.5, "top_left")
    ref.backward(dout.float())
    index = local_positions(method, seq, cp, rank)
    mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    with emulate_cuda() as calls:
        out = ring_attention(*mine, dist.group.WORLD, method, "flash")
        out.backward(dout[:, :, index])
    assert calls.ops["_scaled_dot_product_flash_attention_backward.default"] > 0, calls.ops
    errors = [relative_error(out.float(), ref.detach()[:, :, index])]
    return errors + [relative_error(m.grad.float(), f.grad[:, :, index]) for m, f in zip(mine, full)]


@pytest.mark.parametrize("method", ["ring", "zigzag_ring"])
def test_bf16_ring_attention_on_the_cuda_path_equals_one_process(method):
    # The default long-context path: FlashAttention-2 forward and backward per block. Before: the
    # backward passed empty int64 cumulative lengths (the varlen kernel, which refuses them) and,
    # for zig-zag, a strided LSE slice (read at raw offsets: wrong dq/dk/dv without an error).
    errors = run_workers(_cp_errors, 2, method, 32, 16)
    assert max(max(e) for e in errors) < BF16_TOL, errors


@pytest.mark.parametrize(
    ("dtype", "qk_dim", "v_dim", "op"),
    [
        (torch.bfloat16, 12, 12, "flash"),  # FlashAttention asserts head_size % 8 == 0: SDPA pads, a direct call must
        (torch.bfloat16, 24, 16, "flash"),  # MLA: value heads narrower than query/key heads
        (torch.float32, 24, 16, "efficient"),  # fp32 takes the memory-efficient kernel
    ],
)
def test_a_ring_block_on_the_cuda_path_equals_the_reference(dtype, qk_dim, v_dim, op):
    q, k = _bf16(2, 4, 16, qk_dim, seed=0).to(dtype), _bf16(2, 4, 16, qk_dim, seed=1).to(dtype)
    v, dout = _bf16(2, 4, 16, v_dim, seed=2).to(dtype), _bf16(2, 4, 16, v_dim, seed=3).float()
    scale = qk_dim**-0.5
    (forward, backward), (ref_forward, ref_backward) = KERNELS["flash"], KERNELS["reference"]
    with emulate_cuda() as calls:
        out, lse = forward(q, k, v, True, scale)
        grads = backward(q, k, v, out, lse, dout, True, scale)
    ref_out, ref_lse = ref_forward(q, k, v, True, scale)
    ref_grads = ref_backward(q, k, v, ref_out, ref_lse, dout, True, scale)
    assert relative_error(out, ref_out) < BF16_TOL and relative_error(lse, ref_lse) < 1e-3
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and relative_error(got, want) < BF16_TOL
    assert calls.ops[f"_scaled_dot_product_{op}_attention_backward.default"] == 1


def test_the_cuda_branch_is_taken_only_inside_the_emulation():
    t = torch.zeros(1)
    assert not cuda.on_cuda(t)
    with emulate_cuda("B200"):
        assert cuda.on_cuda(t) and cuda.capability() == (10, 0)
    assert not cuda.on_cuda(t) and cuda.EMULATED is None
