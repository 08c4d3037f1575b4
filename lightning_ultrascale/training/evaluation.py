"""lm-evaluation-harness tasks on the model as it is laid out for training.

:class:`LayoutLM` is an ``lm_eval`` model (``lm_eval.api.model.LM``) over a LightningModule whose
``forward(input_ids)`` gives logits, in the layout it trains in: one process, data parallelism,
ZeRO 1-3, tensor parallelism (with SP and the vocabulary-parallel loss), pipeline parallelism (every
schedule), context parallelism (every method), expert parallelism, and their compositions. The harness
splits the documents over the **data ranks** (``rank`` and ``world_size`` are the data-parallel
coordinates: tensor-, pipeline- and context-parallel peers take the same documents and compute together)
and gathers the metrics on data rank 0. Every data rank runs the same number of forwards (the harness
pads the requests; a rolling window count is agreed on, the missing forwards run on one token): ZeRO-3's
gathers, expert parallelism's all-to-alls and a pipeline's sends need every rank in each forward.

Each forward goes through the strategy's step runner, as a validation step does: context parallelism
keeps this rank's chunks of the sequences, a pipeline runs a schedule's ``eval`` over its stages (every
forward in one shape, ``batch_size`` rows of ``max_length`` tokens: a schedule's buffers are sized by its
first batch, so the evaluation gets a schedule of its own, built at its first forward). The scores
(:func:`row_scores`: the targets' log-probabilities, whether each is the greedy token, the greedy next
token) are made where the logits are, on the last stage and per sequence chunk, and only they travel:
summed over the chunks, broadcast from the last stage. The full logits never leave their rank, except a
vocabulary-parallel head's, which are gathered over ``tp`` first.

``lm_eval`` is imported when :class:`LayoutLM` is first named, not with this module: importing it starts
pyarrow's allocator thread, which a process must not carry into a fork (the tests fork their ranks).

Example:
    >>> callback = LMEvaluation(["hellaswag"], every_n_steps=500, limit=200)  # L.Trainer(callbacks=[callback])
    >>> callback.every_n_steps, callback.limit
    (500, 200)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.parallel.step import StepRunner
from lightning_ultrascale.utils.loss import IGNORE_INDEX

#: and LayoutLM, made on first use (module __getattr__)
__all__ = ["LMEvaluation", "row_scores", "run_tokenizer", "task_manager"]


def __getattr__(name: str) -> Any:
    """``LayoutLM``, made on first use (:func:`_layout_lm`)."""
    if name != "LayoutLM":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _layout_lm()


def _layout_lm() -> type:
    """The ``LayoutLM`` class, an ``lm_eval.api.model.LM``, made once (lm-eval imported then: see the module doc)."""
    made = globals().get("LayoutLM")
    if made is not None:
        return made
    try:
        from lm_eval.api.model import LM
    except ImportError:
        raise ConfigError("lm-eval tasks need the lm-eval package: pip install 'lightning-ultrascale[eval]'") from None
    cls = type("LayoutLM", (_LayoutLMMethods, LM), {"__doc__": _LayoutLMMethods.__doc__, "__module__": __name__})
    globals()["LayoutLM"] = cls
    return cls


class _LayoutLMMethods:
    """An ``lm_eval`` model over ``module`` in its training layout (see the module docstring).

    Args:
        module: a LightningModule (or ``nn.Module``) whose ``forward(input_ids)`` returns logits
            ``[batch, seq, vocab]`` (a DTensor under the vocabulary-parallel loss is gathered).
        tokenizer: the run's tokenizer (``encode_text(str) -> ids``, ``decode(ids) -> str``, ``bos_id``,
            ``eos_id``): the data's, so the model reads text as it was trained to.
        batch_size: sequences per forward.
        max_length: the longest sequence a forward sees (default: the model's ``max_seq_len``).
        data_rank, data_ranks, group: this rank's data-parallel coordinate, their number and their
            process group (``None``: one process).
        pad_multiple: forwards are right-padded to a multiple of it (the sequence's split over the
            context- and tensor-parallel ranks).
        runner: the strategy's step runner (``UltraScaleStrategy.step``): it runs each forward in the layout
            (context parallelism's chunks, a pipeline's schedule in the steps' shape); ``None``: ``module(ids)``.
        sequence_group: the context-parallel group whose ranks score chunks of the same sequences.
    """

    def __init__(
        self,
        module: nn.Module,
        tokenizer: Any,
        batch_size: int = 8,
        max_length: int | None = None,
        data_rank: int = 0,
        data_ranks: int = 1,
        group: Any = None,
        pad_multiple: int = 1,
        runner: StepRunner | None = None,
        sequence_group: Any = None,
    ) -> None:
        super().__init__()
        self.module, self.tokenizer, self.batch_size = module, tokenizer, batch_size
        self._rank, self._world_size, self.group = data_rank, data_ranks, group
        self.pad_multiple, self.runner, self.sequence_group = pad_multiple, runner, sequence_group
        longest = max_length or int(getattr(module, "max_seq_len", 0) or 2048)
        self.max_length = longest // pad_multiple * pad_multiple
        # A pipeline's forwards have one shape (each shape builds a schedule): batch_size rows (a multiple of its
        # microbatches) of max_length tokens.
        fixed, multiple = (runner.score_fixed, runner.score_rows) if runner is not None else (False, 1)
        self.rows = -(-batch_size // multiple) * multiple if fixed else 0
        self.width = self.max_length if fixed else 0
        self._device = next(iter(module.parameters())).device

    # ---- the harness's distribution primitives, over the data ranks
    def all_gather(self, tensor: Tensor) -> Tensor:
        if self.group is None:
            return tensor
        out = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)
        return torch.stack(out) if tensor.dim() == 0 else torch.cat(out)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self._world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out if self._rank == dst else None

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    # ---- requests
    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        return self.loglikelihood_tokens([self._encode_pair(*r.args) for r in requests])

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of ``context`` (after bos) and ``continuation``, as lm-eval's ``hf`` model splits them: the
        whole text encoded, cut where the context's own encoding ends (trailing spaces go with the continuation)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer.encode_text(context + continuation)
        cut = len(self.tokenizer.encode_text(context))
        return [self.tokenizer.bos_id, *whole[:cut]], whole[cut:]

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        """The whole text's log-likelihood, in windows of ``max_length`` tokens (each predicting its own)."""
        windows, owners = [], []
        for i, request in enumerate(requests):
            tokens = [self.tokenizer.bos_id, *self.tokenizer.encode_text(request.args[0])]
            step = self.max_length
            for start in range(1, len(tokens), step):
                context = tokens[max(0, start - 1) : start]  # the token before the window (bos first)
                windows.append((context, tokens[start : start + step]))
                owners.append(i)
        scores = self.loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        """Greedy decoding until a stop string or ``max_gen_toks`` tokens, one sequence per forward.

        Every request runs its full ``max_gen_toks`` forwards (the tokens after a stop are dropped) and the
        ranks agree on the most forwards beforehand: a rank that stopped early must not leave a collective.
        """
        out = []
        budget = [int(r.args[1].get("max_gen_toks", 32)) for r in requests]
        extra = self._agreed(sum(budget)) - sum(budget)
        for request, limit in zip(requests, budget):
            context, settings = request.args
            stops = [s for s in settings.get("until", []) if s]
            ids = [self.tokenizer.bos_id, *self.tokenizer.encode_text(context)]
            new: list[int] = []
            done = False
            for _ in range(limit):
                # (a stand-in target on the last position: its score carries the greedy next token)
                token = self._score([((ids + new)[-self.max_length :], [0])])[0][2]
                if not done:
                    done = token == self.tokenizer.eos_id
                    new += [] if done else [token]
                    done = done or any(s in self.tokenizer.decode(new) for s in stops)
            text = self.tokenizer.decode(new)
            for s in stops:
                text = text.split(s)[0]
            out.append(text)
        for _ in range(extra):
            self._score([([self.tokenizer.bos_id], [])])
        return out

    def loglikelihood_tokens(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), whether greedy decoding gives the continuation)`` per pair.

        The data ranks agree on the most forwards first (rolling windows vary per rank); the missing ones
        run on one token.
        """
        results: list[tuple[float, bool]] = []
        batches = [pairs[i : i + self.batch_size] for i in range(0, len(pairs), self.batch_size)]
        extra = self._agreed(len(batches)) - len(batches)
        for batch in batches:
            rows = []
            for context, continuation in batch:
                seq = (context + continuation)[-(self.max_length + 1) :]
                rows.append((seq[:-1], seq[-len(continuation) :]))
            results += [(logprob, greedy) for logprob, greedy, _ in self._score(rows)]
        for _ in range(extra):
            self._score([([self.tokenizer.bos_id], [])])
        return results

    def _agreed(self, batches: int) -> int:
        if self.group is None:
            return batches
        count = torch.tensor([batches], device=self._device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        return int(count)

    def _score(self, rows: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool, int]]:
        """Per ``(inputs, targets)`` row, ``targets`` being the tokens its last positions should predict: the sum of
        their log-probabilities, whether each is the greedy choice, and the greedy token after the last target.

        One forward of the rows right-padded (causal: padding after a sequence changes none of its positions)
        to the layout's shape; the scores are made where the logits are (:func:`row_scores`) and only they travel.
        """
        width = self.width or -(-max(len(i) for i, _ in rows) // self.pad_multiple) * self.pad_multiple
        n = max(len(rows), self.rows)
        ids = torch.zeros(n, width, dtype=torch.long)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
        for i, (inputs, targets) in enumerate(rows):
            ids[i, : len(inputs)] = torch.tensor(inputs)
            labels[i, len(inputs) - len(targets) : len(inputs)] = torch.tensor(targets, dtype=torch.long)
        positions = torch.arange(width).expand(n, -1)
        batch = {"input_ids": ids, "labels": labels, "position_ids": positions}
        batch = {k: v.to(self._device) for k, v in batch.items()}
        was_training = self.module.training
        self.module.eval()
        try:
            if self.runner is None:
                scores = row_scores(self.module(batch["input_ids"]), batch["labels"], batch["position_ids"])
            else:
                scores = self.runner.score(self.module, batch, row_scores)
        finally:
            self.module.train(was_training)
        if self.sequence_group is not None:  # each rank scored its chunks of the sequences
            total, rest = scores[:, 0].contiguous(), scores[:, 1:].contiguous()
            dist.all_reduce(total, group=self.sequence_group)
            dist.all_reduce(rest, op=dist.ReduceOp.MAX, group=self.sequence_group)
            scores = torch.cat([total[:, None], rest], dim=1)
        return [(float(s[0]), not bool(s[1]), int(s[2]) % _KEY) for s in scores[: len(rows)].tolist()]


#: A row's greedy token after its last target travels as ``position * _KEY + token``: the largest position wins.
_KEY = 2**24


@torch.no_grad()
def row_scores(logits: Tensor, labels: Tensor, positions: Tensor) -> Tensor:
    """Per row of ``logits [rows, seq, vocab]`` (a DTensor is gathered): the sum of the labelled tokens'
    log-probabilities, whether any labelled token is not the greedy choice (0/1), and ``position * 2^24 + greedy
    token`` at the row's last labelled position (-1: none). ``[rows, 3]`` in float64 (exact to 2^53).

    Each part reduces over sequence chunks (sum, max, max): context parallelism scores its chunks apart.
    """
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    logprobs = F.log_softmax(logits.float(), dim=-1)
    scored = labels != IGNORE_INDEX
    picked = logprobs.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    greedy = logprobs.argmax(-1)
    total = torch.where(scored, picked, 0.0).sum(1, dtype=torch.float64)
    miss = ((greedy != labels) & scored).any(1)
    last, where = torch.where(scored, positions, -1).max(1)
    key = torch.where(last >= 0, last * _KEY + greedy.gather(1, where[:, None])[:, 0], -1)
    return torch.stack([total, miss.to(torch.float64), key.to(torch.float64)], dim=1)


def run_tokenizer(datamodule: Any) -> Any:
    """The tokenizer the run's data was made with (``tokenizer_record``): the bytes of the bundled corpus, or the
    files ``ultrascale-tokenize`` copied beside the token file."""
    from lightning_ultrascale.data.tokenizer import ByteTokenizer, load_tokenizer

    record = datamodule.tokenizer_record() if hasattr(datamodule, "tokenizer_record") else None
    if record is None:
        raise ConfigError(
            "callbacks.eval needs the tokenizer the data was made with, and this run's data records none (a "
            f"{type(datamodule).__name__}; UltraScaleDataModule's token files record theirs): give LMEvaluation("
            "tokenizer=...), e.g. lightning_ultrascale.data.tokenizer.load_tokenizer(PATH)"
        )
    if record["name"] == "byte":
        return ByteTokenizer()
    if record["files"] is None:
        raise ConfigError(
            f"callbacks.eval: the data was tokenized with {record['name']!r}, whose files are not beside the token "
            "file (ultrascale-tokenize copies them there): re-tokenize, or keep the tokenizer directory with the data"
        )
    return load_tokenizer(record["files"], record["name"])


class LMEvaluation(L.Callback):
    """Run lm-eval ``tasks`` every ``every_n_steps`` optimizer steps and at the end of training, in the run's layout.

    Metrics are logged as ``eval/<task>/<metric>`` (every rank logs the same values) and written, with
    the step, to ``<default_root_dir>/eval/step_<N>.json`` by rank 0 (``ultrascale-train``: the run directory).

    Args:
        tasks: lm-eval task names (``include_path`` adds a folder of task YAML files: tasks of one's own).
        every_n_steps: 0: only at the end.
        limit: documents per task (None: all).
        batch_size: sequences per forward.
        tokenizer: the text's tokenizer (default: the one the datamodule's ``tokenizer_record`` names; a
            datamodule without one is refused rather than guessed).
    """

    def __init__(
        self,
        tasks: Sequence[str],
        every_n_steps: int = 0,
        limit: int | None = None,
        include_path: str | None = None,
        batch_size: int = 8,
        tokenizer: Any = None,
    ) -> None:
        if not tasks:
            raise ConfigError("callbacks.eval.tasks is empty; valid: lm-eval task names, e.g. [hellaswag, arc_easy]")
        if every_n_steps < 0:
            raise ConfigError(f"callbacks.eval.every_n_steps={every_n_steps} must be >= 0 (0: at the end only)")
        self.tasks, self.every_n_steps, self.limit = list(tasks), every_n_steps, limit
        self.include_path, self.batch_size, self.tokenizer = include_path, batch_size, tokenizer
        #: step -> {task: {metric: value}} of every evaluation so far
        self.results: dict[int, dict[str, dict[str, float]]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0 and not trainer.fit_loop._should_accumulate():
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step not in self.results:
            self.evaluate(trainer, pl_module)

    def _model(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        """The :class:`LayoutLM` over ``pl_module`` in ``trainer``'s layout: requests over the data ranks, forwards
        through the strategy's step runner, sequences padded to a multiple of the ``cp x tp`` split."""
        tokenizer = self.tokenizer or run_tokenizer(trainer.datamodule)
        mesh, dims = getattr(trainer.strategy, "mesh", None), getattr(trainer.strategy, "parallel_dims", None)
        if mesh is None or dims is None or trainer.world_size == 1:
            return _layout_lm()(pl_module, tokenizer, self.batch_size)
        kwargs = trainer.strategy.distributed_sampler_kwargs
        return _layout_lm()(
            pl_module, tokenizer, self.batch_size, data_rank=kwargs["rank"], data_ranks=kwargs["num_replicas"],
            group=mesh["dp"].get_group(), pad_multiple=2 * dims.cp * dims.tp, runner=trainer.strategy.step,
            sequence_group=mesh["cp"].get_group() if dims.cp > 1 else None,
        )  # fmt: skip

    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, dict[str, float]]:
        import lm_eval

        getattr(trainer.strategy, "wait_for_parameters", lambda: None)()  # ZeRO-1/2's gathers in flight
        lm = self._model(trainer, pl_module)
        tasks = task_manager(self.tasks, self.include_path)
        if lm.group is not None:
            # The tasks' data go through the datasets cache, which every rank of a node shares: rank 0 fills it
            # first, the others then read it (ranks writing one cache entry at once race).
            if trainer.is_global_zero:
                lm_eval.tasks.get_task_dict(self.tasks, tasks)
            trainer.strategy.barrier()
        out = lm_eval.simple_evaluate(
            model=lm, tasks=self.tasks, limit=self.limit, task_manager=tasks,
            bootstrap_iters=0, log_samples=False, verbosity="WARNING",
            # lm-eval seeds Python, numpy and torch by default: the run's own random streams must go on as they were
            random_seed=None, numpy_random_seed=None, torch_random_seed=None,
        )  # fmt: skip
        metrics = _metrics(out["results"]) if out is not None else None
        if lm.group is not None:  # global rank 0 has them (lm-eval returns them where LOCAL_RANK is 0 too): to all
            holder = [metrics if trainer.is_global_zero else None]
            dist.broadcast_object_list(holder, src=0)
            metrics = holder[0]
        assert metrics is not None
        self.results[trainer.global_step] = metrics
        flat = {f"eval/{task}/{name}": value for task, values in metrics.items() for name, value in values.items()}
        for logger in trainer.loggers:
            logger.log_metrics(flat, step=trainer.global_step)
        if trainer.is_global_zero:
            folder = Path(trainer.default_root_dir) / "eval"
            folder.mkdir(parents=True, exist_ok=True)
            payload = {"step": trainer.global_step, "tasks": self.tasks, "results": metrics}
            (folder / f"step_{trainer.global_step}.json").write_text(json.dumps(payload, indent=1))
        return metrics


def task_manager(tasks: Sequence[str], include_path: str | None) -> Any:
    """lm-eval's ``TaskManager`` for ``tasks``: the ``include_path`` folder alone when it holds them all (indexing
    lm-eval's own ~15,000 task files takes seconds in every process), else with lm-eval's tasks too."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(own.all_tasks):
            return own
    return TaskManager(include_path=include_path)


def _metrics(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """lm-eval's results as ``{task: {metric: value}}`` (its ``"acc,none"`` keys without the filter; numbers only)."""
    out: dict[str, dict[str, float]] = {}
    for task, values in results.items():
        out[task] = {
            key.split(",")[0]: float(v)
            for key, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and "stderr" not in key and key != "sample_len"
        }
    return out
