"""Tokenizers: the byte-level default, and a model's own (Hugging Face ``tokenizer.json`` or SentencePiece).

:func:`load_tokenizer` takes ``"byte"``, a ``tokenizer.json`` (or a model directory holding one),
or a SentencePiece ``.model`` file. Each tokenizer encodes a document's text without special
tokens (the tokenizer's own ``encode(text, add_special_tokens=False)``); ``ultrascale-tokenize``
frames every document with the ``bos_id`` / ``eos_id`` it records in the token file's index.
The files a tokenizer was read from are copied beside the token file, with their hash, so a run
and its exported model use the very tokenizer the data was made with.

The byte tokenizer needs nothing to download and encodes every text: ids 0..255 are the UTF-8
bytes, then two specials. Sequences are about 4x longer than with a BPE vocabulary, the right
trade for the default job, which must run offline on a laptop.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from lightning_ultrascale.errors import ConfigError

#: Special tokens looked for when a ``tokenizer.json`` comes without a ``tokenizer_config.json``
#: naming its bos/eos: Llama 3, Llama 2/Mistral/Mixtral, DeepSeek-V3, GPT-2/Qwen.
# DeepSeek's bars are U+FF5C, its spaces U+2581.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<|endoftext|>")


class TextTokenizer(Protocol):
    """What ``ultrascale-tokenize`` needs of a tokenizer."""

    name: str
    vocab_size: int
    bos_id: int
    eos_id: int
    #: The files it was read from (copied beside the token file), empty for the byte tokenizer.
    files: tuple[Path, ...]

    def encode_text(self, text: str) -> list[int]:
        """The ids of ``text`` without any special token."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus ``bos_id=256`` and ``eos_id=257``.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hé")
        [256, 104, 195, 169, 257]
        >>> tok.decode(tok.encode("hé"))
        'hé'
    """

    name: str = "byte"
    bos_id: int = 256
    eos_id: int = 257
    vocab_size: int = 258
    files: tuple[Path, ...] = ()

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        """The UTF-8 bytes of ``text``, framed by ``bos_id``/``eos_id`` when asked."""
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_text(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Text from ids; specials are dropped, invalid UTF-8 becomes U+FFFD (a model may emit any byte)."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``) through the ``tokenizers`` library.

    bos/eos come from ``tokenizer_config.json`` beside it (``bos_token`` / ``eos_token``), else
    from well-known special tokens of the vocabulary; ``bos``/``eos`` name them explicitly.
    """

    def __init__(self, path: Path, name: str | None = None, bos: str | None = None, eos: str | None = None) -> None:
        tokenizers = _require("tokenizers", "a tokenizer.json")
        self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        config_file = path.with_name("tokenizer_config.json")
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.files = (path, config_file) if config_file.is_file() else (path,)
        # (The directory's name, resolved: a bare "tokenizer.json" has an empty parent name.)
        self.name = name or str(config.get("name_or_path") or path.resolve().parent.name)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(bos or _token_text(config.get("bos_token")), _BOS_NAMES, "bos", path)
        self.eos_id = self._special(eos or _token_text(config.get("eos_token")), _EOS_NAMES, "eos", path)

    def _special(self, given: str | None, known: tuple[str, ...], which: str, path: Path) -> int:
        for token in (given,) if given else known:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return int(token_id)
        raise ConfigError(
            f"--tokenizer {path}: no {which} token found ({given!r} given; tried {', '.join(known)}); "
            f"name it with --{which}-token"
        )

    def encode_text(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def token(self, token_id: int) -> str:
        """The text of a token id (for naming bos/eos)."""
        return str(self._tokenizer.id_to_token(token_id))

    def __getstate__(self) -> dict[str, object]:  # workers rebuild it from its file
        return {**self.__dict__, "_tokenizer": self._tokenizer.to_str()}

    def __setstate__(self, state: dict[str, object]) -> None:
        tokenizers = _require("tokenizers", "a tokenizer.json")
        self.__dict__.update(state)
        self._tokenizer = tokenizers.Tokenizer.from_str(state["_tokenizer"])


class SentencePieceTokenizer:
    """A SentencePiece model (Llama 2, Mistral, Mixtral): ``encode`` without bos/eos, its own bos/eos ids."""

    def __init__(self, path: Path, name: str | None = None) -> None:
        spm = _require("sentencepiece", "a SentencePiece model")
        self._path = path
        self._model = spm.SentencePieceProcessor(model_file=str(path))
        self.files = (path,)
        self.name = name or path.name
        self.vocab_size = int(self._model.get_piece_size())
        self.bos_id, self.eos_id = int(self._model.bos_id()), int(self._model.eos_id())
        if self.bos_id < 0 or self.eos_id < 0:
            raise ConfigError(f"--tokenizer {path}: the SentencePiece model has no bos or eos piece")

    def encode_text(self, text: str) -> list[int]:
        return list(self._model.encode(text))

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "_model"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._model = _require("sentencepiece", "").SentencePieceProcessor(model_file=str(self._path))


def load_tokenizer(
    spec: str | Path, name: str | None = None, bos: str | None = None, eos: str | None = None
) -> TextTokenizer:
    """``"byte"``, a ``tokenizer.json`` or a directory holding one, or a SentencePiece ``.model`` file.

    Example:
        >>> load_tokenizer("byte").vocab_size
        258
    """
    if str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer(path / "tokenizer.json", name or path.resolve().name, bos, eos)
        models = sorted(path.glob("tokenizer.model*"))
        if models:
            return SentencePieceTokenizer(models[0], name or path.resolve().name)
    elif path.is_file():
        if path.suffix == ".json":
            return HFTokenizer(path, name, bos, eos)
        return SentencePieceTokenizer(path, name)
    raise ConfigError(
        f"--tokenizer {spec} is not a tokenizer; valid: byte, a tokenizer.json (or a directory holding one), "
        "or a SentencePiece model file (tokenizer.model)"
    )


def tokenizer_hash(files: Iterable[Path]) -> str:
    """sha256 over the tokenizer's files (by name and content): the index records it, export checks it."""
    digest = hashlib.sha256()
    for path in sorted(Path(f) for f in files):
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while block := f.read(1 << 20):  # a tokenizer.json is several MB: not all at once
                digest.update(block)
    return digest.hexdigest()


def _token_text(token: object) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(token, dict):
        return str(token.get("content")) if token.get("content") is not None else None
    return str(token) if token else None


def _require(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"reading {what} needs the {module} package: pip install 'lightning-ultrascale[data]'"
        ) from None
