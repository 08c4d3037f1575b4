"""The CUDA branches on a CPU: every private CUDA op held to its kernel's rules, values against one process.

``emulate_cuda`` (``lightning_ultrascale/testing/cuda_contracts.py``) runs the package's CUDA code paths
with CPU tensors, each private op replaced by a shim that checks what the CUDA kernel checks in C++
and computes the result with a CPU reference. No GPU is needed; what a GPU would refuse, or misread
without a word, fails here.
"""

import pytest
import torch
import torch.distributed as dist
from llama_runs import GLOBAL_BATCH, MOE_TINY, SEQ_LEN, SGD, run_tiny_llama

from lightning_ultrascale import (
    ContextParallel,
    ExpertParallel,
    FP8Precision,
    LlamaModule,
    UltraScaleDataModule,
    UltraScaleStrategy,
)
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.fp8.linear import blockwise_fp8_linear
from lightning_ultrascale.kernels import cuda
from lightning_ultrascale.models.common.documents import document_mask
from lightning_ultrascale.models.common.moe import GroupedExperts
from lightning_ultrascale.parallel.context.attention import KERNELS, attention_fn, local_positions
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.cuda_attention import attend
from lightning_ultrascale.testing.cuda_contracts import CudaContractError, OpCalls, emulate_cuda
from lightning_ultrascale.testing.parity import assert_parity, record_run, relative_error

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
LENGTHS = [[5, 9, 1, 17, 3, 13, 16], [30, 34]]  # two windows of 64 tokens: seven documents, and two
#: The private ops each layout's backward must reach on CUDA's path (bf16).
BACKWARD_OPS = {
    ("ring", False): "_scaled_dot_product_flash_attention_backward.default",
    ("zigzag_ring", False): "_scaled_dot_product_flash_attention_backward.default",
    ("ring", True): "_scaled_dot_product_efficient_attention_backward.default",  # flash takes no mask
    ("zigzag_ring", True): "_scaled_dot_product_efficient_attention_backward.default",
    ("all_to_all", True): "_flash_attention_backward.default",  # FlashAttention's variable-length kernel
}


def _reference(q, k, v, dout, docs):
    """fp32 causal attention (within documents) of the whole window, with its q/k/v gradients."""
    full = [t.float().requires_grad_() for t in (q, k, v)]
    bias = None
    if docs is not None:
        bias = torch.zeros(docs.shape[0], 1, docs.shape[1], docs.shape[1])
        bias = bias.masked_fill(~document_mask(docs, docs, causal=True), float("-inf"))
    out, _ = attend(*full, q.shape[-1] ** -0.5, "top_left", bias)
    out.backward(dout.float())
    return out.detach(), [t.grad for t in full]


