"""A user's own LightningDataModules, built by the CLI from ``data._target_=user_datamodule.<class>``.

Tests put this folder on the path of the processes they start.
"""

import lightning as L
import torch
from torch.utils.data import DataLoader


def _counting(seq_len: int, vocab_size: int, sequences: int, seed: int) -> list[dict[str, torch.Tensor]]:
    # Each sequence counts up from a random start (mod vocab_size): learnable within a few steps.
    starts = torch.randint(vocab_size, (sequences, 1), generator=torch.Generator().manual_seed(seed))
    tokens = (starts + torch.arange(seq_len + 1)) % vocab_size
    return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]


class CountingTokens(L.LightningDataModule):
    """Declares ``seq_len``, ``micro_batch_size`` and ``max_token_id``: the CLI checks them against the layout."""

    def __init__(self, seq_len: int, micro_batch_size: int, vocab_size: int = 256, seed: int = 0) -> None:
        super().__init__()
        self.seq_len, self.micro_batch_size, self.max_token_id = seq_len, micro_batch_size, vocab_size - 1
        self.sequences = _counting(seq_len, vocab_size, 64, seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.sequences, batch_size=self.micro_batch_size)  # type: ignore[arg-type]


class UnshapedTokens(L.LightningDataModule):
    """The same batches, declaring nothing of their shape (no attributes a check could read)."""

    def __init__(self, seq_len: int, micro_batch_size: int) -> None:
        super().__init__()
        self.loader = DataLoader(_counting(seq_len, 256, 64, seed=0), batch_size=micro_batch_size)  # type: ignore[arg-type]

    def train_dataloader(self) -> DataLoader:
        return self.loader
