"""The documentation: a short README whose links resolve, a site that builds strictly, examples that match the code."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ultrascale.testing.commands import run_command

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The heading anchors of a Markdown page, as MkDocs and GitHub write them (for our headings)."""
    text, anchors, fence = page.read_text(), set(), False
    for line in text.splitlines():
        fence ^= line.startswith("```")
        if not fence and (m := re.match(r"#+ (.*)", line)):
            title = re.sub(r"[`*]", "", m.group(1).strip().lower())
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not inside code blocks
    return [t for t in _LINK.findall(text) if not t.startswith(("http://", "https://", "mailto:"))]


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_quick_start_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in (ROOT / "README.md").read_text()


def test_the_readme_python_example_names_what_the_package_exports():
    import lightning_ultrascale

    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    compile(block, "README.md", "exec")
    names = re.search(r"from lightning_ultrascale import \((.*?)\)", block, re.S).group(1)
    for name in (n.strip() for n in names.split(",") if n.strip()):
        assert hasattr(lightning_ultrascale, name), name


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert not {p for p in pages if f": {p}" not in nav}


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]'), which .[dev] includes")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "plugins" / "index.html").exists()


def test_every_picture_is_drawn_by_the_script_and_shown_on_a_page(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra, which .[dev] includes")
    # every picture but the planner's heatmap (a search of 70B on 512 GPUs: a minute) and the straggler report
    # (a 4-process run: 10 s), which the script draws too
    cheap = "pipeline,zero_memory,cp_assignment,ring_steps,tp_block,fp8_loss,muon_loss"
    # Forked (testing.commands), not a fresh interpreter: the package is imported already; matplotlib stays there.
    script = str(ROOT / "docs" / "pictures.py")
    argv = [script, "--only", cheap, "--out", str(tmp_path)]
    run = run_command(lambda: runpy.run_path(script, run_name="__main__"), argv, dict(os.environ), timeout_s=300)
    assert run.returncode == 0, run.stderr[-3000:]
    drawn = {str(Path(line).relative_to(tmp_path)) for line in run.stdout.split()}
    committed = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.png")}
    expensive = {"pictures/planner_heatmap.png", "pictures/stragglers.png"}
    assert drawn | expensive == committed  # nothing drawn by hand, nothing stale
    shown = " ".join(p.read_text() for p in PAGES)
    assert all(f"{name})" in shown for name in committed), committed


def test_the_benchmarks_page_is_generated_from_the_committed_results():
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "benchmarks_page.py"), "--check"], timeout=120)
    assert run.returncode == 0, "docs/benchmarks.md is stale: run python docs/benchmarks_page.py"


def test_the_module_map_is_generated_from_the_docstrings():
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "modules_page.py"), "--check"], timeout=120)
    assert run.returncode == 0, "docs/architecture.md's module map is stale: run python docs/modules_page.py"
