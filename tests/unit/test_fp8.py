"""FP8: quantisation against an independent reference quantiser, DeepSeek-V3's blockwise linear, the module swap."""

from dataclasses import replace

import pytest
import torch

from lightning_ultrascale.data.corpus import load_default_corpus_tokens
from lightning_ultrascale.fp8 import (
    E4M3_MAX,
    Quantized,
    blockwise_fp8_linear,
    convert_to_fp8,
    plan_fp8,
    quantize,
    to_e4m3,
)
from lightning_ultrascale.models import build_model, get_model_config


# ------------------------------------------------------------------------ an independent reference
def _reference(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise group by group with explicit loops: E4M3 data and fp32 scales (amax / 448)."""
    x = x.float()
    rows = x.reshape(-1, x.shape[-1])
    m, k = rows.shape
    if granularity == "tensor":
        groups = [[(slice(0, m), slice(0, k))]]
    elif granularity == "row":
        groups = [[(slice(i, i + 1), slice(0, k))] for i in range(m)]
    elif granularity == "tile":
        groups = [[(slice(i, i + 1), slice(j, j + 128))] for i in range(m) for j in range(0, k, 128)]
    else:  # block
        groups = [[(slice(i, i + 128), slice(j, j + 128))] for i in range(0, m, 128) for j in range(0, k, 128)]
    data = torch.empty(m, k, dtype=torch.float8_e4m3fn)
    scales = []
    for (where,) in groups:
        block = rows[where]
        amax = max(float(v) for v in block.abs().flatten())
        scale = torch.tensor(max(amax, 1e-12), dtype=torch.float32) / torch.tensor(448.0)
        scales.append(scale)
        scaled = block / scale
        data[where] = torch.where(scaled.abs() > 448, scaled.sign() * 448, scaled).to(torch.float8_e4m3fn)
    scale = torch.stack(scales)
    shapes = {"tensor": (), "row": (*x.shape[:-1], 1), "tile": (*x.shape[:-1], k // 128)}
    return data.reshape(x.shape), scale.reshape(shapes.get(granularity, (m // 128, k // 128)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize(
    ("granularity", "shape"),
    [("tensor", (5, 3, 40)), ("row", (2, 7, 33)), ("tile", (3, 5, 384)), ("block", (256, 384))],
)
def test_every_granularity_equals_the_reference_bit_for_bit(granularity, shape):
    g = torch.Generator().manual_seed(0)
    # Groups of very different magnitudes, so that a scale from the wrong group would show.
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    q = quantize(x, granularity)
    data, scale = _reference(x, granularity)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert q.scale.shape == scale.shape and torch.equal(q.scale, scale)
    assert torch.equal(_bits(q.data), _bits(data))
    # Each group's largest magnitude lands on E4M3's largest value.
    assert float(q.data.float().abs().max()) == E4M3_MAX


def test_e4m3_saturates_at_448():
    x = torch.tensor([448.0, 449.0, 500.0, -1e6, float("inf"), float("-inf"), 0.5])
    assert to_e4m3(x).float().tolist() == [448.0, 448.0, 448.0, -448.0, 448.0, -448.0, 0.5]


@pytest.mark.parametrize("granularity", ["tensor", "row", "tile"])
def test_zero_huge_and_infinite_inputs_give_no_nan_or_inf(granularity):
    zero = quantize(torch.zeros(2, 256), granularity)
    assert torch.equal(zero.dequantize(), torch.zeros(2, 256)) and torch.isfinite(zero.scale).all()
    huge = torch.full((2, 256), 3e38)
    huge[0, 0] = float("inf")
    q = quantize(huge, granularity)
    assert torch.isfinite(q.scale).all() and torch.isfinite(q.dequantize()).all()
    assert not q.data.float().isnan().any()


@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block"])
def test_round_trip_error_is_within_e4m3_half_ulp(granularity):
    # E4M3 has 3 mantissa bits: a normal value is off by at most 2^-4 of itself, a subnormal one
    # (below 2^-6 in scaled units) by at most half the subnormal step 2^-9, i.e. 2^-10 x scale.
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 4, 512)
    q = quantize(x, granularity)
    # Each entry's scale: its group's amax / 448, from the reference quantiser's amax per group.
    _, scale = _reference(x, granularity)
    ones = Quantized(torch.ones_like(x).to(torch.float8_e4m3fn), scale, granularity)
    per_entry = ones.dequantize()
    bound = 2**-4 * x.abs() + 2**-10 * per_entry
    assert ((q.dequantize() - x).abs() <= bound * (1 + 1e-6)).all()


def test_power_of_two_scales_cover_the_amax():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    q = quantize(x, "row", pow2_scales=True)
    assert torch.equal(q.scale, torch.exp2(torch.log2(q.scale).round()))
    assert (q.scale * E4M3_MAX >= x.abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize(
    ("granularity", "shape", "message"),
    [
        ("tiles", (4, 128), "granularity='tiles' is unknown; valid: tensor, row, tile, block"),
        ("tile", (4, 100), r"tile quantisation needs the last dim a multiple of 128; got \(4, 100\)"),
        ("block", (100, 128), r"block quantisation needs a 2-D tensor, both dims multiples of 128"),
    ],
)
def test_bad_shapes_and_names_say_what_is_valid(granularity, shape, message):
    with pytest.raises(ValueError, match=message):
        quantize(torch.ones(shape), granularity)


# ------------------------------------------------------------------------ the blockwise linear
def _dequantized(x: torch.Tensor, granularity: str) -> torch.Tensor:
    data, scale = _reference(x, granularity)
    if granularity == "tile":
        return (data.float().reshape(*x.shape[:-1], -1, 128) * scale[..., None]).reshape(x.shape)
    m, k = x.shape
    return (data.float().reshape(m // 128, 128, k // 128, 128) * scale[:, None, :, None]).reshape(m, k)


def test_blockwise_linear_computes_deepseek_v3s_three_gemms():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 128, 256, generator=g, requires_grad=True)
    w = (torch.randn(384, 256, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(2, 128, 384, generator=g)
    y = blockwise_fp8_linear(x, w)
    y.backward(dy)

    # The recipe written out with the reference quantiser: forward x (1x128) W (128x128); input
    # gradient dy (1x128) W; weight gradient dy^T and x both in 128x1 tiles, x from its FP8 copy.
    x2, dy2 = x.detach().reshape(256, 256), dy.reshape(256, 384)
    qx, qw = _dequantized(x2, "tile"), _dequantized(w.detach(), "block")
    want_y = qx @ qw.t()
    want_dx = _dequantized(dy2, "tile") @ qw
    want_dw = _dequantized(dy2.t().contiguous(), "tile") @ _dequantized(qx.t().contiguous(), "tile").t()
    # Same operands, fp32 accumulation: only the order of the additions may differ.
    torch.testing.assert_close(y.detach().reshape(256, 384), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(256, 256), want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, want_dw, rtol=1e-5, atol=1e-5)

    # And it is a linear layer: within E4M3's error of the fp32 one (deterministic quantisation
    # error, 3.7-4.4% relative on these inputs, not reduction-order noise: the bound only checks scale).
    x3, w3 = x.detach().requires_grad_(), w.detach().requires_grad_()
    exact = x3 @ w3.t()
    exact.backward(dy)
    for got, ref in ((y, exact), (x.grad, x3.grad), (w.grad, w3.grad)):
        assert float((got.detach() - ref.detach()).norm() / ref.detach().norm()) < 0.08


def test_blockwise_linear_keeps_the_weight_dtype_and_saves_fp8():
    x = torch.randn(128, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, 128, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        y = blockwise_fp8_linear(x, w)
    y.sum().backward()
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert saved.count(torch.float8_e4m3fn) == 2 and torch.bfloat16 not in saved  # E4M3 x and W, fp32 scales


def test_weight_gradient_pads_a_token_count_that_is_not_a_multiple_of_128():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(150, 128, generator=g, requires_grad=True)
    w = torch.randn(256, 128, generator=g, requires_grad=True)
    dy = torch.randn(150, 256, generator=g)
    blockwise_fp8_linear(x, w).backward(dy)
    pad = torch.nn.functional.pad
    x_t = pad(_dequantized(x.detach(), "tile").t(), (0, 106)).contiguous()  # 150 tokens -> 256, zeros
    want = _dequantized(pad(dy.t(), (0, 106)).contiguous(), "tile") @ _dequantized(x_t, "tile").t()
    torch.testing.assert_close(w.grad, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ which linears convert
SMALL = replace(get_model_config("llama_tiny"), dim=256, ffn_hidden_dim=512, n_heads=2, n_kv_heads=2, name="small")


def test_the_blocks_linears_convert_and_the_head_and_small_dims_stay_high_precision():
    plan = plan_fp8(build_model(SMALL, device="meta"))
    per_block = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]
    per_block += ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    assert plan.converted == [f"layers.{i}.{n}" for i in range(4) for n in per_block]
    assert plan.skipped == {"output": "the output head stays high precision"}
    tiny = plan_fp8(build_model("moe_tiny", device="meta"))  # dim 64: nothing suits 128-wide tiles
    assert not tiny.converted and "router" not in " ".join(tiny.skipped)  # router and experts are no linears
    assert tiny.skipped["layers.1.feed_forward.shared_experts.w2"] == (
        "in_features=64 and out_features=64 not a multiple of 128"
    )
    # torchao's recipes take multiples of 16; tensor parallelism divides each dim first.
    assert not plan_fp8(build_model("moe_tiny", device="meta"), "rowwise").skipped.get("layers.1.feed_forward.w1")
    halved = plan_fp8(build_model(replace(get_model_config("llama_small"), n_kv_heads=2), device="meta"), tp=2)
    assert halved.skipped["layers.0.attention.wk"] == "out_features=128 / tp=2 not a multiple of 128"
    assert "layers.0.attention.wq" in halved.converted
    with pytest.raises(ValueError, match=r"recipe=.mxfp8. is unknown; valid: tensorwise, rowwise, rowwise_with_gw_hp"):
        plan_fp8(build_model(SMALL, device="meta"), "mxfp8")


def test_a_converted_model_keeps_its_checkpoint_and_trains_like_the_high_precision_one():
    data = load_default_corpus_tokens()[: 65 * 4 * 12].long().reshape(-1, 65)
    cfg = replace(SMALL, n_layers=2)

    def train(fp8: bool) -> tuple[list[float], dict]:
        model = build_model(cfg, seed=0)
        if fp8:
            assert len(convert_to_fp8(model).converted) == 14
        keys = {k: v.shape for k, v in model.state_dict().items()}
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for batch in data.split(4):  # 12 steps of 4 x 64 tokens (256: two 128-token tiles)
            loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(loss.item())
        return losses, keys

    (high, high_keys), (fp8, fp8_keys) = train(False), train(True)
    assert fp8_keys == high_keys  # same names and shapes: checkpoints are interchangeable
    # Measured: the last 4 steps' mean within 0.03% of fp32 (60 steps of a 4-layer model: 0.2%).
    # Bound 2%, the bar for the 200-step comparison; a wrong scale or a dropped gradient
    # leaves the loss far above (the first step is 5.7, the last ones about 3.1).
    assert abs(sum(fp8[-4:]) - sum(high[-4:])) / sum(high[-4:]) < 0.02, (fp8, high)
    assert fp8[-1] < 0.7 * fp8[0]


def test_blockwise_fp8_gemms_call_scaled_mm_with_the_layouts_torch_checks():
    # No FP8 GPU here: the tensor-core path (emulate=False) runs on meta tensors, whose scaled_mm
    # registration checks every operand and scale layout of the three GEMMs (1x128 x 128x128
    # forward and for dx, 1x128 x 1x128 for dW); 200 tokens pad dW's tiles.
    from lightning_ultrascale.fp8.linear import blockwise_fp8_linear

    x = torch.empty(200, 256, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(384, 256, device="meta", requires_grad=True)
    y = blockwise_fp8_linear(x, w, emulate=False)
    y.backward(torch.empty_like(y))
    assert (y.shape, y.dtype) == ((200, 384), torch.bfloat16)
    assert (x.grad.shape, x.grad.dtype, w.grad.shape, w.grad.dtype) == (x.shape, x.dtype, w.shape, torch.float32)
