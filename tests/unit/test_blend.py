"""Weighted blends of token files: every prefix has the weights' proportions, sources wrap, reads are exact.

The resumed-run half (a blend read after a checkpoint equals the uninterrupted run's, batch for
batch) is in ``test_datamodule_resume.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from lightning_ultrascale import UltraScaleDataModule
from lightning_ultrascale.data.blend import BlendedDataset, blend_index
from lightning_ultrascale.data.datasets import PackedDataset
from lightning_ultrascale.data.prepare import tokenize_corpus
from lightning_ultrascale.data.sampler import DataParallelSampler
from lightning_ultrascale.data.tokenizer import ByteTokenizer
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.training.callbacks import TrainingMetrics


@pytest.mark.parametrize(
    "weights",
    [[0.7, 0.3], [1, 1], [5, 3, 2], [0.01, 0.99], [1 / 3, 1 / 3, 1 / 3], [0.45, 0.05, 0.2, 0.3]],
)
def test_every_prefix_of_1000_sequences_is_within_one_of_its_share(weights: list[float]) -> None:
    index = blend_index(weights, 1000)
    shares = np.asarray(weights) / sum(weights)
    counts = np.zeros(len(weights))
    worst = 0.0
    for n, s in enumerate(index, start=1):
        counts[s] += 1
        worst = max(worst, float(np.abs(counts - shares * n).max()))
    assert worst <= 1.0, f"a prefix strays {worst} sequences from its share"
    assert worst > 0  # the check can fail: shares are not whole numbers of sequences everywhere


def test_each_global_batch_of_the_blend_has_the_weights_proportions_on_every_dp_split() -> None:
    # The sampler hands consecutive positions to a global batch, so the prefix property carries
    # over: any window of B positions holds within two of w * B from each source.
    a = PackedDataset(torch.arange(10_000), 7)
    b = PackedDataset(torch.arange(10_000) + 20_000, 7)
    blend = BlendedDataset([a, b], [0.8, 0.2], seed=3)
    for dp, micro in [(1, 10), (2, 5), (5, 2)]:
        ranks = [list(DataParallelSampler(blend, micro, num_replicas=dp, rank=r, shuffle=False)) for r in range(dp)]
        batches = [[i for r in range(dp) for i in ranks[r][k * micro : (k + 1) * micro]] for k in range(20)]
        for batch in batches:
            from_b = sum(int(blend[i]["input_ids"][0]) >= 20_000 for i in batch)
            assert abs(from_b - 0.2 * 10) <= 2, (dp, micro, batch)
        assert batches == [list(range(10 * k, 10 * (k + 1))) for k in range(20)]  # the same on every split


def test_a_source_smaller_than_its_share_wraps_reading_each_sequence_once_a_pass() -> None:
    big = PackedDataset(torch.arange(90 * 4 + 1), 4)  # 90 sequences
    small = PackedDataset(torch.arange(10 * 4 + 1) + 1000, 4)  # 10 sequences at half the weight
    blend = BlendedDataset([big, small], [0.5, 0.5], seed=0)
    assert len(blend) == 100
    first = [int(blend[i]["input_ids"][0]) for i in range(100) if blend.index[i] == 1]
    assert len(first) == 50  # 5 passes over the small source in one blend epoch
    passes = [first[k * 10 : (k + 1) * 10] for k in range(5)]
    for p in passes:
        assert sorted(p) == [1000 + 4 * j for j in range(10)]  # each pass reads every sequence once
    assert len({tuple(p) for p in passes}) == 5  # in another order each pass
    assert blend.passes(0, 100).tolist() == [1, 5]  # half of the big source, five passes over the small one
    assert blend.passes(0, 0).tolist() == [1, 1]
    assert blend.passes(0, 22).tolist() == [1, 2]  # the small source's 11th draw opened its second pass
    # The next epoch goes on where each source stopped: the rest of the big one's first pass, then
    # its second, rather than its first pass again.
    epoch0_big = [int(blend[i]["input_ids"][0]) for i in range(100) if blend.index[i] == 0]
    blend.set_epoch(1)
    epoch1_big = [int(blend[i]["input_ids"][0]) for i in range(100) if blend.index[i] == 0]
    assert sorted(epoch0_big + epoch1_big[:40]) == [4 * j for j in range(90)]  # one pass, over two epochs
    assert len(set(epoch1_big[40:])) == 10  # the second pass begins
    assert blend.passes(1, 100).tolist() == [2, 10]


def test_a_blends_order_is_a_function_of_its_seed() -> None:
    def first_reads(seed: int) -> list[int]:
        a, b = PackedDataset(torch.arange(200), 3), PackedDataset(torch.arange(200) + 500, 3)
        blend = BlendedDataset([a, b], [0.6, 0.4], seed=seed)
        return [int(blend[i]["input_ids"][0]) for i in range(30)]

    assert first_reads(1) == first_reads(1)
    assert first_reads(1) != first_reads(2)


# ------------------------------------------------------------------------------------- the DataModule
def _token_file(path: Path, text: str, tokenizer: ByteTokenizer | None = None) -> str:
    source = path.with_suffix(".txt")
    source.write_text(text, encoding="utf-8")
    tokenize_corpus([source], path, tokenizer or ByteTokenizer(), progress=False)
    return str(path)


@pytest.fixture
def two_files(tmp_path: Path) -> tuple[str, str]:
    return (
        # Text that never repeats a sequence, capitals in the code file only; 16-token sequences:
        # web ~70 of them, code ~15.
        _token_file(tmp_path / "web.bin", "".join(f"web {i}, " for i in range(150))),
        _token_file(tmp_path / "code.bin", "".join(f"CODE {i}; " for i in range(30))),
    )


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([], r"data\.sources is empty"),
        ([{"weight": 1.0}], r"data\.sources\[0\]=\{'weight': 1\.0\} needs a path"),
        ([{"path": "{web}", "wieght": 2}], r"data\.sources\[0\]=.* unknown: wieght"),
        ([{"path": "{web}", "weight": 0}], r"data\.sources\[0\]\.weight=0\.0 must be > 0"),
        ([{"path": "{web}", "weight": -1}, "{code}"], r"data\.sources\[0\]\.weight=-1\.0 must be > 0"),
        (["{web}", "{web}"], r"data\.sources have the same name twice \(web, web\); give each a name"),
        (["{web}", 3], r"data\.sources\[1\]=3 must be a path or"),
        (["{web}", "{missing}"], r"data\.source=.*missing\.bin does not exist"),
    ],
)
def test_bad_blends_are_refused_naming_the_entry(two_files, tmp_path, sources, message) -> None:
    names = {"web": two_files[0], "code": two_files[1], "missing": str(tmp_path / "missing.bin")}

    def fill(entry):
        if isinstance(entry, str):
            return entry.format(**names)
        if isinstance(entry, dict):
            return {k: fill(v) for k, v in entry.items()}
        return entry

    with pytest.raises(ConfigError, match=message):
        UltraScaleDataModule(None, sources=[fill(s) for s in sources], seq_len=8, micro_batch_size=1)


def test_a_blend_and_a_single_source_together_are_refused(two_files) -> None:
    with pytest.raises(ConfigError, match=r"data\.source=.*web\.bin and data\.sources are both set"):
        UltraScaleDataModule(two_files[0], sources=[two_files[1]], seq_len=8, micro_batch_size=1)
    with pytest.raises(ConfigError, match=r"data\.source=null and no data\.sources"):
        UltraScaleDataModule(None, seq_len=8, micro_batch_size=1)


def test_sources_tokenized_with_different_tokenizers_are_refused(tmp_path, two_files) -> None:
    sentencepiece = pytest.importorskip("mistral_common")
    from lightning_ultrascale.data.tokenizer import load_tokenizer

    model = Path(sentencepiece.__file__).parent / "data" / "tokenizer.model.v1"
    other = _token_file(tmp_path / "mistral.bin", "some text " * 50, load_tokenizer(model))
    with pytest.raises(ConfigError, match=r"data\.sources were tokenized with different tokenizers \(.*web\.bin: byte"):
        UltraScaleDataModule(None, sources=[two_files[0], other], seq_len=8, micro_batch_size=1)


def test_a_blend_holds_out_validation_from_every_source(two_files) -> None:
    dm = UltraScaleDataModule(None, sources=list(two_files), seq_len=16, micro_batch_size=2, val_fraction=0.2)
    dm.setup("fit")
    val = torch.cat([b["input_ids"] for b in dm.val_dataloader()])
    from_code = ((val >= ord("A")) & (val <= ord("Z"))).any(dim=1)  # only the code file has capitals
    assert from_code.any() and not from_code.all()  # both sources are held out from
    train = {tuple(s["input_ids"].tolist()) for s in dm.train_dataset}  # type: ignore[union-attr]
    assert not train & {tuple(row.tolist()) for row in val}
    assert len(val) == sum(int(len(d) * 0.2) for d in dm._datasets()) // 2 * 2


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(258, 4)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.embed(batch["input_ids"]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_tokens_read_from_each_source_and_its_pass_are_logged(two_files, tmp_path) -> None:
    dm = UltraScaleDataModule(
        None,
        sources=[{"path": two_files[0], "weight": 1}, {"path": two_files[1], "weight": 3, "name": "code"}],
        seq_len=16,
        micro_batch_size=4,
        val_fraction=0.0,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=9,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TrainingMetrics(window=2)],
        default_root_dir=tmp_path,
    )
    trainer.fit(_Tiny(), dm)
    logged = trainer.callback_metrics
    # 9 steps of 4 sequences: the blend's first 36 positions, about a quarter from web.
    from_code = int(blend_index([1, 3], 36).sum())
    code_sequences = len(dm.train_dataset.datasets[1])  # type: ignore[union-attr]
    assert 26 <= from_code <= 28 and code_sequences < from_code  # code wraps within the 9 steps
    assert logged["data/web/tokens"].item() == (36 - from_code) * 16
    assert logged["data/code/tokens"].item() == from_code * 16
    assert logged["data/web/pass"].item() == 1
    assert logged["data/code/pass"].item() == 2
    assert dm.tokens_by_source() == {"web": ((36 - from_code) * 16, 1), "code": (from_code * 16, 2)}


def test_a_single_source_reports_no_per_source_counts(two_files) -> None:
    dm = UltraScaleDataModule(two_files[0], seq_len=16, micro_batch_size=2)
    dm.trainer = SimpleNamespace(strategy=None)  # type: ignore[assignment]
    dm.setup("fit")
    dm.train_dataloader()
    assert dm.tokens_by_source() == {}
