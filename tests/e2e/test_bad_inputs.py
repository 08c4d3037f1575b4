"""What a new user tried that ended in a traceback, after the process group, or in another error than
their own: each refused with one line naming the option, the value and what is valid, before any
process group (the command line exits with status 2, no traceback)."""

import dataclasses
import json
import os
import re

import lightning as L
import pytest
import torch
import torch.distributed as dist
from own_model import CONFIG, OwnModule, Transformer
from own_model import tp_plan as own_plan
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import AutoConfig

from lightning_ultrascale import TensorParallel, UltraScaleDataModule, UltraScaleStrategy
from lightning_ultrascale.cli import plan as plan_cli
from lightning_ultrascale.cli import train as train_cli
from lightning_ultrascale.errors import ConfigError, ContractError
from lightning_ultrascale.models.spec import find_model
from lightning_ultrascale.testing import WorkerError
from lightning_ultrascale.testing.commands import run_command
from lightning_ultrascale.testing.parity import record_run


@pytest.fixture(scope="module")
def foreign_directories(tmp_path_factory):
    """Configs of HF directories of families not trained as they are: one transformers knows, one it does not."""
    root = tmp_path_factory.mktemp("foreign")
    AutoConfig.for_model(
        "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=320, bos_token_id=0, eos_token_id=0
    ).save_pretrained(root / "gpt2")
    (root / "unknown").mkdir()
    (root / "unknown" / "config.json").write_text(json.dumps({"model_type": "my_own_lm", "hidden_size": 32}))
    return root


def _main(entry, *argv, env=None):
    """Run a command line's entry point in a process forked from this one (testing.commands: Hydra's
    logging set-up stays there); (exit status, stderr). Its stdout says whether a process group existed."""

    def main():
        try:
            entry.main()
        finally:
            print(f"process group: {dist.is_initialized()}")

    out = run_command(main, [entry.__name__, *argv], {**os.environ, **(env or {})})
    assert "process group: False" in out.stdout, out.stdout
    return out.returncode, out.stderr


@pytest.mark.parametrize(
    ("directory", "message"),
    [
        (
            "gpt2",
            r"^ultrascale-train: model_type='gpt2' is not among .*valid: llama, mistral, qwen2, qwen3, mixtral",
        ),
        ("unknown", r"^ultrascale-train: model.path=.*unknown holds model_type='my_own_lm', which transformers does"),
    ],
)
def test_an_hf_family_not_trained_as_it_is_exits_with_one_line(tmp_path, foreign_directories, directory, message):
    path = f"model.path={foreign_directories / directory}"
    code, err = _main(train_cli, "model=hf", path, env={"ULTRASCALE_RUN_DIR": str(tmp_path / "run")})
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and "Error executing job" not in err
    assert re.search(message, err), err
    assert "Convert it to our Llama" not in err  # (no converter reads GPT-2's blocks)


def test_the_planner_exits_with_one_line_on_a_model_it_cannot_take(foreign_directories):
    code, err = _main(plan_cli, "model=hf", f"model.path={foreign_directories / 'gpt2'}")
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.match(
        r"ultrascale-plan: model=hf model.path=.*gpt2 \(priced as our Llama\) holds a model_type='gpt2'", err
    )


