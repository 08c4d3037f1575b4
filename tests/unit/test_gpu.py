"""The GPU tier: what only a CUDA GPU can check. Run it there with ``pytest -m gpu``; skipped elsewhere.

The CUDA context-parallel kernel against the exact reference, packed-document attention (the
variable-length kernel and a masked ring block) against the CPU reference, FP8 blockwise tensor-core GEMMs
against their emulation, the Triton kernels at Llama 3's hidden sizes, NCCL collectives on the
root device and their time as the straggler report measures it, NCCL's flight recorder as the hang
report reads it, and one bf16 training step of llama3_1b that prints its MFU and peak memory.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_ultrascale.testing.parity import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run `pytest -m gpu` on one"),
]


@pytest.fixture(scope="module")
def nccl():
    """A one-rank NCCL group on this GPU (NCCL serves CUDA tensors only: what the suite's gloo cannot show)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from lightning_ultrascale.testing.spawn import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ packed documents
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_document_attention_on_cuda_equals_the_cpu_reference(dtype):
    # bf16: FlashAttention's variable-length kernel; fp32: SDPA with the boolean mask.
    from lightning_ultrascale.models.common.documents import document_attention, uses_varlen

    lengths = [[100, 3, 700, 1, 220], [1024]]
    docs = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 1024, 128, generator=g) for n in (8, 2, 2))
    dout = torch.randn(2, 8, 1024, 128, generator=g)
    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    document_attention(*cpu, docs).backward(dout)
    gpu = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    assert uses_varlen(gpu[0]) == (dtype == torch.bfloat16)
    out = document_attention(*gpu, docs.cuda())
    out.backward(dout.to("cuda", dtype))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert relative_error(out.float().cpu(), document_attention(*(t.detach() for t in cpu), docs)) < tol
    for got, want in zip(gpu, cpu):
        assert relative_error(got.grad.float().cpu(), want.grad) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_masked_ring_block_on_cuda_equals_the_reference(dtype):
    # The memory-efficient kernel with a document bias, and a row the mask leaves empty.
    from lightning_ultrascale.models.common.documents import document_mask
    from lightning_ultrascale.parallel.context.attention import KERNELS

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 256, 128, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    dout = torch.randn(2, 8, 256, 128, device="cuda", generator=g)
    docs_q = torch.repeat_interleave(torch.tensor([3, 4]), torch.tensor([100, 156]))[None].expand(2, -1).cuda()
    docs_k = torch.repeat_interleave(torch.tensor([2, 3]), torch.tensor([200, 56]))[None].expand(2, -1).cuda()
    mask = document_mask(docs_q, docs_k, causal=False)
    (fast, fast_bwd), (ref, ref_bwd) = KERNELS["flash"], KERNELS["reference"]
    out, lse = fast(q, k, v, False, 128**-0.5, mask)
    out_ref, lse_ref = ref(q, k, v, False, 128**-0.5, mask)
    assert torch.isinf(lse[:, :, 100:]).all() and (out[:, :, 100:] == 0).all()  # document 4 is not here
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert relative_error(out, out_ref) < tol and relative_error(lse[:, :, :100], lse_ref[:, :, :100]) < tol
    rows = slice(0, 100)  # backward with the rows' (finite) global LSE
    args = (q[:, :, rows], k, v, out_ref[:, :, rows], lse_ref[:, :, rows], dout[:, :, rows], False, 128**-0.5)
    for got, want in zip(fast_bwd(*args, mask[:, :, rows]), ref_bwd(*args, mask[:, :, rows])):
        assert relative_error(got, want) < tol


# ------------------------------------------------------------------------------------ context parallel kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("qk_dim", "v_dim"), [(128, 128), (192, 128)])  # Llama 3; MLA
@pytest.mark.parametrize("causal", [True, False])
def test_the_cuda_flash_kernel_equals_the_reference(dtype, qk_dim, v_dim, causal):
    from lightning_ultrascale.parallel.context.attention import KERNELS

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 1024, qk_dim, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, 8, 1024, qk_dim, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(2, 8, 1024, v_dim, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(2, 8, 1024, v_dim, device="cuda", generator=g)
    scale = 1 / math.sqrt(qk_dim)
    (fast, fast_bwd), (ref, ref_bwd) = KERNELS["flash"], KERNELS["reference"]
    out, lse = fast(q, k, v, causal, scale)
    out_ref, lse_ref = ref(q, k, v, causal, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert relative_error(out, out_ref) < tol and relative_error(lse, lse_ref) < tol
    for got, want in zip(fast_bwd(q, k, v, out_ref, lse_ref, dout, causal, scale),
                         ref_bwd(q, k, v, out_ref, lse_ref, dout, causal, scale)):  # fmt: skip
        assert relative_error(got, want) < tol


def test_context_parallel_block_memory_is_linear_in_the_block():
    from lightning_ultrascale.parallel.context.attention import KERNELS

    peaks = []
    for seq in (8192, 16384):
        q = torch.randn(1, 32, seq, 128, device="cuda", dtype=torch.bfloat16)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        KERNELS["flash"][0](q, q, q, True, 1 / math.sqrt(128))
        peaks.append(torch.cuda.max_memory_allocated() - base)
    print(f"flash block peak: {peaks[0] / 2**20:.0f} MiB at 8k, {peaks[1] / 2**20:.0f} MiB at 16k")
    assert peaks[1] / peaks[0] < 2.5


# ------------------------------------------------------------------------------------ FP8 blockwise
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="blockwise FP8 needs sm90"
)
def test_blockwise_fp8_tensor_cores_equal_the_emulation():
    from lightning_ultrascale.fp8.linear import blockwise_fp8_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 4096, device="cuda", generator=g) * 0.02
    dy = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    results = []
    for emulate in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = blockwise_fp8_linear(xi, wi, emulate=emulate)
        y.backward(dy)
        results.append((y.float(), xi.grad.float(), wi.grad))
    for got, want in zip(results[1], results[0]):  # the same quantisation: summation order only
        assert relative_error(got, want) < 1e-2
    for emulate in (True, False):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            blockwise_fp8_linear(x, w, emulate=emulate)
        torch.cuda.synchronize()
        print(f"blockwise FP8 4096^3 emulate={emulate}: {(time.perf_counter() - start) / 10 * 1e3:.2f} ms")


