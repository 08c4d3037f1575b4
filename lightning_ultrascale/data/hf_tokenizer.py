"""The run's tokenizer as a Hugging Face tokenizer directory: what ``ultrascale-export`` writes beside the model.

``transformers.AutoTokenizer.from_pretrained(OUT)`` must encode text to the very ids the model
was trained on; :func:`save_hf_tokenizer` writes it, :func:`check_hf_tokenizer` proves it on
probe texts (runs of spaces, code, accents, CJK, emoji, random strings):

- a ``tokenizer.json`` tokenizer is copied as it is, with its ``tokenizer_config.json`` (or one
  naming its bos/eos); one whose encodings do not begin with bos (DeepSeek-V3's leaves that to
  ``add_bos_token``, which ``transformers`` 5 no longer reads) gets a post-processor step adding it;
- a SentencePiece BPE model (Llama 2, Mistral, Mixtral) becomes a ``tokenizer.json`` that encodes
  as SentencePiece does. The usual conversion (``transformers``' ``LlamaConverter``) does not:
  it ranks the whitespace-only pieces (score -1e9 in SentencePiece, merged last) first and skips
  the dummy prefix before a leading space, so ``"  leading"`` and indented code get other ids
  (435 of 3,000 random strings with Mistral's model). Here the merges are ranked by the merged
  piece's score, the dummy prefix is always prepended, and words split where SentencePiece splits
  them. The ``tokenizer.model`` is copied too;
- the byte tokenizer becomes a byte-level BPE without merges: ids 0..255 are the bytes, then
  ``<bos>`` (256) and ``<eos>`` (257).

Encoding with ``add_special_tokens=True`` (transformers' default, what ``generate`` users do)
prepends bos, as every training document began with it.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

from lightning_ultrascale.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TextTokenizer,
    _require,
)
from lightning_ultrascale.errors import ConfigError

#: Texts every exported tokenizer must encode like the training one (plus seeded random strings).
PROBES = (
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces   ",
    "def f(x):\n    return x + 1\n\n\tindented\twith tabs",
    "Ünïcödé, 漢字, emoji 🦊, numbers 3.14159 and 1,000,000",
    "",
    " ",
    "a\n\n\n  b",
)
log = logging.getLogger(__name__)
_RANDOM_CHARS = "ab cd  \n\tÉé漢🦊.,;:'\"()[]{}0123456789"


def save_hf_tokenizer(tokenizer: TextTokenizer, out_dir: str | Path, model_max_length: int) -> list[str]:
    """Write ``tokenizer`` into ``out_dir`` for ``AutoTokenizer``; returns the file names written.

    Example:
        >>> import tempfile
        >>> save_hf_tokenizer(ByteTokenizer(), tempfile.mkdtemp(), 256)  # doctest: +SKIP
        ['tokenizer.json', 'tokenizer_config.json']
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length}
    written = ["tokenizer.json", "tokenizer_config.json"]
    if isinstance(tokenizer, HFTokenizer):
        source = tokenizer.files[0]
        _with_bos(source, tokenizer.bos_id, out / "tokenizer.json")
        own = source.with_name("tokenizer_config.json")
        if own in tokenizer.files:
            config = {**json.loads(own.read_text()), "model_max_length": model_max_length}
        else:
            config.update(bos_token=tokenizer.token(tokenizer.bos_id), eos_token=tokenizer.token(tokenizer.eos_id))
    elif isinstance(tokenizer, SentencePieceTokenizer):
        fast, specials = _sentencepiece_bpe(tokenizer)
        fast.save(str(out / "tokenizer.json"))
        shutil.copy2(tokenizer.files[0], out / "tokenizer.model")
        written.append("tokenizer.model")
        config.update(specials)
    elif isinstance(tokenizer, ByteTokenizer):
        _byte_level().save(str(out / "tokenizer.json"))
        config.update(bos_token="<bos>", eos_token="<eos>")
    else:
        raise ConfigError(f"cannot write a Hugging Face tokenizer for {type(tokenizer).__name__}")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return written


