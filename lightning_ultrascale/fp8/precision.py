"""FP8Precision: FP8 training as a Lightning precision plugin, applied first in the strategy's order.

The plugin is two things at once: Lightning's mixed precision (bf16 autocast over fp32 master
weights, or plain fp32) for everything that stays high precision, and the first rewrite of the
meta-device model under :class:`~lightning_ultrascale.UltraScaleStrategy`: the swap of the blocks'
linears for FP8 ones (:mod:`lightning_ultrascale.fp8.convert`), before the pipeline split, tensor
parallelism and ZeRO see the model. The swap leaves facts in the Layout for the later plugins:

- ``linear_styles``: tensor parallelism shards each FP8 linear with the style of its kind, from the
  model's one plan (tensorwise: torchao's Float8 column/row-wise styles; the other recipes take
  the plan's own styles: torchao's Float8 styles assume one scale per tensor);
- ``all_gather_casts`` (tensorwise only): ZeRO-3 all-gathers those weights in FP8, one byte per
  parameter instead of bf16's two (each rank casts its shard with the global amax, so the
  gathered weight is the single-process FP8 weight). Rowwise and blockwise weights are gathered in
  bf16: rowwise needs the full row, and the transposed copy the backward needs, to scale.

What stays high precision (DeepSeek-V3's rule): embedding, output head, norms, MoE router and
routed experts, the attention core; plus any linear whose dims do not suit the recipe (listed in
the log with the reason).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Generator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from typing_extensions import override

from lightning_ultrascale.errors import ConfigError, option
from lightning_ultrascale.fp8.convert import RECIPES, TORCHAO_RECIPES, FP8Conversion, convert_to_fp8
from lightning_ultrascale.kernels import cuda
from lightning_ultrascale.models.spec import ModelSpec, spec_of
from lightning_ultrascale.parallel.dims import DataShape, ParallelDims
from lightning_ultrascale.parallel.layout import Layout
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.parallel.tensor import LINEAR_STYLES

__all__ = ["FP8Precision", "FP8Swap"]

log = logging.getLogger(__name__)

#: The high-precision setting each recipe runs under (what autocast does around the FP8 GEMMs).
#: torchao's rowwise GEMM writes bf16 only (CUDA's rowwise-scaled ``_scaled_mm``); bf16-true is
#: never offered: FP8 training keeps fp32 master weights (the updates are far below bf16's ulp).
BASE_PRECISIONS: dict[str, tuple[str, ...]] = {
    "tensorwise": ("bf16-mixed", "32-true"),
    "rowwise": ("bf16-mixed",),
    "rowwise_with_gw_hp": ("bf16-mixed",),
    "blockwise": ("bf16-mixed", "32-true"),
}


def fp8_gemms_available(blockwise: bool = False) -> bool:
    """Whether this machine has FP8 tensor-core GEMMs: compute capability 8.9 or later; for blockwise scales, 9.x.

    torch's blockwise ``scaled_mm`` (1 x 128 / 128 x 128 scales) runs on Hopper only: ScaledBlas.cpp
    ``_check_deepseek_support`` refuses any other major version, Blackwell (10.x, 12.x) included.
    """
    if blockwise and not hasattr(torch.nn.functional, "scaled_mm"):  # torch's blockwise recipes (2.13 has them)
        return False
    capability = cuda.capability()
    if capability is None:
        return False
    return capability[0] == 9 if blockwise else capability >= (8, 9)


class FP8Precision(MixedPrecision):
    """Train the transformer blocks' linears in FP8 with ``recipe``; the rest in ``precision``.

    Args:
        recipe: ``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"`` (torchao's, as torchtitan
            runs them) or ``"blockwise"`` (DeepSeek-V3's 1 x 128 / 128 x 128 scales, ours).
        precision: what the high-precision parts run in: ``"bf16-mixed"`` (default: bf16 autocast,
            fp32 master weights) or, for tensorwise and blockwise, ``"32-true"``.
        emulate: dequantise and multiply in high precision instead of FP8 tensor-core GEMMs (the
            same quantisation, hence the same numerics up to summation order). Default: emulate
            where the machine has no FP8 GEMMs (CPU, GPUs before Ada/Hopper; for blockwise, whose
            1 x 128 / 128 x 128 ``scaled_mm`` torch runs on Hopper only, any GPU but Hopper).
        fp8_all_gather: tensorwise under ZeRO-3: all-gather weights in FP8 (half of bf16's bytes).
        device: the autocast device type; default: ``"cuda"`` where there is one, else ``"cpu"``.

    Under Lightning Fabric, give it to ``L.Fabric(plugins=[...])`` with
    ``lightning_ultrascale.FabricStrategy``, which takes it in Fabric's interface.

    Example:
        >>> import lightning as L
        >>> from lightning_ultrascale import FP8Precision, UltraScaleStrategy, ZeRO
        >>> trainer = L.Trainer(  # doctest: +SKIP
        ...     strategy=UltraScaleStrategy(ZeRO(stage=3)), plugins=[FP8Precision("tensorwise")], devices=8
        ... )
        >>> FP8Precision("blockwise").precision
        'bf16-mixed'
    """

    def __init__(
        self,
        recipe: str = "rowwise",
        precision: str = "bf16-mixed",
        *,
        emulate: bool | None = None,
        fp8_all_gather: bool = True,
        device: str | None = None,
    ) -> None:
        if recipe not in RECIPES:
            raise ConfigError(f"{option(self, 'recipe', recipe)} is unknown; valid: {', '.join(RECIPES)}")
        bases = BASE_PRECISIONS[recipe]
        if precision not in bases:
            why = (
                "FP8 training keeps fp32 master weights (use bf16-mixed for bf16 compute)"
                if precision == "bf16-true"
                else f"the {recipe} recipe runs its high-precision parts in " + " or ".join(bases)
            )
            valid = ", ".join(bases)
            raise ConfigError(f"{option(self, 'precision', precision)} cannot carry FP8: {why}; valid: {valid}")
        if recipe == "blockwise" and emulate is False and not fp8_gemms_available(blockwise=True):
            raise ConfigError(
                f"{option(self, 'emulate', False)} with the blockwise recipe needs torch's blockwise FP8 GEMM, which "
                f"runs on compute capability 9.x (Hopper) only; this device: {_device_name()}. The emulated path "
                "(emulate=None or True) runs the same quantisation on any device"
            )
        if recipe in TORCHAO_RECIPES:
            _require_torchao(recipe)
        super().__init__("bf16-mixed", device or ("cuda" if torch.cuda.is_available() else "cpu"))
        #: Lightning's name of the high-precision setting (ZeRO-3 picks its dtype policy from it).
        self.precision = precision  # type: ignore[assignment]
        self.recipe = recipe
        available = fp8_gemms_available(blockwise=recipe == "blockwise")
        self.emulate = (not available) if emulate is None else emulate
        self.fp8_all_gather = fp8_all_gather
        self.swap = FP8Swap(recipe, emulate=self.emulate, fp8_all_gather=fp8_all_gather)

    @contextlib.contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision == "32-true":
            yield
            return
        with super().forward_context():
            yield

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, model, closure, **kwargs)
        self.after_step(model)
        return result

    def after_step(self, model: nn.Module) -> None:
        """After each optimizer step (the Trainer's or Fabric's): the scales FP8 all-gathers need, if used."""
        if self.recipe == "tensorwise" and self.fp8_all_gather:
            # The next step's FP8 all-gathers need each weight's scale: one all-reduce of every
            # amax now (torchao's helper), instead of one per weight at every gather.
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

    def parallel_plugin(self) -> FP8Swap:
        """The module swap, which :class:`~lightning_ultrascale.UltraScaleStrategy` applies first."""
        return self.swap

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        # Under another strategy (one device, Lightning's DDP) the swap happens here, where Lightning
        # converts modules for precision; under UltraScaleStrategy it already happened, on meta.
        model = next((m for m in module.modules() if spec_of(m) is not None), module)
        if model not in self.swap.applied_to:
            self.swap.convert(model, tp=1)
        return module

    def __repr__(self) -> str:
        return f"FP8Precision(recipe={self.recipe!r}, precision={self.precision!r}, emulate={self.emulate})"


def _device_name() -> str:
    capability = cuda.capability()
    return "no CUDA GPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"


class FP8Swap(ParallelPlugin):
    """The FP8 module swap as a step of the strategy's fixed order (built by :class:`FP8Precision`).

    Example:
        >>> FP8Swap("blockwise").settings()
        {'recipe': 'blockwise'}
    """

    applies_at = "fp8"

    def __init__(self, recipe: str, *, emulate: bool = True, fp8_all_gather: bool = True) -> None:
        self.recipe = recipe
        self.emulate = emulate
        self.fp8_all_gather = fp8_all_gather
        #: What the last :meth:`apply` converted and kept (for logs and tests).
        self.conversion: FP8Conversion | None = None
        #: The models already swapped (Lightning's ``convert_module`` must not swap them again).
        self.applied_to: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def mesh_sizes(self) -> dict[str, int | None]:
        return {}

    def settings(self) -> dict[str, Any]:
        return {"recipe": self.recipe}

    def validate(self, dims: ParallelDims, spec: ModelSpec, data: DataShape | None) -> None:
        pass  # a linear the recipe cannot take stays high precision, listed with its reason

    def apply(self, model: nn.Module, layout: Layout) -> nn.Module:
        plan = self.convert(model, tp=layout.dims.tp)
        kind = "fp8_tensorwise" if self.recipe == "tensorwise" else "fp8"
        for name in plan.converted:
            layout.linear_styles[name] = kind
            if self.recipe == "tensorwise" and self.fp8_all_gather:
                layout.all_gather_casts[name] = _fp8_all_gather_weight
        return model

    def convert(self, model: nn.Module, tp: int) -> FP8Conversion:
        """Swap ``model``'s linears (shards of ``tp``), remember it and what was converted."""
        plan = convert_to_fp8(model, self.recipe, tp=tp, emulate=self.emulate)
        if not plan.converted:
            log.warning("FP8 %s converted no linear: every linear of the model stays high precision", self.recipe)
        self.conversion = plan
        self.applied_to.add(model)
        return plan


def _fp8_all_gather_weight(linear: nn.Module) -> None:
    """torchao's weight wrapper whose FSDP2 all-gather moves the FP8 bytes and the global scale."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    weight = linear.weight
    if isinstance(weight, WeightWithDynamicFloat8CastTensor):
        return
    target = linear.config.cast_config_weight.target_dtype  # type: ignore[union-attr]
    wrapped = WeightWithDynamicFloat8CastTensor(weight, linear.linear_mm_config, target)
    linear.weight = nn.Parameter(wrapped, requires_grad=weight.requires_grad)


def _float8_tensorwise_style(style: ParallelStyle) -> ParallelStyle:
    """torchao's Float8 counterpart of a plan's column/row-wise style (same layouts).

    Those styles move FP8 activations and gradients through DTensor collectives, which gloo
    cannot carry (float8 goes by send/recv only there): on gloo the plan's own style stays, and
    the linears still compute in FP8 on their DTensor shards (same quantisation, bf16 traffic).
    """
    import torch.distributed as dist
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    if dist.is_initialized() and dist.get_backend() == "gloo":
        return style

    for plain, float8 in ((ColwiseParallel, Float8ColwiseParallel), (RowwiseParallel, Float8RowwiseParallel)):
        if type(style) is plain:
            assert isinstance(style, (ColwiseParallel, RowwiseParallel))
            return float8(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
    return style


LINEAR_STYLES["fp8_tensorwise"] = _float8_tensorwise_style
LINEAR_STYLES["fp8"] = lambda style: style


def _require_torchao(recipe: str) -> None:
    try:
        with _quiet_torchao_import():
            import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"FP8Precision(recipe={recipe!r}) runs through torchao, which is not installed ({e}); "
            "pip install 'torchao>=0.18' (or use recipe='blockwise', which needs nothing else)"
        ) from e


@contextlib.contextmanager
def _quiet_torchao_import() -> Generator[None, None, None]:
    """torchao logs a warning for each CUDA extension it cannot load on a CPU-only build: harmless."""
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