def _cp_errors(method: str, documents: bool, head_dim: int = 16) -> tuple[list[float], OpCalls]:
    """Relative errors of this rank's bf16 attention (output, dq, dk, dv) on CUDA's path against one process."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    docs = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in LENGTHS])
    q, k, v, dout = (_bf16(2, n, 64, head_dim, seed=i) for i, n in enumerate((8, 2, 2, 8)))
    ref, ref_grads = _reference(q, k, v, dout, docs if documents else None)
    index = local_positions("ring" if method == "all_to_all" else method, 64, cp, rank)
    mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    with emulate_cuda() as calls:
        out = attention_fn(method, dist.group.WORLD)(*mine, docs if documents else None)
        out.backward(dout[:, :, index])
    errors = [relative_error(out.float(), ref[:, :, index])]
    return errors + [relative_error(m.grad.float(), g[:, :, index]) for m, g in zip(mine, ref_grads)], calls


@pytest.mark.parametrize(("method", "documents"), list(BACKWARD_OPS), ids=[f"{m}-docs={d}" for m, d in BACKWARD_OPS])
def test_bf16_context_parallel_attention_on_the_cuda_path_equals_one_process(method, documents):
    # The default long-context path: FlashAttention-2 per ring block (with documents the memory-efficient
    # kernel and a bias; all-to-all the variable-length kernel). Before: the flash backward got empty int64
    # cumulative lengths (the varlen kernel, which refuses them) and, for zig-zag, a strided LSE slice (read
    # at raw offsets: wrong dq/dk/dv without an error).
    results = run_workers(_cp_errors, 2, method, documents)
    assert max(max(errors) for errors, _ in results) < BF16_TOL, results
    assert all(calls.ops[BACKWARD_OPS[method, documents]] > 0 for _, calls in results), results
    # 8 query heads on 2 kv heads: FlashAttention reads the kv heads as they are (before: expanded to 8 per block).
    key = {"_scaled_dot_product_flash_attention.default": 1, "_scaled_dot_product_flash_attention_backward.default": 2}
    flash = {shapes[key[op]][1] for _, calls in results for op, shapes in calls.shapes if op in key}
    assert flash <= {2}, flash


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


# ------------------------------------------------------------------------------------ FP8 blockwise
def _fp8_linear(emulate: bool) -> list[torch.Tensor]:
    x = _bf16(200, 256, seed=0).requires_grad_()  # 200 tokens: the weight gradient's 128-token tiles pad
    w = (torch.randn(128, 256, generator=torch.Generator().manual_seed(1)) * 0.02).requires_grad_()
    y = blockwise_fp8_linear(x, w, emulate=emulate)
    y.backward(_bf16(200, 128, seed=2))
    return [y, x.grad, w.grad]


def test_blockwise_fp8_on_hopper_runs_tensor_core_gemms_equal_to_their_emulation():
    with emulate_cuda("H100") as calls:
        fast = _fp8_linear(emulate=False)
    # One GEMM per product (y, dx, dW). One Triton pass each quantises the input with its transpose, the
    # weight with its transpose, and dy both ways (before: the weight and dy in ~10 eager passes each,
    # dy with a transposed padded copy, and a transposed copy of the weight in backward).
    assert calls.ops == {"_scaled_mm_v2.default": 3}, calls.ops
    launches = [launch.kernel for launch in calls.launches]
    assert launches == ["_tile_quantize_transpose", "_block_quantize_transpose", "_tile_quantize_transpose"]
    for got, want in zip(fast, _fp8_linear(emulate=True)):  # the same quantisation: summation order only
        assert relative_error(got.float(), want.float()) < 1e-3


def test_blockwise_fp8_emulates_on_blackwell_where_torchs_blockwise_gemm_refuses():
    # torch's blockwise scaled_mm runs on sm90 only (_check_deepseek_support): before, compute capability
    # >= 9.0 turned emulation off, and a B200 crashed at the first FP8 GEMM.
    with emulate_cuda("B200"):
        assert FP8Precision("blockwise").emulate is True
        with pytest.raises(
            ConfigError, match=r"emulate=False\).*9.x \(Hopper\) only; this device: compute capability 10.0"
        ):
            FP8Precision("blockwise", emulate=False)
        with pytest.raises(CudaContractError, match="only supported in CUDA for SM90"):
            _fp8_linear(emulate=False)
    with emulate_cuda("H100"):
        assert FP8Precision("blockwise").emulate is False


# ------------------------------------------------------------------------------------ MoE
def test_bf16_experts_on_cudas_grouped_gemm_equal_the_per_expert_loop():
    # Uneven and empty groups (not multiples of 8): CUTLASS's grouped kernel asserts 16-byte group
    # sizes only where groups advance along a unit-stride dim, which none of the experts' GEMMs
    # (forward, input and weight gradients) does, so no padding is needed.
    torch.manual_seed(0)
    grouped, loop = GroupedExperts(4, 32, 64, "grouped_mm"), GroupedExperts(4, 32, 64, "loop")
    for p in grouped.parameters():
        torch.nn.init.normal_(p, std=0.1)
    loop.load_state_dict(grouped.state_dict())
    counts, x, dy = torch.tensor([5, 0, 11, 3]), _bf16(19, 32, seed=1), _bf16(19, 32, seed=2)
    x_fast, x_loop = x.clone().requires_grad_(), x.float().requires_grad_()
    with emulate_cuda("H100") as calls:
        grouped.to(torch.bfloat16)(x_fast, counts).backward(dy)
    loop(x_loop, counts).backward(dy.float())
    assert calls.ops["_grouped_mm.default"] == 3 + 6  # forward; input and weight gradient of each
    for got, want in [(x_fast, x_loop), *zip(grouped.parameters(), loop.parameters())]:
        assert relative_error(got.grad.float(), want.grad) < BF16_TOL


def test_the_grouped_gemm_shim_holds_the_kernels_group_alignment():
    # A row-major [features, tokens] operand split along its tokens: each group must start 16 bytes apart.
    a, b = _bf16(32, 24, seed=0), _bf16(24, 16, seed=1)
    with emulate_cuda("H100"), pytest.raises(CudaContractError, match="multiple of 16: group sizes"):
        torch._grouped_mm(a, b, offs=torch.tensor([5, 16, 24], dtype=torch.int32))
    with emulate_cuda("H100"):
        torch._grouped_mm(a, b, offs=torch.tensor([8, 16, 24], dtype=torch.int32))


# ------------------------------------------------------------------------------------ a training step
class _OnTheCudaPath(LlamaModule):
    """Trains through the package's CUDA branches (``emulate_cuda``) and checks that their ops ran."""

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self._emulation = emulate_cuda("H100")
        self._calls = self._emulation.__enter__()

    def on_fit_end(self) -> None:
        self._emulation.__exit__(None, None, None)
        ops = self._calls.ops
        assert ops["_scaled_dot_product_efficient_attention_backward.default"] and ops["_grouped_mm.default"], ops
        super().on_fit_end()


def test_moe_training_with_experts_and_context_split_on_the_cuda_path_matches_one_process():
    # fp32: the ring's blocks take the memory-efficient kernel, the experts CUTLASS's grouped GEMM (its
    # fp32 loop); expert parallelism and the ring move their tensors on gloo as NCCL would.
    reference = run_tiny_llama(SGD, model=MOE_TINY, steps=3)
    run = record_run(
        lambda: _OnTheCudaPath(MOE_TINY, optim=SGD),
        lambda: UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH, seed=0),
        steps=3,
        strategy=lambda: UltraScaleStrategy(ExpertParallel(2), ContextParallel(2)),
        world_size=2,
    )
    assert_parity(run, reference, rtol=1e-5)


# ------------------------------------------------------------------------------------ Triton launches
def test_rope_launches_a_program_per_position_with_work_for_every_thread():
    # Llama 3 8B's 32 query heads of 128. Before: one program per (batch, head, position) held 64
    # elements for 4 warps (128 threads): half of them idle, and cos/sin were read again for every head.
    from lightning_ultrascale.kernels import get_kernels, reference

    q, angles = _bf16(1, 32, 16, 128, seed=0), torch.randn(1, 1, 16, 128)
    with emulate_cuda() as calls:
        out = get_kernels("triton").rope(q, q, angles.cos(), angles.sin())[0]
    launch = calls.launches[0]
    assert launch.kernel == "_rope" and launch.grid == (16,)  # batch x positions
    assert launch.constexprs["BLOCK_H"] * launch.constexprs["BLOCK"] >= 32 * launch.num_warps
    assert relative_error(out.float(), reference.rope(q, q, angles.cos(), angles.sin())[0].float()) < BF16_TOL
