"""The evaluation callback's parts that need no process: row scores, refusals, the tokenizer it picks, result keys."""

import re

import pytest
import torch

from lightning_ultrascale import UltraScaleDataModule
from lightning_ultrascale.data.tokenizer import ByteTokenizer
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.training.evaluation import LMEvaluation, _metrics, row_scores, run_tokenizer
from lightning_ultrascale.utils.loss import IGNORE_INDEX


def test_row_scores_of_sequence_chunks_reduce_to_the_whole_sequences():
    # Context parallelism scores each rank's chunks (zig-zag: 0 and 3 of 4 on one rank, 1 and 2 on the other)
    # and sums / maxes them: the whole sequences' scores, the greedy next token at the last target included.
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 8, 11), torch.full((3, 8), IGNORE_INDEX)
    labels[0, 2:5] = torch.tensor([4, 1, 7])
    labels[1, 7] = logits[1, 7].argmax()  # a target that is the greedy choice (and the row's last position)
    labels[1, 5] = logits[1, 5].argmax()
    positions = torch.arange(8).expand(3, -1)
    whole = row_scores(logits, labels, positions)
    chunks = [torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])]
    parts = [row_scores(logits[:, c], labels[:, c], positions[:, c]) for c in chunks]
    assert torch.allclose(parts[0][:, 0] + parts[1][:, 0], whole[:, 0], rtol=1e-12)
    assert torch.equal(torch.maximum(parts[0][:, 1:], parts[1][:, 1:]), whole[:, 1:])
    assert whole[0, 0] == torch.log_softmax(logits[0], -1)[[2, 3, 4], [4, 1, 7]].sum()
    assert whole[:, 1].tolist() == [1.0, 0.0, 0.0]  # row 2 has no target: nothing missed, no next token
    assert whole[0, 2] == 4 * 2**24 + logits[0, 4].argmax() and whole[2, 2] == -1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"tasks": []}, r"callbacks.eval.tasks is empty"), ({"tasks": ["x"], "every_n_steps": -1}, r"every_n_steps=-1")],
)
def test_bad_callback_settings_name_the_option(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LMEvaluation(**kwargs)


def test_the_bundled_corpus_is_read_back_with_the_byte_tokenizer():
    assert isinstance(run_tokenizer(UltraScaleDataModule(seq_len=64, micro_batch_size=2)), ByteTokenizer)


def test_lm_eval_results_become_task_metric_numbers_without_filters_or_stderr():
    results = {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": "N/A", "sample_len": 4, "ppl,none": 3}}
    assert _metrics(results) == {"t": {"acc": 0.5, "ppl": 3.0}}


def test_data_that_records_no_tokenizer_is_refused_rather_than_read_as_bytes():
    with pytest.raises(ConfigError, match=r"records none \(a NoneType.*LMEvaluation\(tokenizer=\.\.\.\)"):
        run_tokenizer(None)


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--tasks", ","], r"--tasks ',' names no task"), (["--tasks", "x"], r"CKPT=.*missing.ckpt does not exist")],
)
def test_ultrascale_eval_refuses_bad_input_in_one_line(tmp_path, capsys, args, message):
    from lightning_ultrascale.cli.evaluate import main

    with pytest.raises(SystemExit) as exit_:
        main([*args, str(tmp_path / "missing.ckpt")])
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err
