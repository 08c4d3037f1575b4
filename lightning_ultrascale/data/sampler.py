"""Which samples each data-parallel rank reads, in which order, and where a resumed run goes on.

Playbook order of a global batch: one optimizer step reads ``global_batch = micro_batch_size * dp``
samples that are CONSECUTIVE in the epoch's permutation, and dp rank ``r`` reads its contiguous
slice ``[r*B, (r+1)*B)`` of them::

    global batch k = perm[k*B*dp : (k+1)*B*dp]            rank r: perm[k*B*dp + r*B : k*B*dp + (r+1)*B]

So the content of a global batch depends on the global batch size only, not on how it is split:
dp=2 x micro batch 2 trains on exactly the batches of dp=1 x micro batch 4, which is what parity
tests against one process rely on. (torch's DistributedSampler strides instead, ``perm[r::dp]``,
which changes every batch when dp changes.) Ranks are data-parallel coordinates, not world ranks:
tensor, context and pipeline peers share a dp rank and so read identical samples.

A position in an epoch is counted in global samples ("consumed_samples"), which is the same
number whatever the layout, so a run can resume under another dp size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_ultrascale.errors import ConfigError


class DataParallelSampler(DistributedSampler):
    """Shards by data-parallel rank, keeps global batches layout-independent, resumes mid-epoch.

    A ``DistributedSampler`` subclass, so Lightning keeps it instead of injecting its own. The
    permutation of epoch ``e`` comes from ``torch.Generator().manual_seed(seed + e)``; the tail that
    does not fill a global batch is dropped. ``load_state_dict`` makes the NEXT iteration start at
    the saved position (later ones start at the beginning, as usual); ``set_epoch`` to another
    epoch cancels it.

    Example:
        >>> s = DataParallelSampler(range(8), micro_batch_size=2, num_replicas=2, rank=1, shuffle=False)
        >>> list(s)  # global batches [0, 1 | 2, 3] and [4, 5 | 6, 7]; dp rank 1 takes the second halves
        [2, 3, 6, 7]
        >>> s.load_state_dict({"epoch": 0, "consumed_samples": 4})
        >>> list(s)
        [6, 7]
    """

    def __init__(
        self,
        dataset: Sized,
        micro_batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        if micro_batch_size <= 0:
            raise ConfigError(f"data.micro_batch_size={micro_batch_size} must be > 0")
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = micro_batch_size * num_replicas
        self.dataset_size = len(dataset)
        self.steps_per_epoch = self.dataset_size // self.global_batch_size
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"global batch micro_batch_size={micro_batch_size} x dp={num_replicas} = "
                f"{self.global_batch_size} samples is larger than the dataset ({self.dataset_size} samples)"
            )
        # DistributedSampler's own sizes, kept consistent for code that reads them.
        self.num_samples = self.steps_per_epoch * micro_batch_size
        self.total_size = self.steps_per_epoch * self.global_batch_size
        self.iteration_start = 0  # position where the current (or last) iteration began
        self._resume_at = 0  # position where the next iteration begins
        self._consumed = 0  # position after the last complete micro batch handed out

    def __len__(self) -> int:
        # The full epoch even after a resume: Lightning counts an epoch's batches from this and
        # continues its own count from the restored batch index.
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Choose the permutation; a pending resume position belongs to its epoch only.

        A dataset that reads differently per epoch (a blend's sources go on where they stopped)
        is told too.
        """
        if epoch != self.epoch:
            self._resume_at = self._consumed = 0
        super().set_epoch(epoch)
        _tell_epoch(self.dataset, epoch)

    def __iter__(self) -> Iterator[int]:
        self.iteration_start, self._resume_at = self._resume_at, 0
        self._consumed = self.iteration_start
        return self._indices(self.iteration_start)

    def _indices(self, start: int) -> Iterator[int]:
        n = self.dataset_size
        if self.shuffle:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            perm = torch.arange(n)
        b, g = self.micro_batch_size, self.global_batch_size
        for step_start in range(start, n - g + 1, g):
            micro_batch = perm[step_start + self.rank * b : step_start + (self.rank + 1) * b].tolist()
            for i, index in enumerate(micro_batch):
                if i == b - 1:  # a micro batch counts as consumed once all of it was handed out
                    self._consumed = step_start + g
                yield index

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "consumed_samples"}``: global samples of the epoch handed out in whole micro batches.

        Example:
            >>> s = DataParallelSampler(range(8), micro_batch_size=2, num_replicas=2, rank=0)
            >>> it = iter(s); _ = [next(it) for _ in range(2)]
            >>> s.state_dict()  # one micro batch on each of 2 dp ranks
            {'epoch': 0, 'consumed_samples': 4}
        """
        return {"epoch": self.epoch, "consumed_samples": self._consumed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Make the next iteration continue at ``state_dict``'s position."""
        consumed = int(state_dict["consumed_samples"])
        if not 0 <= consumed <= self.dataset_size:
            raise ValueError(f"consumed_samples={consumed} is outside the dataset's [0, {self.dataset_size}]")
        if consumed % self.global_batch_size:
            # Starting mid-way through a micro-step would shift every later global batch.
            raise ConfigError(
                f"the checkpoint's data position, {consumed} samples into epoch {state_dict['epoch']}, is not a whole "
                f"number of this run's micro-steps of micro_batch_size={self.micro_batch_size} x dp="
                f"{self.num_replicas} = {self.global_batch_size} samples; resume with a micro-step that divides "
                f"{consumed} (the global batch the checkpoint trained with)"
            )
        self.epoch = int(state_dict["epoch"])
        self._resume_at = self._consumed = consumed
        _tell_epoch(self.dataset, self.epoch)


