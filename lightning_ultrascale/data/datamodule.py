"""The LightningDataModule: a token source cut into sequences, sharded by data-parallel rank."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.strategies import ParallelStrategy
from torch.utils.data import Dataset, Subset

from lightning_ultrascale.data.corpus import load_default_corpus_tokens
from lightning_ultrascale.data.datasets import MemmapTokenDataset, PackedDataset, max_token_id
from lightning_ultrascale.data.index import TOKEN_DTYPES, TokenIndex
from lightning_ultrascale.data.sampler import DataParallelSampler, ResumableDataLoader
from lightning_ultrascale.data.tokenizer import ByteTokenizer
from lightning_ultrascale.errors import ConfigError

DEFAULT_SOURCE = "pydoc"


class UltraScaleDataModule(L.LightningDataModule):
    """Packed next-token batches ``{"input_ids", "labels"}`` (LongTensor ``[micro_batch_size, seq_len]``).

    ``source`` is ``"pydoc"`` (the bundled corpus, :func:`load_default_corpus_tokens`) or a flat
    token ``.bin`` file (:class:`MemmapTokenDataset`, written by ``ultrascale-tokenize``). The last
    ``val_fraction`` of the sequences is held out for validation, in order; training shuffles per
    epoch. Both are sharded with :class:`DataParallelSampler` over the data-parallel coordinates
    that the strategy reports in ``distributed_sampler_kwargs`` (``UltraScaleStrategy`` reports its
    dp mesh dim; Lightning's DDP the world); without a parallel strategy there is one dp rank.

    Mid-epoch resume needs no state here: the train loader is a :class:`ResumableDataLoader`,
    which Lightning's fit loop checkpoints and restores itself (see that class for the mechanism),
    so ``trainer.fit(model, dm, ckpt_path=...)`` continues with the next unseen global batch.

    Example:
        >>> dm = UltraScaleDataModule(seq_len=128, micro_batch_size=4)
        >>> dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> batch["input_ids"].shape, batch["labels"].dtype
        (torch.Size([4, 128]), torch.int64)

    Raises:
        ConfigError: at construction for a bad ``seq_len``, ``micro_batch_size``, ``dtype``,
            ``val_fraction``, ``num_workers`` or a missing/ill-sized token file; in ``setup`` when the
            data cannot fill one global batch for training (or for validation) at this dp size.
    """

    def __init__(
        self,
        source: str = DEFAULT_SOURCE,
        *,
        seq_len: int,
        micro_batch_size: int,
        dtype: str | None = None,
        tokenizer: str | None = None,
        val_fraction: float = 0.05,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size)):
            if value <= 0:
                raise ConfigError(f"data.{name}={value} must be > 0")
        if dtype is not None and dtype not in TOKEN_DTYPES:
            raise ConfigError(f"data.dtype={dtype} is not supported; valid: {', '.join(TOKEN_DTYPES)}")
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={val_fraction} must be in [0, 1); 0 disables validation")
        if num_workers < 0:
            raise ConfigError(f"data.num_workers={num_workers} must be >= 0")
        self.source = source
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.dp_size, self.dp_rank = 1, 0
        self.train_dataset: Dataset[Any] | None = None
        self.val_dataset: Dataset[Any] | None = None
        #: The token file's index (None for the bundled corpus and for a .bin without one).
        self.index: TokenIndex | None = None
        if source != DEFAULT_SOURCE:
            # Open once now so a wrong path or dtype fails before any process group or model exists.
            self.dtype = MemmapTokenDataset(source, seq_len, dtype).dtype
            self.index = TokenIndex.read(source)
            self._check_tokenizer()

    def _check_tokenizer(self) -> None:
        if self.tokenizer is None:
            return
        made_with = self.index.tokenizer if self.index is not None else None
        if made_with != self.tokenizer:
            raise ConfigError(
                f"data.tokenizer={self.tokenizer!r}, but data.source={self.source} was tokenized with "
                f"{made_with!r} (its index{' is missing' if made_with is None else ''}); tokenize the corpus "
                "with that tokenizer (ultrascale-tokenize --tokenizer ... --tokenizer-name ...) or drop data.tokenizer"
            )

    @property
    def max_token_id(self) -> int:
        """The largest token id in the data (for a check against the model's vocabulary)."""
        if self.source == DEFAULT_SOURCE:
            return ByteTokenizer.vocab_size - 1
        return max_token_id(self.source, self.dtype)

    @property
    def vocab_size(self) -> int:
        """The vocabulary the data was tokenized with (its index says; bytes for pydoc), else its largest id + 1."""
        if self.source == DEFAULT_SOURCE:
            return ByteTokenizer.vocab_size
        return self.index.vocab_size if self.index is not None else self.max_token_id + 1

    def _dp_coordinates(self) -> tuple[int, int]:
        strategy = getattr(self.trainer, "strategy", None)
        if isinstance(strategy, ParallelStrategy):
            kwargs = strategy.distributed_sampler_kwargs
            return int(kwargs["num_replicas"]), int(kwargs["rank"])
        return 1, 0

    def _dataset(self) -> PackedDataset:
        if self.source == DEFAULT_SOURCE:
            return PackedDataset(load_default_corpus_tokens(), self.seq_len)
        return MemmapTokenDataset(self.source, self.seq_len, self.dtype)

    def check_fits(self, dp_size: int, dataset: PackedDataset | None = None) -> tuple[int, int]:
        """``(train, validation)`` sequences; raises if either cannot fill one global micro-step of ``dp_size`` ranks.

        ``UltraScaleStrategy`` calls it before any process group exists (through
        :meth:`~lightning_ultrascale.parallel.dims.DataShape.declared_by`), ``setup`` again.
        """
        dataset = dataset or self._dataset()
        n_val = int(len(dataset) * self.val_fraction)
        n_train = len(dataset) - n_val
        global_batch = self.micro_batch_size * dp_size
        sizes = (
            f"data.seq_len={self.seq_len} x data.micro_batch_size={self.micro_batch_size} "
            f"x dp={dp_size} needs {global_batch} sequences of {self.seq_len + 1} tokens a global batch"
        )
        if n_train < global_batch:
            raise ConfigError(
                f"data.source={self.source} has {len(dataset.tokens)} tokens, {n_train} training sequences: "
                f"{sizes}; lower data.seq_len or data.micro_batch_size, or use more data"
            )
        if self.val_fraction > 0 and n_val < global_batch:
            raise ConfigError(
                f"data.val_fraction={self.val_fraction} holds out {n_val} sequences, fewer than one global "
                f"batch: {sizes}; raise data.val_fraction, or set it to 0 to skip validation"
            )
        return n_train, n_val

    def setup(self, stage: str) -> None:
        """Read the dp coordinates, open the source, split train/val and check both fill a global batch."""
        self.dp_size, self.dp_rank = self._dp_coordinates()
        dataset = self._dataset()
        n_train, _ = self.check_fits(self.dp_size, dataset)
        self.train_dataset = Subset(dataset, range(n_train))
        self.val_dataset = Subset(dataset, range(n_train, len(dataset)))

    def _loader(self, dataset: Dataset[Any] | None, shuffle: bool) -> ResumableDataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        sampler = DataParallelSampler(
            dataset,  # type: ignore[arg-type]
            self.micro_batch_size,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            shuffle=shuffle,
            seed=self.seed,
        )
        return ResumableDataLoader(dataset, sampler, num_workers=self.num_workers)

    def train_dataloader(self) -> ResumableDataLoader:
        """This dp rank's micro batches of the shuffled training sequences."""
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> ResumableDataLoader | list[Any]:
        """This dp rank's micro batches of the held-out sequences, in order (none if ``val_fraction=0``)."""
        if self.val_fraction == 0:
            return []
        return self._loader(self.val_dataset, shuffle=False)
