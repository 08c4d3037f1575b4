"""Write ``docs/benchmarks.md`` from ``benchmarks/results/*.json``: ``python docs/benchmarks_page.py``.

Every measured table of the benchmarks, generated, never copied by hand: each result file becomes a section,
its scalar facts a list, and every list of records in it (at any depth) a table. ``--check`` exits 1 when
the committed page differs from what the JSON gives (``tests/e2e/test_docs.py`` runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
_MAX_ROWS = 40
_MAX_CELL = 60


def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, separators=(",", ":"))
    else:
        text = str(value)
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= _MAX_CELL else text[: _MAX_CELL - 1] + "…"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows[:_MAX_ROWS]:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    if len(rows) > _MAX_ROWS:
        lines.append(f"\n({len(rows) - _MAX_ROWS} more rows in the JSON)")
    return lines


def _section(value: Any, path: str, out: list[str], depth: int) -> None:
    """Scalars as a list, records as tables, nested objects as sub-sections."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out += ["", f"**{path}**" if path else "", "", *_table(value)]
        return
    if not isinstance(value, dict):
        out.append(f"- {path}: {_cell(value)}")
        return
    scalars = {k: v for k, v in value.items() if not isinstance(v, (dict, list)) or _is_small(v)}
    if scalars:
        out += ["", f"**{path}**"] if path else []
        out.append("")
        out += [f"- `{k}`: {_cell(v)}" for k, v in scalars.items()]
    for key, sub in value.items():
        if key in scalars:
            continue
        name = f"{path}.{key}" if path else key
        if depth >= 3:
            out.append(f"- `{name}`: {_cell(sub)}")
            continue
        if isinstance(sub, dict) and all(isinstance(v, dict) for v in sub.values()) and _flat(sub):
            out += ["", f"**{name}**", "", *_table([{"": k, **v} for k, v in sub.items()])]
        else:
            _section(sub, name, out, depth + 1)


def _is_small(value: Any) -> bool:
    return isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value) and len(value) <= 12


def _flat(mapping: dict[str, dict[str, Any]]) -> bool:
    return all(not isinstance(x, dict) for v in mapping.values() for x in v.values())


def render() -> str:
    out = [
        "# Benchmarks",
        "",
        "Every benchmark is a script under `benchmarks/` that prints its table and writes "
        "`benchmarks/results/<name>.json`; this page is generated from those files by "
        "`docs/benchmarks_page.py` (never edited by hand). The technique pages say what each figure means.",
    ]
    for path in sorted(RESULTS.glob("*.json")):
        out += ["", f"## {path.stem}", "", f"`benchmarks/results/{path.name}`, written by `benchmarks/{path.stem}.py`."]
        _section(json.loads(path.read_text()), "", out, 0)
    return "\n".join(out).replace("\n\n\n", "\n\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is not up to date")
    args = parser.parse_args()
    text = render()
    if args.check:
        sys.exit(0 if PAGE.exists() and PAGE.read_text() == text else 1)
    PAGE.write_text(text)


if __name__ == "__main__":
    main()
