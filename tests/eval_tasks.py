"""Two lm-eval tasks on data shipped with the tests (no hub download): multiple choice and perplexity."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data" / "eval"
TASKS = ("tiny_choice", "tiny_perplexity")


def write_tasks(directory: Path) -> str:
    """The tasks' YAML files in ``directory`` (lm-eval's ``include_path``), reading the shipped jsonl files."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiny_choice.yaml").write_text(
        "task: tiny_choice\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {DATA / 'choice.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "target_delimiter: ' '\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (directory / "tiny_perplexity.yaml").write_text(
        "task: tiny_perplexity\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {DATA / 'text.jsonl'}\n"
        "test_split: test\n"
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    return str(directory)