def write_hf_tokenizer(tokenizer: TextTokenizer, out_dir: str | Path, vocab_size: int, model_max_length: int) -> None:
    """Write ``tokenizer`` as an HF tokenizer beside a model of ``vocab_size`` ids and prove it encodes the same
    (with ``transformers``; without it, say so). A tokenizer with more ids than the model is refused."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"the tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids, more than the model's "
            f"vocab_size={vocab_size}"
        )
    save_hf_tokenizer(tokenizer, out_dir, model_max_length)
    try:
        difference = check_hf_tokenizer(out_dir, tokenizer)
    except ImportError:
        log.warning("transformers is not installed: the exported tokenizer was not checked against %s", tokenizer.name)
        return
    if difference is not None:
        raise ConfigError(
            f"the Hugging Face tokenizer written to {out_dir} does not encode as the training tokenizer "
            f"{tokenizer.name!r} does: {difference}. Export with --no-tokenizer and ship the tokenizer yourself"
        )


def check_hf_tokenizer(out_dir: str | Path, tokenizer: TextTokenizer, n_random: int = 300) -> str | None:
    """None if ``AutoTokenizer`` on ``out_dir`` encodes every probe as ``tokenizer`` does, else the first difference.

    Needs ``transformers``; raises ``ImportError`` without it (the caller says the check did not run).
    """
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(out_dir))
    rng = random.Random(0)
    randoms = ["".join(rng.choice(_RANDOM_CHARS) for _ in range(rng.randint(1, 40))) for _ in range(n_random)]
    for text in (*PROBES, *randoms):
        want = tokenizer.encode_text(text)
        got = loaded.encode(text, add_special_tokens=False)
        if got != want:
            return f"{text!r}: {got[:12]} where training encoded {want[:12]}"
    framed = loaded.encode("x")
    if framed[0] != tokenizer.bos_id:
        return f"encode('x') begins with {framed[0]}, not the bos id {tokenizer.bos_id} every document began with"
    return None


def _with_bos(source: Path, bos_id: int, target: Path) -> None:
    """Copy a ``tokenizer.json``; if its encodings do not begin with bos (DeepSeek-V3's), add that step."""
    tokenizers = _require("tokenizers", "a tokenizer.json")
    fast = tokenizers.Tokenizer.from_file(str(source))
    if fast.encode("x").ids[:1] == [bos_id]:
        shutil.copy2(source, target)
        return
    bos = fast.id_to_token(bos_id)
    template = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    own = fast.post_processor
    fast.post_processor = template if own is None else tokenizers.processors.Sequence([own, template])
    fast.save(str(target))


def _byte_level() -> Any:
    tokenizers = _require("tokenizers", "the byte tokenizer's export")
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    fast = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    fast.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    fast.decoder = tokenizers.decoders.ByteLevel()
    fast.add_special_tokens(["<bos>", "<eos>"])  # ids 256 and 257
    fast.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 256)]
    )
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table (the one ``ByteLevel`` pre-tokenizes with)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _check_sentencepiece_bpe(path: Path, normalizer: Any, trainer: Any) -> None:
    """Refuse a SentencePiece model the export cannot rewrite exactly (not BPE, or normalising text)."""
    unsupported = {
        "model_type": trainer.model_type != 2,  # BPE (Llama 2, Mistral); unigram (T5) is not written
        "normalization_rule_name": normalizer.name not in ("identity", ""),
        "remove_extra_whitespaces": normalizer.remove_extra_whitespaces,
        "treat_whitespace_as_suffix": trainer.treat_whitespace_as_suffix,
        "split_by_whitespace": not trainer.split_by_whitespace,
    }
    if any(unsupported.values()):
        raise ConfigError(
            f"{path}: export writes SentencePiece BPE models with identity normalization; this model "
            f"differs in {', '.join(k for k, v in unsupported.items() if v)}. Export with --no-tokenizer and ship "
            "the tokenizer.model with a tokenizer class of your own"
        )


def _sentencepiece_bpe(tokenizer: SentencePieceTokenizer) -> tuple[Any, dict[str, str]]:
    """A ``tokenizers`` BPE that encodes as the SentencePiece BPE model does (see the module docstring)."""
    tokenizers = _require("tokenizers", "a SentencePiece tokenizer's export")
    spm = _require("sentencepiece", "a SentencePiece model")
    proto = _model_proto(tokenizer.files[0])
    normalizer, trainer = proto.normalizer_spec, proto.trainer_spec
    _check_sentencepiece_bpe(tokenizer.files[0], normalizer, trainer)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer.files[0]))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = []
    for i, piece in enumerate(pieces):
        if not sp.is_control(i) and not sp.is_unknown(i) and not sp.is_byte(i):
            merges += [
                (-sp.get_score(i), i, (piece[:k], piece[k:]))
                for k in range(1, len(piece))
                if piece[:k] in vocab and piece[k:] in vocab
            ]
    # SentencePiece merges the pair whose merged piece scores highest: rank the merges so.
    ranked = [pair for _, _, pair in sorted(merges)]
    unk = pieces[sp.unk_id()]
    fast = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab=vocab, merges=ranked, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    space = "\u2581"
    steps = [tokenizers.normalizers.Replace(" ", space)]
    if normalizer.add_dummy_prefix:  # SentencePiece prepends it even before a leading space
        steps.insert(0, tokenizers.normalizers.Prepend(space))
    fast.normalizer = tokenizers.normalizers.Sequence(steps)
    # A word begins at a space after a non-space; a run of spaces stays in one word only if the
    # model allows whitespace-only pieces.
    if trainer.allow_whitespace_only_pieces:
        word = f"{space}*[^{space}]+|{space}+"
    else:
        word = f"{space}[^{space}]*|[^{space}]+"
    fast.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(word), behavior="isolated")
    decoders = tokenizers.decoders
    steps = [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
    if normalizer.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    fast.decoder = decoders.Sequence(steps)
    bos, eos = pieces[tokenizer.bos_id], pieces[tokenizer.eos_id]
    fast.add_special_tokens([unk, bos, eos])
    fast.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_id)]
    )
    return fast, {"bos_token": bos, "eos_token": eos, "unk_token": unk}


def _model_proto(path: Path) -> Any:
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # it needs protobuf
        raise ConfigError(
            "exporting a SentencePiece tokenizer reads its model with protobuf: "
            "pip install 'lightning-ultrascale[data]'"
        ) from None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    return proto
