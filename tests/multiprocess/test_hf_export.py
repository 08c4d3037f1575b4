"""A checkpoint of any layout exports to a Hugging Face directory that transformers loads, and imports back."""

from dataclasses import replace

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from llama_runs import ADAMW, DEEPSEEK_V3_TINY, MIXTRAL_TINY, QWEN3_MOE_TINY, SGD

from lightning_ultrascale import (
    ExpertParallel,
    LlamaModule,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.cli.export import export
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import LlamaConfig, get_model_config
from lightning_ultrascale.models.hf.convert import hf_architecture
from lightning_ultrascale.models.llama import Llama
from lightning_ultrascale.testing import run_pooled, run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER, record_run


def _train_and_save(path: str) -> None:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(stage=3)), max_steps=3, **QUIET_TRAINER
    )
    trainer.fit(LlamaModule("llama_tiny", optim=ADAMW), datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=4))
    trainer.save_checkpoint(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    run_pooled(_train_and_save, 2, str(root / "ckpt"))
    run_pooled(export, 2, str(root / "ckpt"), str(root / "hf"))  # each process exports half of the tensors
    return root


def _trained_model(checkpoint, cfg: LlamaConfig | None = None) -> Llama:
    model = Llama(cfg or get_model_config("llama_tiny"))
    state = {f"state_dict.model.{n}": t for n, t in model.state_dict().items()}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return model


def test_transformers_loads_the_export_with_our_logits(exported):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(exported / "hf", local_files_only=True).eval()
    ours = _trained_model(exported / "ckpt").eval()
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours(tokens), hf(tokens).logits
    assert (got - want).norm() / want.norm() < 1e-5
    assert (exported / "hf" / "model.safetensors.index.json").is_file()


def test_the_export_imports_back_into_a_tp2_run_with_the_same_first_loss(exported):
    def module():
        return LlamaModule("llama_tiny", optim=SGD, init_from=f"hf:{exported / 'hf'}")

    def data():
        return UltraScaleDataModule(seq_len=64, micro_batch_size=8, seed=0)

    one = record_run(module, data, steps=1)
    tp2 = record_run(module, data, steps=1, strategy=lambda: UltraScaleStrategy(TensorParallel(2)), world_size=2)
    assert abs(tp2.losses[0] - one.losses[0]) / one.losses[0] < 1e-5
    # The imported weights are the trained ones, not a fresh initialisation.
    fresh = record_run(lambda: LlamaModule("llama_tiny", optim=SGD), data, steps=1)
    assert abs(fresh.losses[0] - one.losses[0]) > 1e-3


def test_an_hf_directory_of_another_architecture_is_refused(exported):
    with pytest.raises(ConfigError, match=r"model.init_from=hf:.* is another architecture: dim=64 \(model llama3_1b"):
        from lightning_ultrascale.models.hf.convert import load_hf_weights

        with torch.device("meta"):
            load_hf_weights(Llama(get_model_config("llama3_1b")), exported / "hf")
    # And where the run is described, before any process group: the module refuses it, naming model=hf.
    with pytest.raises(ConfigError, match=r"init_from=hf:.* another architecture than model=llama3_1b: dim=64 .*=hf"):
        LlamaModule("llama3_1b", init_from=f"hf:{exported / 'hf'}")
    assert not torch.distributed.is_initialized()


# ------------------------------------------------------------------ mixture of experts (Mixtral, DeepSeek-V3, Qwen3)
def _train_moe_and_save(cfg, path: str) -> None:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=UltraScaleStrategy(ZeRO(stage=3), ExpertParallel(2)),  # each rank holds 4 of the 8 experts
        max_steps=3,
        **QUIET_TRAINER,
    )
    trainer.fit(LlamaModule(cfg, optim=ADAMW), datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=4))
    trainer.save_checkpoint(path)


# Qwen3-MoE without its z-loss (transformers' has none to export; the config round trip would lose it).
QWEN3_MOE = replace(QWEN3_MOE_TINY, moe=replace(QWEN3_MOE_TINY.moe, z_loss_coeff=0.0))


@pytest.fixture(
    scope="module", params=[DEEPSEEK_V3_TINY, MIXTRAL_TINY, QWEN3_MOE], ids=["deepseek_v3", "mixtral", "qwen3_moe"]
)
def exported_moe(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param.name)
    run_pooled(_train_moe_and_save, 2, request.param, str(root / "ckpt"))
    run_pooled(export, 2, str(root / "ckpt"), str(root / "hf"))
    return request.param, root


def test_transformers_loads_an_expert_parallel_moe_export_with_our_logits(exported_moe):
    from transformers import AutoModelForCausalLM

    cfg, root = exported_moe
    hf = AutoModelForCausalLM.from_pretrained(root / "hf", local_files_only=True).eval()
    assert type(hf).__name__ == hf_architecture(cfg)[1]
    ours = _trained_model(root / "ckpt", cfg).eval()
    biases = [b for n, b in ours.named_buffers() if n.endswith("router.expert_bias")]
    # DeepSeek-V3's aux-loss-free bias moved in training and travels as e_score_correction_bias.
    assert all(b.abs().max() > 0 for b in biases) == (cfg.moe.bias_update_rate > 0)
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours(tokens), hf(tokens).logits
    assert (got - want).norm() / want.norm() < 1e-5


