"""Data pipeline: tokenizer, corpus, packed datasets, the dp sampler and the DataModule's sharding."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_ultrascale.data import (
    ByteTokenizer,
    DataParallelSampler,
    MemmapTokenDataset,
    PackedDataset,
    ResumableDataLoader,
    UltraScaleDataModule,
    load_default_corpus_tokens,
)
from lightning_ultrascale.data.prepare import main as tokenize_main
from lightning_ultrascale.errors import ConfigError

# ----------------------------------------------------------------------------- tokenizer, corpus


def test_byte_tokenizer_round_trips_any_text() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return x ** 2  # ünïcødé, 日本語, 🦙"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 256 and ids[-1] == tok.eos_id == 257 and tok.vocab_size == 258
    assert max(ids[1:-1]) < 256
    assert tok.decode(ids) == text
    assert tok.encode("ab", bos=False, eos=False) == [97, 98]
    assert tok.decode([0xFF, 104, 105]) == "\ufffdhi"  # invalid UTF-8 from a model must not raise


def test_default_corpus_is_deterministic_pydoc_documents() -> None:
    from pydoc_data.topics import topics

    tokens = load_default_corpus_tokens()
    assert tokens.ndim == 1 and tokens.dtype in (torch.int32, torch.int64)
    assert torch.equal(tokens, load_default_corpus_tokens())
    assert len(tokens) > 100_000
    tok = ByteTokenizer()
    assert (tokens == tok.bos_id).sum() == (tokens == tok.eos_id).sum() == len(topics)
    first = tok.encode(topics[sorted(topics)[0]])
    assert tokens[: len(first)].tolist() == first


# ----------------------------------------------------------------------------- datasets


def test_packed_dataset_windows_are_consecutive_and_labels_shifted_by_one() -> None:
    tokens = torch.arange(100, 123)  # 23 tokens
    ds = PackedDataset(tokens, seq_len=5)
    assert len(ds) == (23 - 1) // 5 == 4
    for i in range(len(ds)):
        item = ds[i]
        assert item["input_ids"].dtype == item["labels"].dtype == torch.int64
        assert item["input_ids"].tolist() == list(range(100 + 5 * i, 105 + 5 * i))
        assert item["labels"].tolist() == list(range(101 + 5 * i, 106 + 5 * i))
    with pytest.raises(IndexError):
        ds[4]


def _write_corpus(tmp_path: Path) -> tuple[Path, list[int]]:
    docs = ["first document\n\nwith a blank line", "second: ünïcødé", "third"]
    inputs = []
    for i, text in enumerate(docs):
        inputs.append(tmp_path / f"doc{i}.txt")
        inputs[-1].write_text(text, encoding="utf-8")
    out = tmp_path / "corpus.bin"
    tokenize_main([*map(str, inputs), str(out), "--no-progress"])
    tok = ByteTokenizer()
    return out, [i for text in docs for i in tok.encode(text)]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_memmap_dataset_equals_packed_dataset_on_tokens_from_prepare(
    tmp_path: Path, dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path, expected = _write_corpus(tmp_path)
    assert f"wrote {len(expected)} tokens of 3 documents (uint16, byte: 258 ids)" in capsys.readouterr().out
    assert path.stat().st_size == len(expected) * 2  # flat: no header
    if dtype == "uint32":  # a bare .bin of another writer, read with data.dtype
        path = tmp_path / "bare.bin"
        np.asarray(expected, dtype=np.uint32).tofile(path)
    mm = MemmapTokenDataset(path, seq_len=7, dtype=dtype)
    ref = PackedDataset(torch.tensor(expected), seq_len=7)
    assert len(mm) == len(ref) > 0
    for i in range(len(ref)):
        assert torch.equal(mm[i]["input_ids"], ref[i]["input_ids"])
        assert torch.equal(mm[i]["labels"], ref[i]["labels"])


def test_memmap_dataset_pickles_by_path_not_by_content(tmp_path: Path) -> None:
    import pickle

    path = tmp_path / "big.bin"
    np.arange(100_000, dtype=np.uint16).tofile(path)
    ds = MemmapTokenDataset(path, seq_len=7)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # spawned DataLoader workers reopen the file instead of copying 200 KB
    again = pickle.loads(blob)
    assert torch.equal(again[1]["input_ids"], ds[1]["input_ids"])


def test_missing_token_file_names_option_value_and_remedy(tmp_path: Path) -> None:
    missing = tmp_path / "nope.bin"
    with pytest.raises(ConfigError, match=rf"data\.source={missing}.*ultrascale-tokenize.*data\.source=pydoc"):
        MemmapTokenDataset(missing, seq_len=8)
    with pytest.raises(ConfigError, match=r"data\.source="):
        UltraScaleDataModule(str(missing), seq_len=8, micro_batch_size=2)  # fails at construction


def test_token_file_size_not_multiple_of_dtype_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "odd.bin"
    bad.write_bytes(b"\x01\x00\x02\x00\x03")
    with pytest.raises(ConfigError, match=rf"data\.source={bad} has 5 bytes.*data\.dtype=uint16"):
        MemmapTokenDataset(bad, seq_len=2, dtype="uint16")
    with pytest.raises(ConfigError, match=r"data\.dtype=int8 .*valid: uint16, uint32"):
        MemmapTokenDataset(bad, seq_len=2, dtype="int8")


# ----------------------------------------------------------------------------- sampler


def _epoch(dataset_size: int, micro: int, dp: int, rank: int, seed: int = 0, epoch: int = 0) -> list[int]:
    sampler = DataParallelSampler(range(dataset_size), micro, num_replicas=dp, rank=rank, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_sampler_shards_by_dp_rank_disjointly_and_drops_the_tail() -> None:
    per_rank = [_epoch(103, micro=4, dp=3, rank=r) for r in range(3)]
    steps = 103 // 12
    assert all(len(indices) == steps * 4 for indices in per_rank)
    assert len(set().union(*map(set, per_rank))) == 3 * steps * 4  # disjoint, no repeats
    assert per_rank[1] == _epoch(103, micro=4, dp=3, rank=1)  # a peer with the same dp rank


def test_global_batch_content_does_not_depend_on_dp_size() -> None:
    # dp=2 x micro 2 must train on the global batches of dp=1 x micro 4 (and dp=4 x micro 1).
    single = _epoch(50, micro=4, dp=1, rank=0)
    reference = [single[k : k + 4] for k in range(0, len(single), 4)]
    for dp, micro in ((2, 2), (4, 1)):
        ranks = [_epoch(50, micro=micro, dp=dp, rank=r) for r in range(dp)]
        for step, batch in enumerate(reference):
            assert [i for r in range(dp) for i in ranks[r][step * micro : (step + 1) * micro]] == batch


def test_sampler_order_is_a_function_of_seed_and_epoch() -> None:
    assert _epoch(64, 4, 2, 0, seed=1, epoch=3) == _epoch(64, 4, 2, 0, seed=1, epoch=3)
    assert _epoch(64, 4, 2, 0, seed=1, epoch=3) != _epoch(64, 4, 2, 0, seed=1, epoch=4)
    assert _epoch(64, 4, 2, 0, seed=1, epoch=3) != _epoch(64, 4, 2, 0, seed=2, epoch=3)
    unshuffled = DataParallelSampler(range(8), 2, num_replicas=2, rank=1, shuffle=False)
    assert list(unshuffled) == [2, 3, 6, 7]


def test_sampler_resumes_with_exactly_the_remaining_indices() -> None:
    full = _epoch(90, micro=3, dp=2, rank=1, seed=5, epoch=2)
    sampler = DataParallelSampler(range(90), 3, num_replicas=2, rank=1, seed=5)
    sampler.set_epoch(2)
    it = iter(sampler)
    seen = [next(it) for _ in range(4 * 3 + 2)]  # 4 micro batches and 2/3 of the fifth
    state = sampler.state_dict()
    assert state == {"epoch": 2, "consumed_samples": 4 * 3 * 2}  # partial micro batches do not count

    fresh = DataParallelSampler(range(90), 3, num_replicas=2, rank=1, seed=5)
    fresh.load_state_dict(state)
    fresh.set_epoch(2)  # what Lightning does at epoch start: the same epoch keeps the position
    assert seen[:12] + list(fresh) == full
    assert list(fresh) == full  # the resume position applies to one iteration only
    fresh.load_state_dict(state)
    fresh.set_epoch(3)  # another epoch starts from its beginning
    assert list(fresh) == _epoch(90, micro=3, dp=2, rank=1, seed=5, epoch=3)


def test_resume_position_carries_over_to_another_dp_size() -> None:
    # consumed_samples counts global samples, so dp=2 x micro 2 can continue a dp=1 x micro 4 run.
    single = _epoch(40, micro=4, dp=1, rank=0)
    sampler = DataParallelSampler(range(40), 4)
    it = iter(sampler)
    _ = [next(it) for _ in range(3 * 4)]
    state = sampler.state_dict()
    resumed = []
    for r in range(2):
        s = DataParallelSampler(range(40), 2, num_replicas=2, rank=r)
        s.load_state_dict(state)
        resumed.append(list(s))
    merged = [i for step in range(len(resumed[0]) // 2) for r in range(2) for i in resumed[r][2 * step : 2 * step + 2]]
    assert merged == single[12:]


def test_loader_state_counts_batches_handed_out_not_indices_prefetched_by_workers() -> None:
    data = PackedDataset(torch.arange(401), seq_len=4)  # 100 sequences
    sampler = DataParallelSampler(data, micro_batch_size=2, num_replicas=2, rank=0, seed=3)
    loader = ResumableDataLoader(data, sampler, num_workers=2)
    reference = [b["input_ids"] for b in ResumableDataLoader(data, DataParallelSampler(data, 2, 2, 0, seed=3))]
    it = iter(loader)
    seen = [next(it)["input_ids"] for _ in range(5)]
    assert sampler.state_dict()["consumed_samples"] > 5 * 4  # the workers have read ahead
    state = loader.state_dict()
    assert state == {"epoch": 0, "consumed_samples": 5 * 4}
    del it

    again = ResumableDataLoader(data, DataParallelSampler(data, 2, 2, 0, seed=3))
    again.load_state_dict(state)
    rest = [b["input_ids"] for b in again]
    assert len(again) == len(reference)  # len stays the full epoch: Lightning counts from it
    assert all(torch.equal(a, b) for a, b in zip(seen + rest, reference, strict=True))


# ----------------------------------------------------------------------------- DataModule


class _DPStrategy(DDPStrategy):
    """A parallel strategy that reports chosen data-parallel coordinates, as UltraScaleStrategy does."""

    def __init__(self, dp_size: int, dp_rank: int) -> None:
        super().__init__()
        self._dp = (dp_size, dp_rank)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self._dp[0], "rank": self._dp[1]}


def _global_batches_seen_by(dm: UltraScaleDataModule, steps: int) -> list[torch.Tensor]:
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)
    return [b["input_ids"] for _, b in zip(range(steps), loader)]


def test_datamodule_shards_by_strategy_dp_coordinates_not_world_rank() -> None:
    # World of 4 = dp 2 x tp 2: world ranks 0, 1 are tp peers in dp rank 0; ranks 2, 3 in dp rank 1.
    batches = {}
    for world_rank in range(4):
        dm = UltraScaleDataModule(seq_len=32, micro_batch_size=2, seed=7)
        dm.trainer = SimpleNamespace(strategy=_DPStrategy(dp_size=2, dp_rank=world_rank // 2))  # type: ignore[assignment]
        dm.setup("fit")
        batches[world_rank] = _global_batches_seen_by(dm, steps=3)
    single = UltraScaleDataModule(seq_len=32, micro_batch_size=4, seed=7)
    single.setup("fit")  # no trainer: one dp rank
    reference = _global_batches_seen_by(single, steps=3)
    for step in range(3):
        assert torch.equal(batches[0][step], batches[1][step])  # tp peers read the same samples
        assert torch.equal(batches[2][step], batches[3][step])
        assert torch.equal(torch.cat([batches[0][step], batches[2][step]]), reference[step])
        assert batches[0][step].shape == (2, 32)


def test_datamodule_batches_are_packed_next_token_pairs() -> None:
    dm = UltraScaleDataModule(seq_len=64, micro_batch_size=3)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == (3, 64)
    assert batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    val = list(dm.val_dataloader())
    n_seq = (len(load_default_corpus_tokens()) - 1) // 64
    assert len(val) == int(n_seq * 0.05) // 3
    # Validation holds out the tail of the sequences, right after the last training one.
    assert dm.val_dataset.indices[0] == dm.train_dataset.indices[-1] + 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 0, "micro_batch_size": 2}, r"data\.seq_len=0 must be > 0"),
        ({"seq_len": 8, "micro_batch_size": -1}, r"data\.micro_batch_size=-1 must be > 0"),
        ({"seq_len": 8, "micro_batch_size": 2, "val_fraction": 1.0}, r"data\.val_fraction=1\.0"),
        ({"seq_len": 8, "micro_batch_size": 2, "dtype": "int64"}, r"data\.dtype=int64"),
    ],
)
def test_datamodule_rejects_bad_options_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        UltraScaleDataModule(**kwargs)


def test_datamodule_too_small_for_one_global_batch_names_the_options(tmp_path: Path) -> None:
    path, _ = _write_corpus(tmp_path)  # ~50 tokens
    dm = UltraScaleDataModule(str(path), seq_len=8, micro_batch_size=4, val_fraction=0.0)
    dm.trainer = SimpleNamespace(strategy=_DPStrategy(dp_size=2, dp_rank=0))  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"data\.seq_len=8 x data\.micro_batch_size=4 x dp=2 needs 8 sequences"):
        dm.setup("fit")
    dm = UltraScaleDataModule(str(path), seq_len=8, micro_batch_size=1, val_fraction=0.1)
    with pytest.raises(ConfigError, match=r"data\.val_fraction=0\.1 holds out 0 sequences"):
        dm.setup("fit")
