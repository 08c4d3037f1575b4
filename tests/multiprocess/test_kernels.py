"""Fused kernels equal their pure-torch reference, forward and backward, and the fused loss saves the logits' memory.

Without a GPU the Triton kernels (ours and Liger's) run in Triton's interpreter on CPU tensors
(conftest sets ``TRITON_INTERPRET=1``); ``compile`` runs inductor's C++ code. Shapes are awkward on
purpose: hidden sizes that are not powers of two (masked tails), views with strides, token counts
that leave a short last chunk.

Bounds: fp32 results within 1e-5 of the reference's scale (measured: 2.3e-7 at worst, a different
summation order). bf16 results within 5e-2: one bf16 rounding of the largest value is up to 2**-7
= 7.8e-3 of it, and fast and reference paths round at different places (an fp32 accumulation
rounded once against bf16 partial sums); measured 1.0e-2 at worst. A wrong formula is off by O(1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from llama_runs import SGD, run_tiny_llama
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ultrascale import ConfigError, LlamaModule, TensorParallel, ZeRO
from lightning_ultrascale.kernels import check_kernels, fused_linear_cross_entropy, get_kernels, reference
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import assert_parity
from lightning_ultrascale.testing.storages import LiveStorages
from lightning_ultrascale.utils.memory import peak_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}
# Liger's RMSNorm and SwiGLU do not run in Triton's interpreter ("'float' object has no attribute
# 'to'"): on CPU only its RoPE and fused cross-entropy are checked.
LIGER_INTERPRETABLE = {"rope", "linear_cross_entropy"}


def _scaled_error(x: Tensor, ref: Tensor) -> float:
    """Largest element error over the reference's largest magnitude."""
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def _compare(fast: Callable[..., object], ref: Callable[..., object], inputs: list[Tensor], dtype: torch.dtype) -> None:
    """Outputs and input gradients of ``fast`` and ``ref`` on the same inputs, in ``dtype``."""
    leaves = [x.to(DEVICE, dtype) for x in inputs]
    ours = [x.clone().requires_grad_() for x in leaves]
    theirs = [x.clone().requires_grad_() for x in leaves]
    ref_out = ref(*theirs)
    ref_out = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    grads = [torch.randn_like(o) for o in ref_out]
    torch.autograd.backward(ref_out, [g.clone() for g in grads])
    out = fast(*ours)
    out = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(out, [g.clone() for g in grads])  # Liger writes into incoming gradients
    for i, (o, r) in enumerate(zip(out, ref_out)):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert _scaled_error(o, r) < RTOL[dtype], f"output {i} differs by {_scaled_error(o, r):.2e}"
    for i, (a, b) in enumerate(zip(ours, theirs)):
        error = _scaled_error(a.grad, b.grad)
        assert error < RTOL[dtype], f"gradient {i} differs by {error:.2e}"


def _rope_inputs(batch_of_angles: int) -> tuple[list[Tensor], Tensor, Tensor]:
    # q and k as the model makes them: [b, s, heads, d] projections viewed as [b, heads, s, d].
    q = torch.randn(2, 5, 3, 10).transpose(1, 2)
    k = torch.randn(2, 5, 1, 10).transpose(1, 2)
    freqs = torch.randn(batch_of_angles, 5, 5)
    angles = torch.cat((freqs, freqs), dim=-1)[:, None].to(DEVICE)
    return [q, k], angles.cos(), angles.sin()


def _skip_uninterpretable(name: str, op: str) -> None:
    if name == "liger" and DEVICE == "cpu" and op not in LIGER_INTERPRETABLE:
        pytest.skip(f"Liger's {op} does not run in Triton's interpreter; checked on a GPU only")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["triton", "liger", "compile"])
@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "rope"])
def test_fast_kernels_equal_the_reference_forward_and_backward(op, name, dtype):
    _skip_uninterpretable(name, op)
    kernels = get_kernels(name)
    torch.manual_seed(0)
    if op == "rms_norm":
        for shape in [(3, 5, 37), (7, 129)]:  # odd hidden sizes: masked tails
            weight = 1 + 0.1 * torch.randn(shape[-1])
            _compare(
                lambda x, w: kernels.rms_norm(x, w, 1e-5),
                lambda x, w: reference.rms_norm(x, w, 1e-5),
                [torch.randn(shape), weight],
                dtype,
            )
    elif op == "swiglu":
        _compare(kernels.swiglu, reference.swiglu, [torch.randn(3, 7, 33), torch.randn(3, 7, 33)], dtype)
    else:
        for batch_of_angles in (2, 1):  # per-sequence positions (context parallel) and shared ones
            qk, cos, sin = _rope_inputs(batch_of_angles)
            _compare(
                lambda q, k, c=cos, s=sin: kernels.rope(q, k, c, s),
                lambda q, k, c=cos, s=sin: reference.rope(q, k, c, s),
                qk,
                dtype,
            )


