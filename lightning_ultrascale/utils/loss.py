"""Token weighting: every labelled token of a global batch counts once, however the batch is split.

A rank's loss is the mean over its own labelled tokens (labels != -100), and gradients are
averaged over the ``dp x cp`` ranks. The average of per-rank means is the mean over all tokens
only if every rank holds as many labelled tokens: true for packed data, false with padding or
ignored labels, or when context parallelism gives one rank the ignored tail of a sequence.
Weighting each rank's loss by ``n_rank x ranks / n_total`` makes the average exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


def token_weight(labels: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``n_local x |group| / n_total`` labelled tokens, for the ranks of ``group`` (a collective).

    Exactly 1.0 when every rank holds as many labelled tokens.
    """
    count = (labels != IGNORE_INDEX).sum().to(torch.float32)
    total = count.clone()
    dist.all_reduce(total, group=group)
    return count * dist.get_world_size(group) / total.clamp(min=1)
