"""Data: byte tokenizer, bundled corpus, packed and memory-mapped datasets, dp sampler, DataModule."""

from lightning_ultrascale.data.corpus import load_default_corpus_tokens
from lightning_ultrascale.data.datamodule import UltraScaleDataModule
from lightning_ultrascale.data.datasets import MemmapTokenDataset, PackedDataset
from lightning_ultrascale.data.sampler import DataParallelSampler, ResumableDataLoader
from lightning_ultrascale.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "DataParallelSampler",
    "MemmapTokenDataset",
    "PackedDataset",
    "ResumableDataLoader",
    "UltraScaleDataModule",
    "load_default_corpus_tokens",
]
