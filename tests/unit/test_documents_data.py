"""data.documents=mask, the data side: packed windows that carry their document boundaries.

Each window's ``position_ids`` restart at every document start (and at the window's first token),
its ``document_ids`` step by one there, and ``mask_eos_loss`` ignores exactly the separator labels
(a document's last token predicting the next one's first). ``concat`` items stay what they were.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_ultrascale.data import MemmapTokenDataset, PackedDataset, UltraScaleDataModule
from lightning_ultrascale.data.corpus import load_default_corpus_documents, load_default_corpus_tokens
from lightning_ultrascale.data.index import documents_path
from lightning_ultrascale.data.prepare import tokenize_corpus
from lightning_ultrascale.data.tokenizer import ByteTokenizer, load_tokenizer
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.utils.loss import IGNORE_INDEX

BOS, EOS = ByteTokenizer.bos_id, ByteTokenizer.eos_id


def _starts(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _expected(starts: np.ndarray, start: int, seq_len: int) -> tuple[list[int], list[int], list[int]]:
    """Positions, document ids and separator label indices of one window, token by token."""
    inside = {int(s) - start for s in starts if start < s <= start + seq_len}
    positions, documents, restart, doc = [], [], 0, 0
    for k in range(seq_len):
        if k in inside:
            restart, doc = k, doc + 1
        positions.append(k - restart)
        documents.append(doc)
    return positions, documents, sorted(k - 1 for k in inside)


def _token_file(tmp_path: Path, texts: list[str], name: str = "docs") -> Path:
    inputs = tmp_path / f"{name}.jsonl"
    inputs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenize_corpus([inputs], tmp_path / f"{name}.bin", load_tokenizer("byte"))
    return tmp_path / f"{name}.bin"


# ----------------------------------------------------------------------------- windows


@pytest.mark.parametrize("final", [True, False], ids=["with-end", "starts-only"])
def test_positions_restart_and_document_ids_step_exactly_at_document_starts(final: bool) -> None:
    # Long documents (windows starting mid-document), runs of 1- and 2-token documents (many in one
    # window), and a document starting exactly at a window's first token (index 3 * 8 = 24).
    lengths = [11, 13, 1, 1, 2, 1, 1, 3, 40, 2, 2, 2, 2, 5, 17]
    starts = _starts(lengths) if final else _starts(lengths)[:-1]
    assert 24 in starts
    ds = PackedDataset(torch.arange(1000, 1000 + sum(lengths)), 8, starts, documents="mask")
    for i in range(len(ds)):
        item = ds[i]
        positions, documents, _ = _expected(starts, i * 8, 8)
        assert item["position_ids"].tolist() == positions and item["document_ids"].tolist() == documents
        assert item["position_ids"].dtype == item["document_ids"].dtype == torch.int64
        assert item["position_ids"][0] == 0 and item["document_ids"][0] == 0  # a window start is a restart
        steps = item["document_ids"].diff()
        assert ((steps == 0) | (steps == 1)).all()
        assert item["labels"].tolist() == list(range(1000 + i * 8 + 1, 1000 + i * 8 + 9))  # untouched without mask
    assert ds[3]["document_ids"].tolist() == [0, 1, 2, 2, 3, 4, 5, 5]  # tokens 24..31: six documents
    assert ds[3]["position_ids"].tolist() == [0, 0, 0, 1, 0, 0, 0, 1]


def test_a_window_starting_mid_document_counts_positions_from_its_first_token() -> None:
    ds = PackedDataset(torch.arange(30), 4, np.array([0, 6, 30]), documents="mask")
    assert ds[1]["position_ids"].tolist() == [0, 1, 0, 1]  # tokens 4..7, document 6.. starts inside
    assert ds[2]["position_ids"].tolist() == [0, 1, 2, 3]  # tokens 8..11, in the middle of document 6..
    assert ds[2]["document_ids"].tolist() == [0, 0, 0, 0]


def test_the_last_label_is_ignored_when_the_next_window_starts_a_document() -> None:
    ds = PackedDataset(torch.arange(20), 4, np.array([0, 8]), documents="mask", mask_eos_loss=True)
    assert ds[1]["labels"].tolist() == [5, 6, 7, IGNORE_INDEX]  # token 7 would predict document 8..'s first
    assert ds[1]["document_ids"].tolist() == [0, 0, 0, 0]  # ... which is not in this window
    assert ds[2]["position_ids"].tolist() == [0, 1, 2, 3] and ds[2]["labels"].tolist() == [9, 10, 11, 12]


@pytest.mark.parametrize("documents", ["concat", "mask"])
def test_mask_eos_loss_ignores_exactly_the_separator_labels(documents: str) -> None:
    lengths = np.random.default_rng(0).integers(1, 30, size=80).tolist()
    starts, tokens = _starts(lengths), torch.arange(sum(lengths)) + 7
    masked = PackedDataset(tokens, 16, starts, documents=documents, mask_eos_loss=True)
    plain = PackedDataset(tokens, 16)
    for i in range(len(masked)):
        item, today = masked[i], plain[i]
        _, _, separators = _expected(starts, i * 16, 16)
        ignored = (item["labels"] == IGNORE_INDEX).nonzero().flatten().tolist()
        assert ignored == separators
        assert len(ignored) == int(((starts > i * 16) & (starts <= i * 16 + 16)).sum())
        kept = item["labels"] != IGNORE_INDEX
        assert torch.equal(item["labels"][kept], today["labels"][kept])
        assert torch.equal(item["input_ids"], today["input_ids"])  # the labels no longer alias the inputs


def test_concat_items_are_todays_windows_with_or_without_document_starts() -> None:
    tokens = torch.arange(100, 150)
    for ds in (PackedDataset(tokens, 7), PackedDataset(tokens, 7, _starts([3, 20, 27]))):
        assert len(ds) == 7
        for i in range(len(ds)):
            item = ds[i]
            assert set(item) == {"input_ids", "labels"}
            assert item["input_ids"].tolist() == list(range(100 + 7 * i, 107 + 7 * i))
            assert item["labels"].tolist() == list(range(101 + 7 * i, 108 + 7 * i))


# ----------------------------------------------------------------------------- token files, the bundled corpus


def test_a_tokenized_files_documents_restart_at_each_bos_and_eos_labels_are_ignored(tmp_path: Path) -> None:
    texts = [("x" * n) for n in np.random.default_rng(1).integers(0, 25, size=60).tolist()]
    path = _token_file(tmp_path, texts)
    ds = MemmapTokenDataset(path, 32, documents="mask", mask_eos_loss=True)
    assert ds.dtype == "uint16" and len(ds.doc_starts) == len(texts) + 1
    for i in range(len(ds)):
        item = ds[i]
        inside = item["input_ids"] == BOS
        inside[0] = False  # the window's first token starts document 0 whatever it is
        assert torch.equal(item["document_ids"], torch.cumsum(inside, 0))
        assert torch.equal(item["position_ids"][1:] == 0, inside[1:]) and item["position_ids"][0] == 0
        # Every eos but the file's last is followed by a bos: its label is the separator.
        assert torch.equal(item["labels"] == IGNORE_INDEX, item["input_ids"] == EOS)
    again = pickle.loads(pickle.dumps(ds))  # a spawned DataLoader worker reopens the file with the same options
    assert (again.documents, again.mask_eos_loss) == ("mask", True)
    assert all(torch.equal(again[3][k], ds[3][k]) for k in ds[3])


def test_the_bundled_corpus_knows_its_documents_without_changing_its_tokens() -> None:
    tokens, starts = load_default_corpus_documents()
    assert torch.equal(tokens, load_default_corpus_tokens())
    assert starts.dtype == np.int64 and starts[0] == 0 and starts[-1] == len(tokens)
    assert (tokens == BOS).nonzero().flatten().tolist() == starts[:-1].tolist()


def test_the_bundled_corpus_with_documents_mask_batches_positions_and_document_ids() -> None:
    dm = UltraScaleDataModule(seq_len=128, micro_batch_size=4, documents="mask", mask_eos_loss=True)
    dm.setup("fit")
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        batch = next(iter(loader))
        assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
        assert all(v.shape == (4, 128) and v.dtype == torch.int64 for v in batch.values())
        assert (batch["position_ids"][:, 0] == 0).all()
        assert torch.equal(batch["position_ids"][:, 1:] == 0, batch["input_ids"][:, 1:] == BOS)
        assert torch.equal(batch["labels"] == IGNORE_INDEX, batch["input_ids"] == EOS)


def test_a_blend_with_documents_mask_yields_positions_and_document_ids(tmp_path: Path) -> None:
    web = _token_file(tmp_path, [f"web page {i} " * (i % 7 + 1) for i in range(80)], "web")
    code = _token_file(tmp_path, [f"def f{i}(): pass\n" * (i % 3 + 1) for i in range(40)], "code")
    sources = [{"path": str(web), "weight": 0.6}, {"path": str(code), "weight": 0.4}]
    dm = UltraScaleDataModule(None, sources=sources, seq_len=32, micro_batch_size=2, documents="mask")
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) > 4
    for batch in batches:
        assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
        assert batch["document_ids"].shape == batch["position_ids"].shape == (2, 32)
        assert torch.equal(batch["position_ids"][:, 1:] == 0, batch["input_ids"][:, 1:] == BOS)


# ----------------------------------------------------------------------------- refusals


def test_an_unknown_documents_value_is_refused_naming_the_valid_ones(tmp_path: Path) -> None:
    message = r"data\.documents=flat is not supported; valid: concat, mask"
    with pytest.raises(ConfigError, match=message):
        PackedDataset(torch.arange(10), 4, documents="flat")
    with pytest.raises(ConfigError, match=message):
        UltraScaleDataModule(seq_len=16, micro_batch_size=1, documents="flat")
    with pytest.raises(ConfigError, match=message):
        MemmapTokenDataset(_token_file(tmp_path, ["a", "b"]), 2, documents="flat")
    with pytest.raises(ConfigError, match=r"need the documents' starts"):
        PackedDataset(torch.arange(10), 4, documents="mask")


def test_masking_a_token_file_without_document_starts_says_how_to_get_them(tmp_path: Path) -> None:
    path = _token_file(tmp_path, ["one", "two", "three"] * 10)
    documents_path(path).unlink()
    assert set(MemmapTokenDataset(path, 8)[0]) == {"input_ids", "labels"}  # concat needs no starts
    where = re.escape(str(path))
    fix = rf"it has no docs\.docs\.npy; tokenize it again with `ultrascale-tokenize INPUT {where}`"
    message = rf"^data\.documents=mask needs the document starts of data\.source={where}, but {fix}"
    with pytest.raises(ConfigError, match=message + r".*, or set data\.documents=concat$"):
        UltraScaleDataModule(str(path), seq_len=8, micro_batch_size=1, documents="mask")  # before any process group
    with pytest.raises(ConfigError, match=r"^data\.mask_eos_loss=true needs .* set data\.mask_eos_loss=false$"):
        MemmapTokenDataset(path, 8, mask_eos_loss=True)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda n: np.array([0, 9, 4, n]), "is not sorted"),
        (lambda n: np.array([2, 9, n]), "starts at 2, not 0"),
        (lambda n: np.array([0, 9, n + 5]), r"ends at \d+, past the \d+ tokens"),
        (lambda n: np.array([[0, 9, n]]), r"is not a 1-D integer array"),
        (lambda n: np.array([0.0, 9.0, n]), r"is not a 1-D integer array"),
        (lambda n: np.array([], dtype=np.int64), r"is not a 1-D integer array"),
        (None, "cannot be read"),
    ],
    ids=["unsorted", "first-not-0", "past-the-end", "2-d", "float", "empty", "not-npy"],
)
def test_damaged_document_starts_are_refused_naming_the_file(tmp_path: Path, damage, message: str) -> None:
    path = _token_file(tmp_path, ["one", "two", "three"] * 10)
    docs = documents_path(path)
    if damage is None:
        docs.write_bytes(b"not an npy file")
    else:
        np.save(docs, damage(len(np.memmap(path, dtype=np.uint16, mode="r"))))
    with pytest.raises(ConfigError, match=re.escape(f"data.source={path}: its document starts {docs} ") + message):
        MemmapTokenDataset(path, 8, documents="mask")
