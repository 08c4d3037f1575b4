"""The evaluation callback's parts that need no process: refusals, the tokenizer it picks, lm-eval's result keys."""

import re

import pytest

from lightning_ultrascale import UltraScaleDataModule
from lightning_ultrascale.data.tokenizer import ByteTokenizer
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.training.evaluation import LMEvaluation, _metrics, check_eval_layout, run_tokenizer


@pytest.mark.parametrize(
    ("pp", "cp", "message"),
    [(2, 1, r"pipeline parallelism \(pp=2\)"), (1, 4, r"context parallelism \(cp=4\)")],
)
def test_pipeline_and_context_parallelism_are_refused_naming_what_works(pp, cp, message):
    with pytest.raises(ConfigError, match=message + r".*valid: a layout of data, ZeRO, tensor and expert parallelism"):
        check_eval_layout(pp, cp)
    check_eval_layout(1, 1)


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