def test_document_masks_with_an_hf_model_are_refused_with_a_valid_value(tmp_path, monkeypatch):
    from test_hf_cli import _build

    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    directory = tmp_path / "qwen2"
    AutoConfig.for_model("qwen2", hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(directory)
    with pytest.raises(ConfigError, match=r"data.documents=mask\) is not supported .*valid: data.documents=concat"):
        _build("model=hf", f"model.path={directory}", "data.documents=mask")
    assert not dist.is_initialized()


def test_no_validation_needs_no_validation_split():
    data = UltraScaleDataModule(seq_len=64, micro_batch_size=8, val_fraction=0.001)
    with pytest.raises(ConfigError, match=r"data.val_fraction=0.001 holds out .* fewer than one global batch"):
        data.check_fits(dp_size=2)
    data.trainer = L.Trainer(limit_val_batches=0, logger=False, enable_checkpointing=False)
    assert data.check_fits(dp_size=2)[1] < 16  # trains: the held-out sequences are never read


def test_a_model_without_a_spec_is_refused_saying_how_under_the_trainer_and_fabric():
    with pytest.raises(ContractError, match=r"LightningModule.configure_model \(Trainer\) or under fabric.init_modu"):
        find_model(nn.Sequential(nn.Linear(4, 4)))


# ----------------------------------------------------------------------------- attention a one-device user wrote
class FusedAttention(nn.Module):
    """nanoGPT's attention: one c_attn for q, k and v, split by the model's width."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_head = n_heads
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.attention_fn = torch.nn.functional.scaled_dot_product_attention

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (t.view(b, s, self.n_head, c // self.n_head).transpose(1, 2) for t in (q, k, v))
        return self.c_proj(self.attention_fn(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, c))


class WidthHeads(FusedAttention):
    """Separate projections, but heads of width ``C // n_head`` taken from the input's (whole) width."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__(dim, n_heads)
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        del self.c_attn

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, c = x.shape
        q, k, v = (p(x).view(b, s, self.n_head, c // self.n_head).transpose(1, 2) for p in (self.wq, self.wk, self.wv))
        return self.c_proj(self.attention_fn(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, c))


def _plan(names):
    def plan(sequence_parallel):
        top, blocks = own_plan(False)
        attention = {f"attention.{n}": ColwiseParallel() for n in names} | {"attention.c_proj": RowwiseParallel()}
        keep = {k: v for k, v in blocks["0"].items() if not k.startswith("attention")}
        return top, {name: keep | attention for name in blocks}

    return plan


class OneDeviceAttention(OwnModule):
    def __init__(self, attention: type) -> None:
        super().__init__()
        self.attention = attention

    def configure_model(self) -> None:
        if self.model is None:
            self.model = Transformer(CONFIG)
            for block in self.model.layers.values():
                block.attention = self.attention(CONFIG["dim"], CONFIG["n_heads"])
            names = ["c_attn"] if self.attention is FusedAttention else ["wq", "wk", "wv"]
            self.model.spec = dataclasses.replace(self.model.spec, tp_plan=_plan(names))


@pytest.mark.parametrize(
    ("attention", "raised"),
    [(FusedAttention, "ValueError: not enough values to unpack"), (WidthHeads, "RuntimeError: shape")],
)
def test_attention_written_for_one_device_is_told_what_tensor_parallelism_needs(attention, raised):
    with pytest.raises(WorkerError) as error:
        record_run(
            lambda: OneDeviceAttention(attention),
            lambda: UltraScaleDataModule(seq_len=32, micro_batch_size=4, seed=0),
            steps=1,
            strategy=lambda: UltraScaleStrategy(TensorParallel(2, sequence_parallel=False)),
            world_size=2,
        )
    message = str(error.value)
    assert f"layers.0.attention raised under TensorParallel(tp=2): {raised}" in message, message[-2000:]
    assert "split a fused q/k/v projection into three Linears" in message


def test_a_checkpoint_of_another_hf_architecture_is_refused_naming_what_differs(tmp_path):
    # It failed after the process group with DCP's "Size mismatch": HF modules recorded no model_config.
    from lightning_ultrascale.core.checkpoint import check_checkpoint_model
    from lightning_ultrascale.training.hf_module import HFCausalLMModule
    from lightning_ultrascale.training.module import LlamaModule

    for name, width in (("small", 32), ("large", 48)):
        config = AutoConfig.for_model("qwen2", hidden_size=width, num_hidden_layers=1, num_attention_heads=2)
        config.save_pretrained(tmp_path / name)
    saved = tmp_path / "step=1.ckpt"
    saved.mkdir()
    torch.save({"hyper_parameters": dict(HFCausalLMModule(tmp_path / "small").hparams)}, saved / "meta.pt")
    large = HFCausalLMModule(tmp_path / "large").hparams
    with pytest.raises(
        ConfigError, match=r"saved by model hf:.*small, and this run builds hf:.*large: hidden_size=32 \("
    ):
        check_checkpoint_model(saved, large)
    with pytest.raises(ConfigError, match=r"a Hugging Face model as it is \(model=hf\) vs our Llama"):
        check_checkpoint_model(saved, LlamaModule("llama_tiny").hparams)
    check_checkpoint_model(saved, HFCausalLMModule(tmp_path / "small").hparams)  # the same: resumes
