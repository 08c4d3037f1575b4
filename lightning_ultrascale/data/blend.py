"""Weighted blends of token files: which source each sequence of an epoch comes from, and which of its sequences.

``data.sources=[{path: a.bin, weight: 0.7}, {path: b.bin, weight: 0.3}]``. The blend index is
built greedily (Megatron's rule): position ``n`` goes to the source furthest behind its share,
``argmax_s (w_s (n + 1) - count_s(n))``, ties to the first. Every prefix of ``n`` sequences then
holds within one sequence of ``w_s n`` from each source, so each global batch (consecutive
positions: the sampler does not shuffle a blend) has the weights' proportions, whatever the
layout and however the batch is split over dp ranks and micro-steps.

An epoch of the blend has as many sequences as the sources hold together. Within it source
``s`` gives ``count_s`` sequences, read in an order permuted per pass over the source; a source
whose share is more than it holds **wraps**: it starts a new pass (a new epoch of that source,
with another permutation), which :meth:`BlendedDataset.passes` counts and the training metrics
log. The next epoch of the blend goes on where each source stopped, so a large source with a
small weight is read through over several epochs rather than repeated from its start.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_ultrascale.errors import ConfigError


def blend_index(weights: Sequence[float], length: int) -> np.ndarray:
    """The source of each of ``length`` positions (int32), every prefix within one sequence of its share.

    Example:
        >>> blend_index([0.7, 0.3], 10).tolist()
        [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    """
    total = float(sum(weights))
    shares = [w / total for w in weights]
    counts = [0] * len(shares)
    out = np.empty(length, dtype=np.int32)
    for n in range(length):
        # Pure Python: a few hundred ns a position for a few sources (1M sequences ~ 1 s).
        best, best_deficit = 0, -1.0
        for s, share in enumerate(shares):
            deficit = share * (n + 1) - counts[s]
            if deficit > best_deficit:
                best, best_deficit = s, deficit
        counts[best] += 1
        out[n] = best
    return out


class BlendedDataset(Dataset[dict[str, torch.Tensor]]):
    """The sequences of ``datasets`` interleaved by ``weights`` (see the module docstring).

    Item ``i`` of epoch ``e`` (set by the sampler's ``set_epoch``) is source ``index[i]``'s
    ``e * count_s + (its rank among that source's positions)``-th draw; draw ``k`` of a source of
    ``n`` sequences is sequence ``perm_{s, k // n}[k % n]``, the permutation of pass ``k // n``
    seeded by ``(seed, s, pass)``.

    Example:
        >>> from lightning_ultrascale.data.datasets import PackedDataset
        >>> a, b = PackedDataset(torch.arange(40), 3), PackedDataset(torch.arange(100, 140), 3)
        >>> blend = BlendedDataset([a, b], [0.5, 0.5], seed=0)
        >>> len(blend), [int(blend[i]["input_ids"][0]) // 100 for i in range(4)]
        (26, [0, 1, 0, 1])
    """

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], seed: int = 0) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("one weight per source, and at least one source")
        self.datasets = list(datasets)
        self.sizes = [len(d) for d in datasets]  # type: ignore[arg-type]
        if any(size == 0 for size in self.sizes):
            raise ConfigError("data.sources: a source holds no sequence of data.seq_len + 1 tokens")
        self.weights = [float(w) for w in weights]
        self.seed = seed
        self.epoch = 0
        self.index = blend_index(self.weights, sum(self.sizes))
        # The rank of each position among its source's positions, and each source's draws per epoch.
        self.rank = np.zeros(len(self.index), dtype=np.int64)
        self.per_epoch = np.bincount(self.index, minlength=len(datasets)).astype(np.int64)
        for s in range(len(datasets)):
            where = self.index == s
            self.rank[where] = np.arange(int(where.sum()))

    def __len__(self) -> int:
        return len(self.index)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = int(self.index[i])
        draw = self.epoch * int(self.per_epoch[s]) + int(self.rank[i])
        passes, j = divmod(draw, self.sizes[s])
        return self.datasets[s][int(self._permutation(s, passes)[j])]

    @functools.lru_cache(maxsize=8)  # noqa: B019 (one blend per run: the cache lives as long as it)
    def _permutation(self, s: int, passes: int) -> torch.Tensor:
        # SeedSequence mixes (seed, source, pass) the same way on every Python and platform.
        seed = int(np.random.SeedSequence([self.seed, s, passes]).generate_state(1, np.uint64)[0] >> 1)
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(self.sizes[s], generator=generator)

    def drawn(self, epoch: int, position: int) -> np.ndarray:
        """Sequences drawn from each source before ``position`` of ``epoch`` (all epochs counted)."""
        counts = np.bincount(self.index[:position], minlength=len(self.sizes)).astype(np.int64)
        return epoch * self.per_epoch + counts

    def passes(self, epoch: int, position: int) -> np.ndarray:
        """The pass over each source its last sequence drawn by then belongs to: 1 until it wraps, 2 after, ..."""
        drawn = self.drawn(epoch, position)
        return np.maximum(1, -(-drawn // np.asarray(self.sizes)))