# ------------------------------------------------------------------------------------ Triton kernels
@pytest.mark.parametrize("dim", [4096, 8192, 16384])
def test_triton_kernels_equal_the_reference_at_llama_sizes(dim):
    from lightning_ultrascale.kernels import reference, triton_ops

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2048, dim, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    w = torch.randn(dim, device="cuda", generator=g, requires_grad=True)
    out = triton_ops.rms_norm(x, w, 1e-5)
    ref = reference.rms_norm(x, w, 1e-5)
    assert relative_error(out.float(), ref.float()) < 1e-2
    grads = torch.autograd.grad(out.float().sum(), (x, w))
    ref_grads = torch.autograd.grad(ref.float().sum(), (x, w))
    for got, want in zip(grads, ref_grads):
        assert relative_error(got.float(), want.float()) < 1e-2
    a, b = (torch.randn(2048, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    assert relative_error(triton_ops.swiglu(a, b).float(), reference.swiglu(a, b).float()) < 1e-2


# ------------------------------------------------------------------------------------ collectives
def test_collectives_get_tensors_on_the_gpu(nccl):
    from lightning_ultrascale.testing.collectives import CollectiveDeviceCheck
    from lightning_ultrascale.utils.comm import collective_device
    from lightning_ultrascale.utils.grad import grad_norm

    assert collective_device() == torch.device("cuda", torch.cuda.current_device())
    p = torch.nn.Parameter(torch.ones(4, device="cuda"))
    with CollectiveDeviceCheck("cuda"):
        assert float(grad_norm([p], across=[nccl])) == 0.0  # no gradient: the zero is built on the GPU
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.zeros(2))  # what a CPU tensor does under NCCL


def test_batch_clock_counts_the_nccl_collectives_issued_inside_a_batch(nccl):
    # The completion hook of the NCCL group reports each collective's GPU time; one issued between
    # batches is not counted. (Written without a GPU at hand: the gloo path is what the suite checks.)
    from lightning_ultrascale.utils.waits import BatchClock

    clock = BatchClock(torch.device("cuda", torch.cuda.current_device())).install()
    try:
        x = torch.ones(2**24, device="cuda")
        for _ in range(20):
            dist.all_reduce(x)  # outside any batch
        clock.begin()
        dist.all_reduce(x)
        y = x.view(4096, 4096) @ x.view(4096, 4096)
        clock.end()
        batch_s, collective_s = clock.take()
    finally:
        clock.uninstall()
    assert y.isfinite().all() and 0 < collective_s < batch_s, (collective_s, batch_s)


def test_the_hang_report_reads_nccls_flight_recorder(nccl):
    # NCCL keeps its own flight recorder (gloo's is what the suite checks); the hang report reads both.
    # (Written without a GPU at hand.)
    from lightning_ultrascale.core import forensics

    since = time.time_ns()
    dist.all_reduce(torch.ones(1024, device="cuda"))
    torch.cuda.synchronize()
    record = forensics.snapshot(0, since_ns=since)["records"][-1]
    assert (record["op"], record["label"], record["seq"] > 0) == ("all_reduce", "world", True), record
    assert (record["bytes"], record["dtype"]) == (4096, "fp32")


# ------------------------------------------------------------------------------------ a real step
def test_one_bf16_training_step_of_llama3_1b_reports_mfu_and_peak_memory():
    import lightning as L

    from lightning_ultrascale import LlamaModule, UltraScaleDataModule, UltraScaleStrategy
    from lightning_ultrascale.testing.parity import QUIET_TRAINER
    from lightning_ultrascale.training.callbacks import peak_tflops

    times: list[float] = []

    class _Clock(L.Callback):
        def on_train_batch_start(self, *args):
            torch.cuda.synchronize()
            times.append(time.perf_counter())

    seq, batch, steps = 2048, 4, 4
    trainer = L.Trainer(
        accelerator="gpu", devices=1, strategy=UltraScaleStrategy(), precision="bf16-mixed", max_steps=steps,
        callbacks=[_Clock()], **QUIET_TRAINER,
    )  # fmt: skip
    module = LlamaModule("llama3_1b", kernels="reference")
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=seq, micro_batch_size=batch))
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - times[1]) / (steps - 1)  # the first step warms up
    tflops = module.flops_per_token(seq) * seq * batch / step_s / 1e12
    peak = peak_tflops(torch.cuda.get_device_name())
    memory = torch.cuda.max_memory_allocated() / 2**30
    mfu = f"{tflops / peak:.1%}" if peak else "n/a"
    print(f"llama3_1b bf16, {batch} x {seq} tokens: {step_s * 1e3:.0f} ms/step, {tflops:.0f} TFLOP/s, MFU {mfu}, "
          f"peak {memory:.1f} GiB")  # fmt: skip
    assert memory < torch.cuda.get_device_properties(0).total_memory / 2**30
