"""What the ranks must agree on after a step, in one all-reduce and one host read.

After the step's last backward, and before the optimizer step, every rank writes one row of a small
``world x (4 + k + m)`` float64 matrix on the collective device: its non-finite status (the guard's),
whether it was asked to stop (a preemption signal), its labelled tokens and label slots (token
weighting), the ``k`` sums the LightningModule reports over the global batch (its loss: the
:class:`~lightning_ultrascale.models.spec.StepSums` hook) and the ``m`` values it wants the maximum of
over the pipeline stages (each MoE block's selection-bias range:
:class:`~lightning_ultrascale.models.spec.StepMaxima`).
One all-reduce (a sum: every other rank's row is zero) hands every rank every row; one host read
of four numbers (the worst status, any stop, and the labelled tokens and label slots of its
``dp x cp`` group) tells the host what to do: nothing, skip or stop, and the token weighting's factor,
which is exactly 1 when every slot is labelled (packed data): then no gradient is touched. Everything
else stays on the device: each rank reduces the rows of the group it needs there (sums and maxima over
the ranks that see different tokens).

Before this, a healthy step carried four such collectives (the guard's, the preemption agreement's,
the token count's, the logged loss's; a fifth for the bias ranges of a pipelined MoE model) and
Lightning's own SIGTERM broadcast before every micro-batch, each read back on the host (a stream sync
on a GPU). :class:`~lightning_ultrascale.training.resilience.Preemption` turns Lightning's broadcast
off: its own agreement covers SIGTERM.

The rows are ``world`` long so that a bad step can name its rank (the guard's message); at 16,384
ranks that is 512 KiB, once per optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_ultrascale.utils.comm import collective_device, sum_rows

#: The columns of a rank's row (the module's sums from ``SUMS`` on).
STATUS, STOP, LABELLED, SLOTS, SUMS = range(5)


class StepAgreement:
    """The one control collective of a step (see the module docstring).

    ``stop_requested``: asked at each exchange whether this rank wants the run to stop (set by
    :class:`~lightning_ultrascale.training.resilience.Preemption` while it watches the signals).

    Example:
        >>> agreement = StepAgreement()
        >>> rows, worst = agreement.exchange(torch.tensor(0.0), torch.tensor([3.0, 4.0], dtype=torch.float64))
        >>> rows.tolist(), worst, agreement.stop
        ([[0.0, 0.0, 3.0, 4.0]], 0, False)
        >>> rows, _ = agreement.exchange(torch.tensor(0.0), None, sums=torch.tensor([5.0]), maxima=torch.tensor([0.5]))
        >>> rows.tolist()  # (status, stop, no counts, a sum, a maximum)
        [[0.0, 0.0, 0.0, 0.0, 5.0, 0.5]]
    """

    def __init__(self) -> None:
        self.stop_requested: Callable[[], bool] | None = None
        #: Whether any rank asked to stop, as agreed at the last exchange.
        self.stop = False
        #: ``(labelled tokens, label slots)`` over the count group at the last exchange (None: no counts).
        self.token_totals: tuple[float, float] | None = None

    def exchange(
        self,
        status: torch.Tensor,
        counts: torch.Tensor | None,
        sums: torch.Tensor | None = None,
        maxima: torch.Tensor | None = None,
        count_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, int]:
        """Every rank's row (``world x (4 + k + m)``, on the collective device) and the worst status, read once.

        ``status``: this rank's non-finite status (a device scalar); ``counts``: its labelled tokens
        and label slots of the step (float64), or None where it weighted no tokens; ``sums``: the
        module's ``k`` sums, ``maxima`` its ``m`` values to take the maximum of (each as long on
        every rank), or None: their columns follow one another from ``SUMS`` on. With ``counts``, the
        token totals over ``count_group`` (the ranks whose tokens one step's gradient averages) are
        read in the same host read: :attr:`token_totals`.
        """
        device = collective_device()
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        extra = [t.detach().flatten().to(device=device, dtype=torch.float64) for t in (sums, maxima) if t is not None]
        rows = torch.zeros(world, SUMS + sum(t.numel() for t in extra), dtype=torch.float64, device=device)
        rows[rank, STATUS] = status.to(device=device, dtype=torch.float64)
        rows[rank, STOP] = float(self.stop_requested is not None and self.stop_requested())
        if counts is not None:
            rows[rank, LABELLED:SUMS] = counts.to(device=device, dtype=torch.float64)
        if extra:
            rows[rank, SUMS:] = torch.cat(extra)
        if world > 1:
            dist.all_reduce(rows)  # the step's one control collective
        read = rows[:, STATUS : STOP + 1].amax(dim=0)
        if counts is not None:
            read = torch.cat((read, sum_rows(rows[:, LABELLED:SUMS], count_group)))
        values = read.tolist()  # and its one host read
        self.stop = values[STOP] > 0
        self.token_totals = (values[LABELLED], values[SLOTS]) if counts is not None else None  # (read's order)
        return rows, int(values[STATUS])
