"""Which linears of a model run in FP8, and the module swap that makes them.

DeepSeek-V3's rule: the transformer blocks' linear layers (attention and MLA projections, dense
and shared-expert feed-forwards) compute in FP8; the embedding, the output head, the norms, the
router and the attention core (softmax) stay in high precision. A linear is converted only where
its shapes suit the recipe (blockwise: both dims multiples of 128; torchao's recipes: multiples
of 16, what FP8 tensor cores take), after tensor parallelism divides them; every other one is
listed with its reason. Routed experts (:class:`~lightning_ultrascale.models.common.moe.GroupedExperts`,
stacked weights and a grouped GEMM) are not linears and stay in high precision.

Recipes:

====================  ========================================================  ==============
recipe                scales (E4M3 unless said)                                 implementation
====================  ========================================================  ==============
tensorwise            one per tensor; gradients E5M2                            torchao
rowwise               one per row of each GEMM operand, powers of two           torchao
rowwise_with_gw_hp    rowwise; the weight gradient's GEMM in high precision     torchao
blockwise             activations and gradients 1 x 128 tiles, weights          ours
                      128 x 128 blocks (DeepSeek-V3)
====================  ========================================================  ==============

The swap keeps parameter names and shapes, so an FP8 run's checkpoint is the high-precision
model's: it loads into a bf16 run and back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ultrascale.fp8.linear import blockwise_fp8_linear
from lightning_ultrascale.kernels.quantize import TILE

__all__ = ["RECIPES", "TORCHAO_RECIPES", "BlockwiseFP8Linear", "FP8Conversion", "convert_to_fp8", "plan_fp8"]

log = logging.getLogger(__name__)

#: Recipes run by torchao's ``Float8Linear`` (torchtitan's FP8 path).
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
RECIPES = (*TORCHAO_RECIPES, "blockwise")
#: The multiple every converted dim must be (after tensor parallelism divides it).
DIM_MULTIPLE = {"tensorwise": 16, "rowwise": 16, "rowwise_with_gw_hp": 16, "blockwise": TILE}


class BlockwiseFP8Linear(nn.Linear):
    """An ``nn.Linear`` (no bias) whose three GEMMs follow DeepSeek-V3's blockwise FP8 recipe.

    Under tensor parallelism (a DTensor weight, sharded whole 128 x 128 blocks at a time) each rank
    multiplies its local shards, which quantise exactly as the same blocks of the full tensor do.
    ``emulate`` (set by :func:`convert_to_fp8`): dequantised GEMMs instead of FP8 tensor cores.
    """

    emulate: bool = True

    def forward(self, x: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(self.weight, DTensor):
            return _local_blockwise(x, self.weight, self.emulate)
        return blockwise_fp8_linear(x, self.weight, self.emulate)


def _local_blockwise(x: Tensor, weight: Tensor, emulate: bool) -> Tensor:
    """A column-parallel (weight ``Shard(0)``) or row-parallel (``Shard(1)``) blockwise GEMM on local shards."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    assert isinstance(weight, DTensor) and isinstance(x, DTensor)
    (placement,) = weight.placements
    if placement == Shard(0) and x.placements == (Replicate(),):
        # Every rank uses all of x: its gradient is the sum over the ranks' partial ones.
        y = blockwise_fp8_linear(x.to_local(grad_placements=(Partial(),)), weight.to_local(), emulate)
        out: Shard | Partial = Shard(y.ndim - 1)
    elif placement == Shard(1) and x.placements == (Shard(x.ndim - 1),):
        y = blockwise_fp8_linear(x.to_local(), weight.to_local(), emulate)
        out = Partial()
    else:
        raise NotImplementedError(
            f"blockwise FP8 under tensor parallelism runs column-parallel (weight Shard(0), input Replicate) or "
            f"row-parallel (Shard(1), input Shard(-1)) linears; got weight {weight.placements}, input {x.placements}"
        )
    return DTensor.from_local(y, weight.device_mesh, (out,), run_check=False)


