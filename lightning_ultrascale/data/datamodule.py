"""The LightningDataModule: token sources (one, or a weighted blend) cut into sequences, sharded by dp rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.strategies import ParallelStrategy
from torch.utils.data import ConcatDataset, Dataset, Subset

from lightning_ultrascale.data.blend import BlendedDataset
from lightning_ultrascale.data.corpus import load_default_corpus_documents
from lightning_ultrascale.data.datasets import MemmapTokenDataset, PackedDataset, check_documents, max_token_id
from lightning_ultrascale.data.index import TOKEN_DTYPES, TokenIndex, tokenizer_dir
from lightning_ultrascale.data.sampler import DataParallelSampler, ResumableDataLoader
from lightning_ultrascale.data.tokenizer import ByteTokenizer, tokenizer_hash
from lightning_ultrascale.errors import ConfigError

DEFAULT_SOURCE = "pydoc"


@dataclass(frozen=True)
class Source:
    """One token file of the data: its path, its weight in a blend, its name in metrics."""

    path: str
    weight: float = 1.0
    name: str = ""


class UltraScaleDataModule(L.LightningDataModule):
    """Packed next-token batches ``{"input_ids", "labels"}`` (LongTensor ``[micro_batch_size, seq_len]``).

    ``source`` is ``"pydoc"`` (the bundled corpus, :func:`load_default_corpus_documents`) or a flat
    token ``.bin`` file (:class:`MemmapTokenDataset`, written by ``ultrascale-tokenize``, whose index
    gives its dtype). ``sources`` blends several token files by weight instead
    (``[{"path": "a.bin", "weight": 0.7}, {"path": "b.bin", "weight": 0.3}]``, see
    :mod:`~lightning_ultrascale.data.blend`). The last ``val_fraction`` of each file's sequences is
    held out for validation, in order; training shuffles a single source per epoch, and reads a
    blend in its blend order (each source shuffled per pass). Both are sharded with
    :class:`DataParallelSampler` over the data-parallel coordinates that the strategy reports in
    ``distributed_sampler_kwargs`` (``UltraScaleStrategy`` reports its dp mesh dim; Lightning's DDP
    the world); without a parallel strategy there is one dp rank.

    ``tokenizer``: the name the data's index must record (a recipe names its model's tokenizer).

    Args:
        documents: ``"concat"`` (default): documents meet at their bos/eos inside a window and
            attention is plain causal, the fastest fused kernel on every device (GPT and Llama 2
            pretrain so). ``"mask"``: batches also carry ``position_ids`` and ``document_ids``
            (``[micro_batch_size, seq_len]``): attention never crosses a document and positions
            restart at each one, as the Llama 3 paper trains; it matters most for many short
            documents and long context. A token file needs its ``docs.npy`` (``ultrascale-tokenize``
            writes it).
        mask_eos_loss: ignore the label of each document's last token, which predicts the next
            document's first (eos -> bos); with either ``documents``, and needs the ``docs.npy`` too.

    Mid-epoch resume needs no state here: the train loader is a :class:`ResumableDataLoader`,
    which Lightning's fit loop checkpoints and restores itself (see that class for the mechanism),
    so ``trainer.fit(model, dm, ckpt_path=...)`` continues with the next unseen global batch.

    Example:
        >>> dm = UltraScaleDataModule(seq_len=128, micro_batch_size=4)
        >>> dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> batch["input_ids"].shape, batch["labels"].dtype
        (torch.Size([4, 128]), torch.int64)
        >>> dm = UltraScaleDataModule(seq_len=128, micro_batch_size=4, documents="mask")
        >>> dm.setup("fit")
        >>> sorted(next(iter(dm.train_dataloader())))
        ['document_ids', 'input_ids', 'labels', 'position_ids']

    Raises:
        ConfigError: at construction for a bad ``seq_len``, ``micro_batch_size``, ``dtype``,
            ``val_fraction``, ``num_workers``, ``documents``, a bad source or blend, a missing/ill-sized
            token file, or missing/damaged document starts that ``documents``/``mask_eos_loss`` need;
            in ``setup`` when the data cannot fill one global batch for training (or for validation)
            at this dp size.
    """

    def __init__(
        self,
        source: str | None = DEFAULT_SOURCE,
        *,
        seq_len: int,
        micro_batch_size: int,
        sources: Sequence[Mapping[str, Any] | str] | None = None,
        dtype: str | None = None,
        tokenizer: str | None = None,
        val_fraction: float = 0.05,
        seed: int = 0,
        num_workers: int = 0,
        documents: str = "concat",
        mask_eos_loss: bool = False,
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
        check_documents(documents)
        self.sources = _sources(source, sources)
        self.source = ", ".join(s.path for s in self.sources)
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.tokenizer = tokenizer
        self.val_fraction = val_fraction
        self.seed, self.num_workers = seed, num_workers
        self.documents, self.mask_eos_loss = documents, mask_eos_loss
        self.dp_size, self.dp_rank = 1, 0
        self.train_dataset: Dataset[Any] | None = None
        self.val_dataset: Dataset[Any] | None = None
        self._train_loader: ResumableDataLoader | None = None
        #: Each token file's dtype and index (None for the bundled corpus and for a .bin without one).
        self.dtypes: list[str] = []
        self.indexes: list[TokenIndex | None] = []
        if source == DEFAULT_SOURCE and sources is None:
            self.dtype = dtype
            return
        for s in self.sources:
            # Open now so a wrong path or dtype fails before any process group or model exists.
            self.dtypes.append(MemmapTokenDataset(s.path, seq_len, dtype, documents, mask_eos_loss).dtype)
            self.indexes.append(TokenIndex.read(s.path))
        self.dtype = self.dtypes[0]
        self._check_tokenizers()

    @property
    def index(self) -> TokenIndex | None:
        """The (first) token file's index."""
        return self.indexes[0] if self.indexes else None

    @property
    def blended(self) -> bool:
        return len(self.sources) > 1

    def _check_tokenizers(self) -> None:
        made_with = [(i.tokenizer, i.tokenizer_hash) if i is not None else None for i in self.indexes]
        if self.blended and len(set(made_with)) > 1:
            listed = "; ".join(f"{s.path}: {m[0] if m else 'no index'}" for s, m in zip(self.sources, made_with))
            raise ConfigError(
                f"data.sources were tokenized with different tokenizers ({listed}): their ids mean different "
                "text; tokenize every source with one tokenizer"
            )
        if self.tokenizer is not None and (made_with[0] is None or made_with[0][0] != self.tokenizer):
            found = repr(made_with[0][0]) if made_with[0] is not None else "an unknown one (it has no index)"
            raise ConfigError(
                f"data.tokenizer={self.tokenizer!r}, but data.source={self.source} was tokenized with {found}; "
                "tokenize the corpus with that tokenizer (ultrascale-tokenize --tokenizer ... --tokenizer-name ...) "
                "or drop data.tokenizer"
            )

    @property
    def max_token_id(self) -> int:
        """The largest token id in the data (for a check against the model's vocabulary)."""
        if not self.dtypes:
            return ByteTokenizer.vocab_size - 1
        return max(max_token_id(s.path, dtype) for s, dtype in zip(self.sources, self.dtypes))

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary the data was tokenized with (its index says; bytes for pydoc); None without an index.

        A ``.bin`` without an index does not say: its largest id is checked instead (:attr:`max_token_id`).
        """
        if not self.dtypes:
            return ByteTokenizer.vocab_size
        return self.index.vocab_size if self.index is not None else None

    def _dp_coordinates(self) -> tuple[int, int]:
        strategy = getattr(self.trainer, "strategy", None)
        if isinstance(strategy, ParallelStrategy):
            kwargs = strategy.distributed_sampler_kwargs
            return int(kwargs["num_replicas"]), int(kwargs["rank"])
        return 1, 0

    def _datasets(self) -> list[PackedDataset]:
        options = {"documents": self.documents, "mask_eos_loss": self.mask_eos_loss}
        if not self.dtypes:
            tokens, starts = load_default_corpus_documents()
            return [PackedDataset(tokens, self.seq_len, starts, **options)]
        return [MemmapTokenDataset(s.path, self.seq_len, d, **options) for s, d in zip(self.sources, self.dtypes)]

    def check_fits(self, dp_size: int, datasets: list[PackedDataset] | None = None) -> tuple[int, int]:
        """``(train, validation)`` sequences; raises if either cannot fill one global micro-step of ``dp_size`` ranks.

        ``UltraScaleStrategy`` calls it before any process group exists (through
        :meth:`~lightning_ultrascale.parallel.dims.DataShape.declared_by`), ``setup`` again.
        """
        datasets = datasets or self._datasets()
        n_val = sum(int(len(d) * self.val_fraction) for d in datasets)
        n_train = sum(len(d) for d in datasets) - n_val
        global_batch = self.micro_batch_size * dp_size
        sizes = (
            f"data.seq_len={self.seq_len} x data.micro_batch_size={self.micro_batch_size} "
            f"x dp={dp_size} needs {global_batch} sequences of {self.seq_len + 1} tokens a global batch"
        )
        if n_train < global_batch:
            tokens = sum(len(d.tokens) for d in datasets)
            raise ConfigError(
                f"data.source={self.source} has {tokens} tokens, {n_train} training sequences: "
                f"{sizes}; lower data.seq_len or data.micro_batch_size, or use more data"
            )
        if self.val_fraction > 0 and n_val < global_batch and self._validates():
            raise ConfigError(
                f"data.val_fraction={self.val_fraction} holds out {n_val} sequences, fewer than one global "
                f"batch: {sizes}; raise data.val_fraction, or set it to 0 to skip validation"
            )
        return n_train, n_val

    def _validates(self) -> bool:
        """Whether the run validates: not with the Trainer's ``limit_val_batches=0`` (nor without a Trainer's say)."""
        trainer = self.trainer
        return trainer is None or trainer.limit_val_batches != 0

    def setup(self, stage: str) -> None:
        """Read the dp coordinates, open the sources, split each into train/val and check both fill a global batch."""
        self.dp_size, self.dp_rank = self._dp_coordinates()
        datasets = self._datasets()
        self.check_fits(self.dp_size, datasets)
        train, val = [], []
        for d in datasets:
            n_train = len(d) - int(len(d) * self.val_fraction)
            train.append(Subset(d, range(n_train)))
            val.append(Subset(d, range(n_train, len(d))))
        if self.blended:
            self.train_dataset = BlendedDataset(train, [s.weight for s in self.sources], seed=self.seed)
        else:
            self.train_dataset = train[0]
        self.val_dataset = ConcatDataset(val) if self.blended else val[0]

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
        """This dp rank's micro batches of the training sequences: shuffled, or in a blend's order."""
        self._train_loader = self._loader(self.train_dataset, shuffle=not self.blended)
        return self._train_loader

    def val_dataloader(self) -> ResumableDataLoader | list[Any]:
        """This dp rank's micro batches of the held-out sequences, in order (none if ``val_fraction=0``)."""
        if self.val_fraction == 0:
            return []
        return self._loader(self.val_dataset, shuffle=False)

    def tokenizer_record(self) -> dict[str, Any] | None:
        """What the data was tokenized with (name, hash, vocabulary, bos/eos, where its files are); None if unknown.

        Saved in every checkpoint (:meth:`state_dict`): ``ultrascale-export`` writes that tokenizer
        beside the model, and a resumed run refuses data tokenized with another one.
        """
        if not self.dtypes:
            tok = ByteTokenizer()
            return {"name": tok.name, "hash": tokenizer_hash(()), "vocab_size": tok.vocab_size, "files": None}
        index = self.index
        if index is None:
            return None
        files = tokenizer_dir(self.sources[0].path)
        return {
            "name": index.tokenizer,
            "hash": index.tokenizer_hash,
            "vocab_size": index.vocab_size,
            "files": str(files.resolve()) if files.is_dir() else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """``{"tokenizer": tokenizer_record()}``: the data position itself is the train loader's state."""
        return {"tokenizer": self.tokenizer_record()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse to resume on data tokenized with another tokenizer than the checkpoint's (its ids mean other text)."""
        saved, now = state_dict.get("tokenizer"), self.tokenizer_record()
        if saved is not None and now is not None and saved["hash"] != now["hash"]:
            raise ConfigError(
                f"the checkpoint was trained on data tokenized with {saved['name']!r} (tokenizer hash "
                f"{saved['hash'][:12]}), but data.source={self.source} was tokenized with {now['name']!r} "
                f"({now['hash'][:12]}): the same ids would mean other text. Tokenize the corpus with the "
                "checkpoint's tokenizer, or start a new run from its weights (model.init_from)"
            )

    def tokens_by_source(self) -> dict[str, tuple[int, int]]:
        """For a blend: each source's training tokens read so far (all ranks) and its pass (1 until it wraps)."""
        if not self.blended or self._train_loader is None or not isinstance(self.train_dataset, BlendedDataset):
            return {}
        position = self._train_loader.state_dict()
        drawn = self.train_dataset.drawn(position["epoch"], position["consumed_samples"])
        passes = self.train_dataset.passes(position["epoch"], position["consumed_samples"])
        return {s.name: (int(n) * self.seq_len, int(p)) for s, n, p in zip(self.sources, drawn, passes)}


def _sources(source: str | None, sources: Sequence[Mapping[str, Any] | str] | None) -> list[Source]:
    """``data.source`` as one source, or ``data.sources`` checked: paths, positive weights, unique names."""
    if sources is None:
        if source is None:
            raise ConfigError("data.source=null and no data.sources: give a token file or a blend")
        return [Source(source, 1.0, Path(source).stem)]
    if source not in (None, DEFAULT_SOURCE):
        raise ConfigError(f"data.source={source} and data.sources are both set; use one (sources for a blend)")
    if not sources:
        raise ConfigError("data.sources is empty; give at least one {path: ..., weight: ...}")
    out = []
    for i, entry in enumerate(sources):
        if isinstance(entry, str):  # a bare path: weight 1
            entry = {"path": entry}
        if not isinstance(entry, Mapping):
            raise ConfigError(f"data.sources[{i}]={entry!r} must be a path or {{path: ..., weight: ..., name: ...}}")
        unknown = sorted(set(entry) - {"path", "weight", "name"})
        if "path" not in entry or unknown:
            raise ConfigError(
                f"data.sources[{i}]={dict(entry)} needs a path and may have a weight and a name"
                + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            )
        weight = float(entry.get("weight", 1.0))
        if not weight > 0:
            raise ConfigError(f"data.sources[{i}].weight={weight} must be > 0")
        out.append(Source(str(entry["path"]), weight, str(entry.get("name") or Path(str(entry["path"])).stem)))
    names = [s.name for s in out]
    if len(set(names)) < len(names):
        raise ConfigError(f"data.sources have the same name twice ({', '.join(names)}); give each a name")
    return out