@pytest.mark.parametrize("requantize", [True, False], ids=["activation", "gradient"])
@pytest.mark.parametrize("tokens", [128, 200, 5], ids=["one-tile", "tail", "fewer-than-a-tile"])
def test_fp8_tile_quantisation_fused_with_its_transpose_equals_two_quantisations_bit_for_bit(tokens, requantize):
    # Activations: the transposed tiles from the E4M3 values (DeepSeek-V3 caches them in FP8);
    # gradients: from dy itself, in the same single pass (before: two eager quantisations and a copy).
    from lightning_ultrascale.kernels.quantize import quantize
    from lightning_ultrascale.kernels.triton_fp8 import tile_quantize_with_transpose

    torch.manual_seed(0)
    x = torch.randn(tokens, 256) * 3
    x[0, :128] = 0.0  # a zero tile: a tiny scale, all zeros
    x[-1, 128:] *= 1e-6  # values that land on E4M3 subnormals
    x[tokens // 2, 7] = float("inf")  # saturates at 448, no NaN
    ours, ours_t = tile_quantize_with_transpose(x.to(DEVICE), requantize)
    q = quantize(x, "tile")
    source = q.dequantize() if requantize else x
    q_t = quantize(torch.nn.functional.pad(source.t(), (0, -tokens % 128)), "tile")  # tiles along the tokens
    for got, want in ((ours, q), (ours_t, q_t)):
        assert torch.equal(got.data.cpu().view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale.cpu(), want.scale)
        assert torch.isfinite(got.dequantize()).all()


def test_fp8_weight_blocks_and_their_transpose_in_one_pass_equal_the_eager_quantisation_bit_for_bit():
    from lightning_ultrascale.kernels.quantize import quantize
    from lightning_ultrascale.kernels.triton_fp8 import block_quantize_with_transpose

    torch.manual_seed(0)
    w = torch.randn(256, 384) * 0.02
    w[:128, :128] = 0.0  # a zero block
    w[200, 300] = 5.0  # one large value sets its block's scale
    ours, ours_t = block_quantize_with_transpose(w.to(DEVICE))
    q = quantize(w, "block")
    assert torch.equal(ours.data.cpu().view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(ours_t.data.cpu().view(torch.uint8), q.data.t().contiguous().view(torch.uint8))
    assert torch.equal(ours.scale.cpu(), q.scale) and torch.equal(ours_t.scale.cpu(), q.scale.t())
    assert ours_t.data.is_contiguous()  # the tensor-core GEMM of dx reads it column-major


def _loss_inputs(tokens: int, dim: int, vocab: int) -> list[Tensor]:
    labels = torch.randint(0, vocab, (tokens,))
    labels[::5] = -100  # ignored tokens count in neither the sum nor the mean
    return [torch.randn(tokens, dim), torch.randn(vocab, dim) * 0.1, labels]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["ours", "liger"])
def test_fused_linear_cross_entropy_equals_the_materialised_loss(name, dtype):
    torch.manual_seed(0)
    h, weight, labels = _loss_inputs(tokens=37, dim=24, vocab=101)
    labels = labels.to(DEVICE)
    if name == "ours":
        for chunk in (5, 37, None):  # a short tail chunk, one chunk, the default rule
            _compare(
                lambda h, w, chunk=chunk: fused_linear_cross_entropy(h, w, labels, chunk_size=chunk),
                lambda h, w: reference.linear_cross_entropy(h, w, labels),
                [h, weight],
                dtype,
            )
    else:
        fused = get_kernels("liger").linear_cross_entropy
        assert fused is not None
        _compare(
            lambda h, w: fused(h, w, labels),
            lambda h, w: reference.linear_cross_entropy(h, w, labels),
            [h, weight],
            dtype,
        )


def test_fused_linear_cross_entropy_of_only_ignored_tokens_is_zero_not_nan():
    h, weight = torch.randn(4, 8, requires_grad=True), torch.randn(16, 8)
    loss = fused_linear_cross_entropy(h, weight, torch.full((4,), -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(h.grad == 0)


def test_fused_linear_cross_entropy_refuses_a_second_backward_instead_of_scaling_twice():
    # Its gradients are computed in the forward and scaled in place by the backward.
    h, weight = torch.randn(4, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    loss = fused_linear_cross_entropy(h, weight, torch.tensor([1, 2, 3, 4]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _loss_peak_bytes(loss_fn: Callable[[Tensor, Tensor, Tensor], Tensor], tokens: int, dim: int, vocab: int) -> int:
    torch.manual_seed(0)
    h = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    return peak_bytes(lambda: loss_fn(h, weight, labels).backward(), h, weight)


def test_fused_linear_cross_entropy_peak_memory_is_lower_by_more_than_the_logits():
    tokens, dim, vocab = 512, 64, 16000
    logits = tokens * vocab * 4  # fp32
    materialised = _loss_peak_bytes(reference.linear_cross_entropy, tokens, dim, vocab)
    fused = _loss_peak_bytes(fused_linear_cross_entropy, tokens, dim, vocab)
    # Materialised: the logits, their fp32 softmax and gradient live together (~3 x logits).
    assert materialised - fused >= logits, f"peak {materialised:,} B materialised vs {fused:,} B fused"


class _WeightSizedResults(TorchDispatchMode):
    """Counts the ops returning a new tensor of the head weight's shape (in-place and ``out=`` ops write, not make)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.made = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        mutates = func._schema.is_mutable or func.__name__.endswith("_")
        if isinstance(out, Tensor) and tuple(out.shape) == self.shape and not mutates:
            self.made.append((func.__name__, out.dtype))
        return out


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "fp32-under-autocast"])
def test_the_chunked_weight_gradient_allocates_no_weight_sized_temporary_per_chunk(autocast):
    # It allocated a [V, D] low-precision product and its fp32 copy for every chunk.
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    h, weight, labels = (t.to(dtype) if t.is_floating_point() else t for t in _loss_inputs(64, 16, 96))
    weight.requires_grad_()
    counter = _WeightSizedResults(tuple(weight.shape))
    with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fused_linear_cross_entropy(h, weight, labels, chunk_size=8)  # 8 chunks
    # The fp32 sum and the one product buffer (the casts of the weight for the logits' GEMMs excepted).
    made = [m for m in counter.made if m[0] not in ("_to_copy.default", "t.default")]
    assert len(made) <= 2, made


def _vocab_parallel_errors(sequence_parallel: bool) -> dict[str, float]:
    """On 2 ranks: the fused loss with a vocabulary-sharded head against the one-process reference."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    h, weight, labels = _loss_inputs(tokens=2 * 19, dim=24, vocab=2 * 51)
    h, weight, labels = h.view(2, 19, 24), weight, labels.view(2, 19)
    ref_h, ref_w = h.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference.linear_cross_entropy(ref_h, ref_w, labels)
    ref.backward()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    x = h.clone().requires_grad_()
    # Sequence parallel: each rank holds half the sequence as a DTensor (the final norm's output).
    x_in = distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_() if sequence_parallel else x
    loss = fused_linear_cross_entropy(x_in, w, labels, chunk_size=7)
    loss.backward()
    h_grad = x_in.grad.full_tensor() if sequence_parallel else x.grad
    rank = dist.get_rank()
    return {
        "loss": abs(loss.item() - ref.item()) / ref.item(),
        "h_grad": _scaled_error(h_grad, ref_h.grad),
        "w_grad": _scaled_error(w.grad.to_local(), ref_w.grad[rank * 51 : (rank + 1) * 51]),
    }


def test_vocabulary_parallel_fused_loss_equals_one_process():
    for sequence_parallel in (False, True):
        for errors in run_pooled(_vocab_parallel_errors, 2, sequence_parallel):
            assert max(errors.values()) < 1e-5, f"sequence_parallel={sequence_parallel}: {errors}"


@pytest.mark.parametrize("name", ["triton", "liger"])
def test_a_llama_with_fast_kernels_trains_like_the_reference(name):
    """The whole model: loss and every parameter gradient (Liger: RoPE and loss only, on CPU)."""
    kernels = get_kernels(name)
    if name == "liger" and DEVICE == "cpu":
        kernels = get_kernels("reference", fused_cross_entropy=False)
        kernels = type(kernels)("liger-rope", kernels.rms_norm, kernels.swiglu, get_kernels("liger").rope, None)
    tokens = torch.randint(0, 320, (2, 24), device=DEVICE)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    models = [build_model("llama_tiny", device=DEVICE, seed=0) for _ in range(2)]
    models[1].use_kernels(kernels)
    losses = []
    for model in models:
        loss = model(tokens, labels=labels)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) / losses[0] < 1e-5
    ref_grads = dict(models[0].named_parameters())
    for n, p in models[1].named_parameters():
        assert _scaled_error(p.grad, ref_grads[n].grad) < 1e-5, n


@pytest.fixture(scope="module")
def reference_run():
    return run_tiny_llama(SGD, steps=3)


@pytest.mark.parametrize(
    ("plugins", "dp"),
    [(lambda: [TensorParallel(2, sequence_parallel=True)], 1), (lambda: [ZeRO(stage=3)], None)],
    ids=["tp2-sp-vocab-parallel", "dp2-zero3"],
)
def test_fused_loss_trains_each_layout_like_one_process_with_materialised_logits(reference_run, plugins, dp):
    run = run_tiny_llama(SGD, plugins, 2, steps=3, dp=dp, module_kwargs={"fused_cross_entropy": True})
    assert_parity(run, reference_run, rtol=1e-5, later_grad_rtol=1e-5, param_rtol=1e-5)


def test_unknown_kernels_missing_packages_and_wrong_devices_name_the_option_and_the_fallback(monkeypatch):
    with pytest.raises(ConfigError, match=r"kernels=fast is unknown; valid: reference, compile, triton, liger"):
        LlamaModule("llama_tiny", kernels="fast")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gpu_only = r"kernels=triton runs Triton kernels, which need a CUDA GPU; the device is cpu.*Fallback: kernels=comp"
    with pytest.raises(ConfigError, match=gpu_only):
        check_kernels("triton", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"kernels=liger .* need a CUDA GPU"):
            LlamaModule("llama_tiny", kernels="liger")
    # An op given CPU tensors on a GPU machine says the same, at its first call.
    with pytest.raises(ConfigError, match=r"kernels=triton .*the device is cpu"):
        get_kernels("triton").swiglu(torch.ones(2), torch.ones(2))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name))
    get_kernels.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"kernels=liger needs the liger_kernel package.*pip install liger-kern"):
            get_kernels("liger")
    finally:
        get_kernels.cache_clear()


def _kept_after_forward(kernels: str) -> int:
    model = build_model("llama_tiny", seed=0)
    model.use_kernels(get_kernels(kernels))
    tokens = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(0))
    with LiveStorages() as live:
        logits = model(tokens)
    return live.alive_bytes(*model.parameters(), *model.buffers(), logits)


def test_fused_kernels_keep_for_backward_what_the_planner_prices():
    # Triton's RMSNorm keeps its input and rstd (not x * rstd), its SwiGLU the gate and up (not the SiLU output),
    # and its RoPE writes in the queries' layout, so attention's output reaches wo as a view (a contiguous RoPE
    # output made wo's input a copy, h per token and block more than the reference: measured before the fix).
    # The planner's Workload(fused_kernels=True) prices the same bytes, to the byte.
    from lightning_ultrascale.plan import GPUS
    from lightning_ultrascale.plan.cost import Candidate, Workload, estimate

    measured = _kept_after_forward("reference") - _kept_after_forward("triton")
    cfg, meta = get_model_config("llama_tiny"), build_model("llama_tiny", device="meta")
    layout = replace(Candidate.layout(), micro_batch_size=2)
    kept = {
        fused: estimate(Workload(cfg, 64, 2, precision="32-true", fused_kernels=fused), layout, meta, GPUS["cpu"])[0]
        for fused in (False, True)
    }
    kept = {fused: cost.memory["activations"] for fused, cost in kept.items()}
    tokens, h, f = 2 * 64, cfg.dim, cfg.ffn_hidden_dim
    assert measured == kept[False] - kept[True] == tokens * 4 * (cfg.n_layers * (f + 2 * h) + h)
