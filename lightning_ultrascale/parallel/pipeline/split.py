"""Stage split: which blocks, and whether the embedding and the head, each pipeline stage holds.

A stage is a contiguous run of transformer blocks; the first stage also embeds the tokens, the
last also applies the final norm and the output head. Counting blocks alone overloads the last
stage: Llama 3 8B's head (4096 x 128256) costs as much compute as 2.4 blocks, and a 1B model's
head (2048 x 128256) as much as 4.5 of its blocks. So the split balances *costs*: training FLOPs per
token of every piece (6 x its parameters for a matmul; the embedding is a lookup, nearly free),
and minimises the most expensive stage (the pipeline runs at the pace of its slowest stage).
Users can give the split points instead, as module names (``"layers.4"``: a stage begins there).

Pure Python: planned identically on every rank, before anything is materialised.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_ultrascale.errors import ConfigError, option
from lightning_ultrascale.models.spec import ModelSpec, piece

_OWNER = "PipelineParallel"


@dataclass(frozen=True)
class PieceCosts:
    """Training FLOPs per token of each piece of the model (forward + backward)."""

    embedding: float
    blocks: tuple[float, ...]
    head: float  # final norm + output projection


def _matmul_flops(module: nn.Module | None) -> float:
    # 2 FLOPs per weight per token forward, 4 backward (input and weight gradients); vectors
    # (norm gains) act elementwise: about 4 FLOPs per element per token.
    if module is None:
        return 0.0
    return float(sum((6 if p.ndim >= 2 else 4) * p.numel() for p in module.parameters()))


def piece_costs(model: nn.Module, spec: ModelSpec) -> PieceCosts:
    """FLOPs per token of the embedding, every block and the head of ``model`` (may be on meta)."""
    blocks = model.get_submodule(spec.layers)
    # A lookup: reading one row forward, adding one row backward; ~ dim FLOPs, not dim x vocab.
    embedding_cost = 2.0 * spec.dim if piece(model, spec.embedding) is not None else 0.0
    head_cost = _matmul_flops(piece(model, spec.head)) + _matmul_flops(piece(model, spec.final_norm))
    return PieceCosts(
        embedding=embedding_cost,
        blocks=tuple(_matmul_flops(blocks[str(i)]) for i in range(spec.n_layers)),
        head=head_cost,
    )


def _stage_cost(costs: PieceCosts, start: int, stop: int) -> float:
    cost = sum(costs.blocks[start:stop])
    if start == 0:
        cost += costs.embedding
    if stop == len(costs.blocks):
        cost += costs.head
    return cost


def balance_stages(costs: PieceCosts, n_stages: int) -> list[range]:
    """Contiguous block ranges, one per stage (each non-empty), minimising the costliest stage.

    Dynamic programming over (stages, blocks), O(n_stages x n_blocks^2).

    Example:
        >>> costs = PieceCosts(embedding=0.0, blocks=(1.0,) * 8, head=2.0)
        >>> [len(r) for r in balance_stages(costs, 2)]
        [5, 3]
    """
    n = len(costs.blocks)
    if not 1 <= n_stages <= n:
        raise ConfigError(f"{n_stages} pipeline stages need 1 to {n} blocks each; the model has {n} blocks")
    return list(_balance(costs, n_stages))


@functools.lru_cache(maxsize=256)
def _balance(costs: PieceCosts, n_stages: int) -> tuple[range, ...]:
    """:func:`balance_stages`, once per model and stage count (the planner asks for it thousands of times)."""
    n = len(costs.blocks)
    inf = (float("inf"), float("inf"))
    # best[s][j]: the best (costliest stage, sum of squared stage costs) putting blocks [0, j) on
    # s stages: the lowest maximum first (the pipeline's pace), then the most even spread.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                cost = _stage_cost(costs, i, j)
                value = (max(best[s - 1][i][0], cost), best[s - 1][i][1] + cost * cost)
                # Strict: among equals the earliest cut wins, so earlier stages (which hold the
                # most microbatches' activations under 1F1B) get the fewer blocks.
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds = [n]
    for s in range(n_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return tuple(range(a, b) for a, b in itertools.pairwise(bounds))


def stages_from_split_points(spec: ModelSpec, split_points: Sequence[str], n_stages: int) -> list[range]:
    """Block ranges from user split points: module names before which a new stage begins.

    Example:
        >>> from lightning_ultrascale.models import build_model
        >>> spec = build_model("llama_tiny", device="meta").spec
        >>> stages_from_split_points(spec, ["layers.1"], 2)
        [range(0, 1), range(1, 4)]
    """
    valid = spec.pipeline_split_points()
    if len(split_points) != n_stages - 1:
        raise ConfigError(
            f"{option(_OWNER, 'split_points', list(split_points))} has {len(split_points)} names but {n_stages} "
            f"stages need {n_stages - 1} "
            f"(pp x virtual stages - 1); valid names: {', '.join(valid)}"
        )
    unknown = [p for p in split_points if p not in valid]
    if unknown:
        raise ConfigError(
            f"{option(_OWNER, 'split_points', list(split_points))}: {', '.join(unknown)} are not split points; "
            f"valid: {', '.join(valid)}"
        )
    starts = [valid.index(p) + 1 for p in split_points]
    if starts != sorted(set(starts)):
        raise ConfigError(f"{option(_OWNER, 'split_points', list(split_points))} must be distinct and in model order")
    bounds = [0, *starts, spec.n_layers]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def plan_stages(
    model: nn.Module, spec: ModelSpec, n_stages: int, split_points: Sequence[str] | None = None
) -> list[range]:
    """The block range of every stage: from ``split_points`` if given, else cost-balanced."""
    if split_points is not None:
        return stages_from_split_points(spec, split_points, n_stages)
    return balance_stages(piece_costs(model, spec), n_stages)
