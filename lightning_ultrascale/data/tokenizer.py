"""A byte-level tokenizer: nothing to download, every text encodes, every id decodes.

Ids 0..255 are the UTF-8 bytes themselves, then two specials. A byte vocabulary makes sequences
about 4x longer than a BPE one, which is the right trade for a library whose default job must run
offline on a laptop; a real run brings its own tokenized ``.bin`` file (:mod:`.prepare`).
"""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus ``bos_id=256`` and ``eos_id=257``.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hé")
        [256, 104, 195, 169, 257]
        >>> tok.decode(tok.encode("hé"))
        'hé'
    """

    bos_id: int = 256
    eos_id: int = 257
    vocab_size: int = 258

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        """The UTF-8 bytes of ``text``, framed by ``bos_id``/``eos_id`` when asked."""
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Text from ids; specials are dropped, invalid UTF-8 becomes U+FFFD (a model may emit any byte)."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
