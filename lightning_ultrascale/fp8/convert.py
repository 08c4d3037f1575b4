"""Which linears of a model run in FP8, and the module swap that makes them.

DeepSeek-V3's rule: the transformer blocks' linear layers (attention and MLA projections, dense
and shared-expert feed-forwards) compute in FP8; the embedding, the output head, the norms, the
router and the attention core (softmax) stay in high precision. A linear is converted only where
its shapes suit the recipe (blockwise: both dims multiples of 128); every other one is listed with
its reason. Routed experts (:class:`~lightning_ultrascale.models.moe.GroupedExperts`, stacked
weights and a grouped GEMM) are not linears and stay in high precision.

The swap changes a module's class only, so parameter names, shapes and checkpoints are those of
the high-precision model: an FP8 run's checkpoint loads into a bf16 run and back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import Tensor, nn

from lightning_ultrascale.fp8.linear import blockwise_fp8_linear
from lightning_ultrascale.fp8.quantize import TILE

__all__ = ["BlockwiseFP8Linear", "FP8Conversion", "convert_to_fp8", "plan_fp8"]

log = logging.getLogger(__name__)

#: Recipes this module converts (the torchao ones come with the precision plugin).
RECIPES = ("blockwise",)


class BlockwiseFP8Linear(nn.Linear):
    """An ``nn.Linear`` (no bias) whose three GEMMs follow DeepSeek-V3's blockwise FP8 recipe."""

    def forward(self, x: Tensor) -> Tensor:
        return blockwise_fp8_linear(x, self.weight)


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


def plan_fp8(model: nn.Module, recipe: str = "blockwise") -> FP8Conversion:
    """Decide which linears of ``model`` convert, without touching it.

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
        if type(module) is not nn.Linear and not isinstance(module, BlockwiseFP8Linear):
            continue
        reason = _reason_to_keep(name, module)
        if reason is None:
            plan.converted.append(name)
        else:
            plan.skipped[name] = reason
    return plan


def convert_to_fp8(model: nn.Module, recipe: str = "blockwise") -> FP8Conversion:
    """Swap the linears :func:`plan_fp8` picks for their FP8 class, in place; log and return the plan."""
    plan = plan_fp8(model, recipe)
    for name in plan.converted:
        model.get_submodule(name).__class__ = BlockwiseFP8Linear
    log.info(plan.summary())
    return plan


def _reason_to_keep(name: str, linear: nn.Linear) -> str | None:
    if not name.startswith("layers.") and ".layers." not in f".{name}":
        return "the output head stays high precision" if name.endswith("output") else "outside the blocks"
    if linear.bias is not None:
        return "has a bias (the FP8 linear has none)"
    dims = {"in_features": linear.in_features, "out_features": linear.out_features}
    bad = [f"{d}={n}" for d, n in dims.items() if n % TILE]
    if bad:
        return f"{' and '.join(bad)} not a multiple of {TILE} (blockwise tiles)"
    return None
