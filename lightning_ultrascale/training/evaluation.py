"""lm-evaluation-harness tasks on the model as it is laid out for training.

:class:`LayoutLM` is an ``lm_eval`` model (``lm_eval.api.model.LM``) over a LightningModule whose
``forward(input_ids)`` gives logits, in the layout it trains in: one process, data parallelism,
ZeRO 1-3, tensor parallelism (with SP and the vocabulary-parallel loss), expert parallelism. The
harness splits the documents over the **data ranks** (``rank`` and ``world_size`` are the data-parallel
coordinates: tensor-parallel peers take the same documents and compute together) and gathers the
metrics on data rank 0. Every data rank runs the same number of forwards (the harness pads the
requests; a rolling window count is agreed on, the missing forwards run on one token): ZeRO-3's
gathers and expert parallelism's all-to-alls need every rank in each forward.

Pipeline and context parallelism hold a part of every forward (stages, sequence chunks): evaluating
under them is refused by name (evaluate a checkpoint in another layout: any layout loads it).

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

__all__ = ["LMEvaluation", "check_eval_layout", "run_tokenizer"]  # and LayoutLM, made on first use (__getattr__)


def check_eval_layout(pp: int, cp: int, option: str = "callbacks.eval") -> None:
    """Refuse evaluation under pipeline or context parallelism, naming the option and what works."""
    if pp > 1 or cp > 1:
        what = f"pipeline parallelism (pp={pp})" if pp > 1 else f"context parallelism (cp={cp})"
        raise ConfigError(
            f"{option}: lm-eval tasks do not run under {what}, whose ranks each hold a part of every forward; "
            "valid: a layout of data, ZeRO, tensor and expert parallelism, or evaluate a saved checkpoint in one "
            "(ultrascale-eval CHECKPOINT --tasks ..., any layout loads any checkpoint)"
        )


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
        pad_multiple: forwards are right-padded to a multiple of it (sequence parallelism splits the
            sequence over the tensor-parallel ranks: give ``tp``).
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
    ) -> None:
        super().__init__()
        self.module, self.tokenizer, self.batch_size = module, tokenizer, batch_size
        self.max_length = max_length or int(getattr(module, "max_seq_len", 0) or 2048)
        self._rank, self._world_size, self.group = data_rank, data_ranks, group
        self.pad_multiple = pad_multiple
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
                token = int(self._logits([(ids + new)[-self.max_length :]])[0, -1].argmax())
                if not done:
                    done = token == self.tokenizer.eos_id
                    new += [] if done else [token]
                    done = done or any(s in self.tokenizer.decode(new) for s in stops)
            text = self.tokenizer.decode(new)
            for s in stops:
                text = text.split(s)[0]
            out.append(text)
        for _ in range(extra):
            self._logits([[self.tokenizer.bos_id]])
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
            seqs = [(ctx + cont)[-(self.max_length + 1) :] for ctx, cont in batch]
            logprobs = F.log_softmax(self._logits([s[:-1] for s in seqs]).float(), dim=-1)
            for row, (seq, (_, cont)) in enumerate(zip(seqs, batch)):
                n = len(cont)
                positions = torch.arange(len(seq) - 1 - n, len(seq) - 1, device=logprobs.device)
                target = torch.tensor(seq[-n:], device=logprobs.device)
                picked = logprobs[row, positions]
                greedy = bool((picked.argmax(-1) == target).all())
                results.append((float(picked.gather(1, target[:, None]).sum()), greedy))
        for _ in range(extra):
            self._logits([[self.tokenizer.bos_id]])
        return results

    def _agreed(self, batches: int) -> int:
        if self.group is None:
            return batches
        count = torch.tensor([batches], device=self._device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        return int(count)

    @torch.no_grad()
    def _logits(self, seqs: list[list[int]]) -> Tensor:
        """Logits of right-padded ``seqs`` (causal: padding after a sequence changes none of its positions)."""
        width = -(-max(len(s) for s in seqs) // self.pad_multiple) * self.pad_multiple
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device=self._device)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        was_training = self.module.training
        self.module.eval()
        try:
            logits = self.module(ids)
        finally:
            self.module.train(was_training)
        return logits.full_tensor() if isinstance(logits, DTensor) else logits


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

    def check_layout(self, dims: Any) -> None:
        """Refuse pipeline and context parallelism (``ultrascale-train`` asks before any process group)."""
        check_eval_layout(dims.pp, dims.cp)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dims = getattr(trainer.strategy, "parallel_dims", None)
        if dims is not None:
            self.check_layout(dims)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0 and not trainer.fit_loop._should_accumulate():
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step not in self.results:
            self.evaluate(trainer, pl_module)

    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, dict[str, float]]:
        import lm_eval
        from lm_eval.tasks import TaskManager

        getattr(trainer.strategy, "wait_for_parameters", lambda: None)()  # ZeRO-1/2's gathers in flight
        mesh = getattr(trainer.strategy, "mesh", None)
        group = mesh["dp"].get_group() if mesh is not None and trainer.world_size > 1 else None
        kwargs = trainer.strategy.distributed_sampler_kwargs if group is not None else {}
        lm = _layout_lm()(
            pl_module, self.tokenizer or run_tokenizer(trainer.datamodule), self.batch_size,
            data_rank=kwargs.get("rank", 0), data_ranks=kwargs.get("num_replicas", 1), group=group,
            pad_multiple=getattr(getattr(trainer.strategy, "parallel_dims", None), "tp", 1),
        )  # fmt: skip
        out = lm_eval.simple_evaluate(
            model=lm, tasks=self.tasks, limit=self.limit, task_manager=TaskManager(include_path=self.include_path),
            bootstrap_iters=0, log_samples=False, verbosity="WARNING",
            # lm-eval seeds Python, numpy and torch by default: the run's own random streams must go on as they were
            random_seed=None, numpy_random_seed=None, torch_random_seed=None,
        )  # fmt: skip
        metrics = _metrics(out["results"]) if out is not None else None
        if group is not None:  # global rank 0 has them (lm-eval returns them where LOCAL_RANK is 0 too): to every rank
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