def test_a_moe_export_imports_into_ep2_with_the_one_process_first_loss(exported_moe):
    cfg, root = exported_moe

    def module():
        return LlamaModule(cfg, optim=SGD, init_from=f"hf:{root / 'hf'}")

    def data(micro_batch_size: int = 8):
        return UltraScaleDataModule(seq_len=64, micro_batch_size=micro_batch_size, seed=0)

    one = record_run(module, data, steps=1)
    # Each rank reads only its 4 experts' tensors of the file, straight into its shard. ep borrows
    # the data-parallel ranks: 4 sequences each, the same global batch of 8.
    ep2 = record_run(
        module, lambda: data(4), steps=1, strategy=lambda: UltraScaleStrategy(ExpertParallel(2)), world_size=2
    )
    assert abs(ep2.losses[0] - one.losses[0]) / one.losses[0] < 1e-5
    if cfg.moe.router == "sigmoid":  # and with experts FSDP-sharded too: 2 of a rank's 4 experts per rank
        zero3 = record_run(
            module,
            lambda: data(2),
            steps=1,
            strategy=lambda: UltraScaleStrategy(ZeRO(stage=3), ExpertParallel(2)),
            world_size=4,
        )
        assert abs(zero3.losses[0] - one.losses[0]) / one.losses[0] < 1e-5
    trained = _trained_model(root / "ckpt", cfg)
    for name, bias in trained.named_buffers():
        if name.endswith("expert_bias"):  # the import's bias, one SGD step later: moved by at most γ
            moved = one.buffers[f"model.{name}"] - bias
            assert (moved.abs() <= cfg.moe.bias_update_rate * (1 + 1e-5)).all()
    fresh = record_run(lambda: LlamaModule(cfg, optim=SGD), data, steps=1)
    assert abs(fresh.losses[0] - one.losses[0]) > 1e-3


def _greedy(model: Llama, prompt: list[int], new: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_the_export_carries_the_runs_tokenizer_and_transformers_generates_our_greedy_tokens(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The run trained on the bundled corpus: byte ids, bos 256 before every document.
    tokenizer = AutoTokenizer.from_pretrained(exported / "hf", local_files_only=True)
    prompt = tokenizer("Help on module", return_tensors="pt").input_ids
    assert prompt[0].tolist() == [256, *b"Help on module"]
    hf = AutoModelForCausalLM.from_pretrained(exported / "hf", local_files_only=True).eval()
    generated = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    new = generated[0, prompt.shape[1] :].tolist()
    assert new == _greedy(_trained_model(exported / "ckpt").eval(), prompt[0].tolist(), 8)
    assert tokenizer.decode(new, skip_special_tokens=True) == bytes(i for i in new if i < 256).decode(errors="replace")


def _lm_eval_scores(root: str, include_path: str) -> list[tuple[str, dict[str, float], dict[str, float]]]:
    """Each local task scored by lm-eval's own ``hf`` model on the export and by LayoutLM on the checkpoint;
    then by LayoutLM and by ``ultrascale-eval`` on the checkpoint."""
    import json
    from pathlib import Path

    import lm_eval
    from eval_tasks import TASKS
    from lm_eval.models.huggingface import HFLM

    from lightning_ultrascale.cli.evaluate import main
    from lightning_ultrascale.data.tokenizer import ByteTokenizer
    from lightning_ultrascale.training.evaluation import LayoutLM, _metrics, task_manager

    tasks = task_manager(list(TASKS), include_path)

    def scores(lm, task: str) -> dict[str, float]:
        out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tasks, bootstrap_iters=0)
        return _metrics(out["results"])[task]

    ours = LayoutLM(_trained_model(f"{root}/ckpt").eval(), ByteTokenizer(), batch_size=4)
    # The run's documents start with bos. lm-eval's hf model puts it before a multiple-choice context with
    # add_bos_token=True; for a rolling (perplexity) task that would encode a second bos after its bos prefix
    # and score it, so there add_bos_token=False gives the one bos the model was trained with.
    rows = []
    for task, bos in zip(TASKS, (True, False)):
        theirs = HFLM(pretrained=f"{root}/hf", add_bos_token=bos, device="cpu", batch_size=4, dtype="float32")
        rows.append((task, scores(theirs, task), scores(ours, task)))
    # ultrascale-eval on the checkpoint: the same scores as LayoutLM on its weights
    main(["--tasks", ",".join(TASKS), "--include-path", include_path, "--batch-size", "4", "--out", f"{root}/eval.json",
          f"{root}/ckpt"])  # fmt: skip
    command = json.loads(Path(f"{root}/eval.json").read_text())["results"]
    rows += [(f"ultrascale-eval {task}", mine, command[task]) for task, _, mine in rows]
    return rows


def test_lm_evals_own_hf_model_on_the_export_scores_tasks_as_layoutlm_does(exported, tmp_path):
    # The same trained weights, twice: lm-eval's `hf` model on the exported directory (transformers' Llama,
    # the exported tokenizer), and LayoutLM on our model read from the checkpoint (the run's byte tokenizer).
    # In a fresh fork: lm-eval's pyarrow starts an allocator thread no later fork may inherit.
    from eval_tasks import write_tasks

    rows = run_workers(_lm_eval_scores, 1, str(exported), write_tasks(tmp_path / "tasks"), timeout_s=300)[0]
    for task, expected, got in rows:
        assert expected.keys() == got.keys()
        for name, value in expected.items():
            assert abs(got[name] - value) <= 1e-4 * abs(value), (task, name, got[name], value)