@dataclass
class FP8Conversion:
    """What :func:`plan_fp8` / :func:`convert_to_fp8` decided: converted names and skipped ones with reasons."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [f"FP8 {self.recipe}: {len(self.converted)} linears converted, {len(self.skipped)} kept high precision"]
        lines += [f"  kept {name}: {reason}" for name, reason in self.skipped.items()]
        return "\n".join(lines)


def plan_fp8(model: nn.Module, recipe: str = "blockwise", tp: int = 1) -> FP8Conversion:
    """Decide which linears of ``model`` convert, without touching it.

    ``tp``: the tensor-parallel degree, which divides one dim of each block linear (both must
    still be multiples of the recipe's size, :data:`DIM_MULTIPLE`).

    Example:
        >>> from dataclasses import replace
        >>> from lightning_ultrascale.models import build_model, get_model_config
        >>> cfg = replace(get_model_config("llama_tiny"), dim=256, ffn_hidden_dim=512, n_heads=2, n_kv_heads=2)
        >>> plan = plan_fp8(build_model(cfg, device="meta"))
        >>> len(plan.converted), plan.skipped["output"]
        (28, 'the output head stays high precision')
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is unknown; valid: {', '.join(RECIPES)}")
    plan = FP8Conversion(recipe)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        reason = _reason_to_keep(name, module, DIM_MULTIPLE[recipe], tp)
        if reason is None:
            plan.converted.append(name)
        else:
            plan.skipped[name] = reason
    return plan


def convert_to_fp8(model: nn.Module, recipe: str = "blockwise", tp: int = 1, *, emulate: bool = True) -> FP8Conversion:
    """Swap the linears :func:`plan_fp8` picks for their FP8 class, in place; log and return the plan.

    ``emulate``: dequantise and multiply in high precision instead of FP8 tensor-core GEMMs (the
    same quantisation; for devices without FP8 GEMMs).
    """
    plan = plan_fp8(model, recipe, tp)
    if recipe == "blockwise":
        for name in plan.converted:
            linear = model.get_submodule(name)
            linear.__class__ = BlockwiseFP8Linear
            linear.emulate = emulate
    else:
        from torchao.float8.float8_linear import Float8Linear

        config = torchao_config(recipe, emulate=emulate)
        for name in plan.converted:
            linear = model.get_submodule(name)
            if not isinstance(linear, Float8Linear):
                model.set_submodule(name, _autocast_aware(Float8Linear).from_float(linear, config))
    log.info(plan.summary())
    return plan


_AUTOCAST_AWARE: dict[type, type] = {}


def _autocast_aware(float8_linear: type) -> type:
    """torchao's ``Float8Linear``, also taking its input in the autocast dtype under CPU autocast.

    torchao casts the input to the autocast dtype as ``F.linear`` would, but asks CUDA's autocast
    only: under CPU autocast (Lightning's bf16-mixed on CPU) fp32 inputs meet bf16 gradients.
    """
    if float8_linear not in _AUTOCAST_AWARE:

        def forward(self: nn.Module, input: Tensor) -> Tensor:
            if input.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
                input = input.to(torch.get_autocast_dtype("cpu"))
            return float8_linear.forward(self, input)

        _AUTOCAST_AWARE[float8_linear] = type(float8_linear.__name__, (float8_linear,), {"forward": forward})
    return _AUTOCAST_AWARE[float8_linear]


def torchao_config(recipe: str, *, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe``; FSDP FP8 all-gather is switched on by ZeRO-3 later."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


def _reason_to_keep(name: str, linear: nn.Linear, multiple: int, tp: int) -> str | None:
    if not name.startswith("layers.") and ".layers." not in f".{name}":
        return "the output head stays high precision" if name.endswith("output") else "outside the blocks"
    if linear.bias is not None:
        return "has a bias (the FP8 linears have none)"
    dims = {"in_features": linear.in_features, "out_features": linear.out_features}
    bad = [f"{d}={n}" for d, n in dims.items() if n % (multiple * tp)]
    if bad:
        per_rank = f" / tp={tp}" if tp > 1 else ""
        return f"{' and '.join(bad)}{per_rank} not a multiple of {multiple}"
    return None
