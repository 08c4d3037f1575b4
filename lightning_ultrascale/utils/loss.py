"""Token weighting: every labelled token of a step's global batch counts once, however the batch is split.

A micro-batch's loss is the mean over its labelled tokens (labels != -100); gradients are averaged
over the ``dp x cp`` ranks and, by Lightning, over the accumulation micro-steps. That average of
means is the mean over all tokens only when every rank and micro-step holds as many labelled
tokens: true for packed data, false with padding, ignored labels (``data.mask_eos_loss``), or when
context parallelism gives one rank the ignored tail of a sequence.

:class:`TokenNormaliser` makes it exact without looking ahead: each micro-step's loss is weighted
by its labelled fraction ``n / L`` (``L`` its label slots), which turns the averaged gradient into
``sum of token gradients / (ranks x micro-steps x L)``; after the step's last backward the
gradients are multiplied by ``ranks x micro-steps x L / N`` with ``N`` the step's labelled tokens
over every rank and micro-step (two numbers per rank, summed over the ``dp x cp`` ranks once per
optimizer step: in the step's one agreement, ``core/agreement.py``, under the Trainer, whose host
read brings the totals). Both factors are exactly 1 when every token is labelled, so packed runs are
bit for bit what they were, and under the Trainer the gradients are then not touched at all.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from lightning_ultrascale.utils.tensors import by_device_and_dtype

IGNORE_INDEX = -100


class TokenNormaliser:
    """The step's gradient as the mean over every labelled token of its global batch (see the module docstring).

    Example:
        >>> norm = TokenNormaliser()
        >>> float(norm.weight(torch.tensor([[1, -100, 2, 3]])))  # 3 of 4 slots labelled
        0.75
        >>> grad = torch.ones(2)
        >>> norm.finish([grad], group=None, accumulate=1)  # one rank, one micro-step: x 4 / 3
        >>> grad.tolist()
        [1.3333333730697632, 1.3333333730697632]
    """

    def __init__(self) -> None:
        self._labelled: torch.Tensor | None = None
        self._slots = 0

    def weight(self, labels: torch.Tensor) -> torch.Tensor:
        """This micro-step's factor on its mean loss: its labelled tokens over the step's label slots."""
        n = (labels != IGNORE_INDEX).sum().to(torch.float64)
        if self._labelled is None:
            self._labelled, self._slots = n, labels.numel()
        else:
            self._labelled = self._labelled + n
        return (n / self._slots).to(torch.float32)

    def take_counts(self) -> torch.Tensor | None:
        """This rank's labelled tokens and label slots of the step (float64, on the count's device), then
        reset; None where no micro-step was weighted."""
        if self._labelled is None:
            return None
        # (built on the count's device: a CPU scalar beside a CUDA one fails in stack)
        slots = torch.tensor(float(self._slots), dtype=torch.float64, device=self._labelled.device)
        counts = torch.stack((self._labelled, slots))
        self._labelled, self._slots = None, 0
        return counts

    @staticmethod
    def scale(grads: Iterable[torch.Tensor], totals: torch.Tensor | tuple[float, float], accumulate: int) -> None:
        """Scale ``grads`` (local shards fine) by ``accumulate x slots / labelled`` of the step's ``totals``
        (``[labelled, slots]`` on the device, or read on the host: then a factor of exactly 1, every slot
        labelled, touches no gradient)."""
        if isinstance(totals, tuple):
            factor: torch.Tensor | float = accumulate * totals[1] / max(totals[0], 1.0)
            if factor == 1.0:
                return
        else:
            factor = accumulate * totals[1] / totals[0].clamp(min=1)
        with torch.no_grad():  # (to_local without grad mode is the local tensor itself: no autograd node)
            locals_ = [grad.to_local() if hasattr(grad, "to_local") else grad for grad in grads]
            # One multi-tensor kernel per device and dtype instead of a dispatched op per gradient.
            for (device, dtype), tensors in by_device_and_dtype(locals_).items():
                scalar = factor.to(device=device, dtype=dtype) if isinstance(factor, torch.Tensor) else factor
                torch._foreach_mul_(tensors, scalar)

    def finish(self, grads: Iterable[torch.Tensor], group: dist.ProcessGroup | None, accumulate: int) -> None:
        """After the step's last backward: scale ``grads`` (local shards fine) so they average every labelled token.

        Its own all-reduce of the counts over ``group``; the Trainer's strategy carries them in the
        step's one agreement instead (``core/agreement.py``).
        """
        counts = self.take_counts()
        if counts is None:
            return
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        self.scale(grads, counts, accumulate)
