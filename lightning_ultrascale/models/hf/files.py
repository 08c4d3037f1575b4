"""What an HF model directory's safetensors files hold, by name (no tensor read): for the readers that must know
before they load (the weights' reader; the converter, which keeps a config's MTP layers only where files hold them).

Example:
    >>> import json, tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "a"}}))
    >>> file_keys(d)
    ['lm_head.weight']
"""

from __future__ import annotations

import json
from pathlib import Path

from lightning_ultrascale.errors import ConfigError

__all__ = ["file_keys"]


def file_keys(path: str | Path) -> list[str]:
    """The tensor names of an HF directory's safetensors files (from the index where there is one)."""
    where = Path(path)
    index = where / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    files = sorted(where.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.path={path} holds no *.safetensors files; valid: a directory save_pretrained wrote")
    from safetensors import safe_open

    keys: list[str] = []
    for file in files:
        with safe_open(str(file), "pt") as handle:
            keys.extend(handle.keys())
    return sorted(keys)
