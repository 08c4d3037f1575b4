"""FP8 in the time model: which GEMMs a recipe runs in FP8, how much faster, and what its quantisation costs.

Derived term by term from what each recipe runs, not fitted to a published FP8 run:

- **Which linears**: the blocks' attention projections, dense feed-forwards and shared experts (the
  linears :mod:`lightning_ultrascale.fp8.convert` converts: both dims, after tensor parallelism,
  multiples of the recipe's :data:`~lightning_ultrascale.fp8.convert.DIM_MULTIPLE`). The embedding, the
  head, the norms, the router, the routed experts and the attention core stay bf16.
- **Which of their GEMMs** (:data:`FP8_GEMMS`): forward, input gradient (dgrad) and weight gradient
  (wgrad); ``rowwise_with_gw_hp`` keeps the weight gradient's GEMM in bf16.
- **How fast**: a GEMM in FP8 runs at its bf16 time (the planner's roofline, with the GPU's fitted
  ``matmul_efficiency``) over the GPU's measured FP8/bf16 ratio at that shape
  (:meth:`~lightning_ultrascale.plan.hardware.Hardware.fp8_speedup`: the FP8 peak, twice bf16's on
  Hopper, times FP8's efficiency relative to bf16's by the GEMM's narrowest dim). A GPU without FP8
  tensor cores emulates (dequantise, bf16 GEMM): no speed-up, and the quantisation still costs.
- **What the recipe adds** (:data:`QUANT_BYTES`), at memory bandwidth: each quantisation reads its
  high-precision operand for the scale (an amax pass), reads it again to scale and cast, writes the
  FP8 copy; an operand needed in the other major order for a later GEMM is transposed (tensorwise,
  blockwise: the FP8 copy, 1 + 1 bytes) or quantised again along the other axis (rowwise: its
  scales run along the rows). Weights are read as fp32 masters (4 bytes). Tensorwise also agrees on
  each activation's scale across the tensor-parallel group: one scalar all-reduce per converted
  linear's input and output gradient (its latency).
- **FP8 all-gather under ZeRO-3** (tensorwise, ``fp8_all_gather``): the converted weights travel in
  FP8, half of bf16's bytes (:func:`converted_numel` gives their share; the data plugin prices it).

Counted as torchao runs the recipes in eager mode; ``torch.compile`` fuses some amax passes into
the kernels that produce the operand, so a compiled run can spend less than this.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_ultrascale.fp8.convert import DIM_MULTIPLE, RECIPES

__all__ = ["FP8_GEMMS", "QUANT_BYTES", "converted_numel", "linear_seconds", "scaling"]

#: The GEMMs of a converted linear each recipe computes in FP8 (the rest in bf16).
FP8_GEMMS: dict[str, tuple[str, ...]] = {
    "tensorwise": ("fwd", "dgrad", "wgrad"),
    "rowwise": ("fwd", "dgrad", "wgrad"),
    "rowwise_with_gw_hp": ("fwd", "dgrad"),
    "blockwise": ("fwd", "dgrad", "wgrad"),
}

#: Bytes each recipe's quantisation moves per converted linear, per forward with its backward:
#: ``(activation, weight)``: per element of the input (T x K) and of the output gradient (T x N), and
#: per weight element (K x N). An activation: amax read (2) + cast read and write (2 + 1) = 5 per
#: quantisation; tensorwise and blockwise transpose the FP8 copy for the weight gradient (+2), rowwise
#: quantises again along the other axis (+5); gw_hp quantises each activation once (its weight
#: gradient runs on the bf16 ones). A weight (fp32 master): amax 4 + cast 4 + 1 = 9 per quantisation;
#: the input gradient needs it transposed (+2 for tensorwise and blockwise; rowwise quantises again, +9).
QUANT_BYTES: dict[str, tuple[float, float]] = {
    "tensorwise": (5 + 2, 9 + 2),
    "rowwise": (5 + 5, 9 + 9),
    "rowwise_with_gw_hp": (5, 9 + 9),
    "blockwise": (5 + 5, 9 + 2),
}


def scaling(recipe: str) -> str:
    """The scaling of ``recipe``'s GEMMs, which names its row of the GPU's FP8 efficiency table.

    Example:
        >>> scaling("rowwise_with_gw_hp"), scaling("tensorwise")
        ('rowwise', 'tensorwise')
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is unknown; valid: {', '.join(RECIPES)}")
    return "rowwise" if recipe.startswith("rowwise") else recipe


def converts(recipe: str, k: float, n: float) -> bool:
    """Whether a linear of local shape ``k`` x ``n`` (after tensor parallelism) converts under ``recipe``."""
    multiple = DIM_MULTIPLE[recipe]
    return k % multiple == 0 and n % multiple == 0