def _tell_epoch(dataset: Any, epoch: int) -> None:
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`DataParallelSampler` whose state is what it has HANDED OUT.

    This is the mid-epoch resume mechanism under Lightning 2.6: the fit loop treats a train
    dataloader that has ``state_dict``/``load_state_dict`` as stateful (``_Stateful`` protocol):
    its checkpoint stores ``loader.state_dict()`` under ``loops.fit_loop.state_dict.combined_loader``,
    and on restore calls ``load_state_dict`` on the new loader before its first ``iter()``.

    Counting at the loader, not at the sampler, is what makes the position exact: worker
    processes pull indices ``prefetch_factor * num_workers`` batches ahead of the model, whereas a
    batch this loader has yielded is one the trainer took. Lightning's own fetcher prefetches only
    from loaders without ``len``, so with this sized loader, yielded == trained when a checkpoint
    is written (from ``on_train_batch_end``, validation or epoch end alike).

    Example:
        >>> data = [torch.tensor([i]) for i in range(8)]
        >>> loader = ResumableDataLoader(data, DataParallelSampler(data, micro_batch_size=2, shuffle=False))
        >>> it = iter(loader); _ = next(it)
        >>> state = loader.state_dict(); state
        {'epoch': 0, 'consumed_samples': 2}
        >>> again = ResumableDataLoader(data, DataParallelSampler(data, micro_batch_size=2, shuffle=False))
        >>> again.load_state_dict(state)
        >>> [b.flatten().tolist() for b in again]
        [[2, 3], [4, 5], [6, 7]]
    """

    sampler: DataParallelSampler

    def __init__(
        self,
        dataset: Dataset[Any],
        sampler: DataParallelSampler,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(
            dataset,
            batch_size=sampler.micro_batch_size,
            sampler=sampler,
            num_workers=num_workers,
            pin_memory=pin_memory,
            drop_last=True,
        )
        self._position: dict[str, int] | None = None

    def __iter__(self) -> Iterator[Any]:
        self._position = None
        return self._count(super().__iter__())

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        for handed_out, batch in enumerate(batches, start=1):
            # The sampler has begun this iteration by the time its first batch exists, so
            # iteration_start is this iteration's, however far the workers have read ahead.
            consumed = self.sampler.iteration_start + handed_out * self.sampler.global_batch_size
            self._position = {"epoch": self.sampler.epoch, "consumed_samples": consumed}
            yield batch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "consumed_samples"}`` after the last batch yielded (the sampler's before any)."""
        return dict(self._position) if self._position is not None else self.sampler.state_dict()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Make the next iteration continue after the last batch the saved loader yielded."""
        self.sampler.load_state_dict(state_dict)
        self._position = None