def linear_seconds(
    gemm: Any, t: float, k: float, n: float, recipe: str | None, gpu: Any, byte_rate: float, sync: float = 0.0
) -> float:
    """Seconds of one linear's three GEMMs (``t`` tokens, ``k`` in, ``n`` out), with ``recipe``'s FP8 if it converts.

    ``gemm(m, k, n, count)``: the bf16 roofline time of ``count`` GEMMs of that shape; ``byte_rate``:
    achieved memory bandwidth (the quantisation passes); ``sync``: seconds of the scale agreement.

    Example:
        >>> from lightning_ultrascale.plan.hardware import get_hardware
        >>> h100 = get_hardware("h100")
        >>> bf16 = lambda m, k, n, count=1: count * 2 * m * k * n / (h100.peak_flops * h100.matmul_efficiency)
        >>> big = [linear_seconds(bf16, 8192, 8192, 3584, r, h100, 2.7e12) for r in (None, "tensorwise")]
        >>> round(big[0] / big[1], 2)  # FP8 GEMMs 1.84x, less the quantisation passes (8k tokens)
        1.43
    """
    bf16 = gemm(t, k, n, 3)
    if recipe is None or not converts(recipe, k, n):
        return bf16
    in_fp8 = len(FP8_GEMMS[recipe])
    fp8 = gemm(t, k, n, in_fp8) / gpu.fp8_speedup(scaling(recipe), min(t, k, n))
    activation, weight = QUANT_BYTES[recipe]
    quantise = (activation * t * (k + n) + weight * k * n) / byte_rate
    return fp8 + gemm(t, k, n, 3 - in_fp8) + quantise + sync


def converted_numel(spec: Any, layers: Iterable[int], tp: int, recipe: str) -> int:
    """Parameters of the blocks ``layers`` (this rank's share under ``tp``) in the linears ``recipe`` converts.

    Example:
        >>> from lightning_ultrascale.models.common.decoder import llama_spec
        >>> from lightning_ultrascale.models import get_model_config
        >>> spec = llama_spec(get_model_config("llama3_8b"))
        >>> converted_numel(spec, range(32), 1, "tensorwise") / 1e9  # all but the embedding and the head
        6.979321856
    """
    h, hd = spec.dim, spec.head_dim or spec.dim // spec.n_heads
    vd = spec.v_head_dim or hd
    # (in, out, row-parallel: tensor parallelism splits the input dim, else the output dim)
    attention = [(h, spec.n_heads * hd, False), (h, spec.n_kv_heads * (hd + vd), False), (spec.n_heads * vd, h, True)]
    shared = spec.n_shared_experts * spec.expert_ffn_dim
    ffn = {
        False: [(h, 2 * spec.ffn_dim, False), (spec.ffn_dim, h, True)] if spec.ffn_dim else [],
        True: [(h, 2 * shared, False), (shared, h, True)] if shared else [],
    }
    total = 0
    for layer in layers:
        for k, n, row in (*attention, *ffn[spec.is_moe_block(layer)]):
            local = (k // tp, n) if row else (k, n // tp)
            if converts(recipe, *local):
                total += local[0] * local[1]
    return total


def efficiency_table(report: dict[str, Any]) -> dict[str, tuple[tuple[int, float], ...]]:
    """FP8's efficiency relative to bf16's by a GEMM's narrowest dim, from ``benchmarks/gpu_check.py``'s report.

    The ``fp8_gemm`` section's TFLOP/s of each scaling over bf16's at the same shape, halved (FP8's
    peak is twice bf16's), averaged over the GEMMs of each narrowest dim; squares under 4096 left
    out (a few microseconds each: launch-bound, unlike a training step's GEMMs). Blockwise from the
    ``fp8`` section's one 8192^3 GEMM, with tensorwise's narrowest point. What
    :attr:`~lightning_ultrascale.plan.hardware.Hardware.fp8_gemm_efficiency` holds for a GPU measured
    so (``python benchmarks/gpu_check.py --sections fp8_gemm,fp8`` on yours).
    """
    by_width: dict[str, dict[int, list[float]]] = {"tensorwise": {}, "rowwise": {}}
    for name, gemms in report["sections"]["fp8_gemm"]["results"].items():
        for row in gemms.values():
            width = min(row["shape"])
            if name.startswith("square") and width < 4096:
                continue
            for kind, widths in by_width.items():
                widths.setdefault(width, []).append(row[f"{kind}_tflops"] / row["bf16_tflops"] / 2)
    table = {
        kind: tuple((w, round(sum(v) / len(v), 3)) for w, v in sorted(widths.items()))
        for kind, widths in by_width.items()
    }
    block = report["sections"]["fp8"]["results"]
    table["blockwise"] = (table["tensorwise"][0], (8192, round(block["gemm_bf16_ms"] / block["gemm_ms"] / 2, 3)))
    return table
