"""``ultrascale-train``: compose the Hydra config, build the objects, run ``Trainer.fit``.

Examples::

    ultrascale-train                                   # tiny Llama, bundled corpus, 2 CPU processes
    ultrascale-train parallel.dp=2 model=llama_tiny trainer.max_steps=50
    ultrascale-train recipe=llama3_8b                  # a whole run from lightning_ultrascale/recipes/llama3_8b.yaml
    ultrascale-train --recipes-dir                     # where the recipes and launch scripts are
    ultrascale-train ckpt_path=outputs/.../checkpoints/last.ckpt trainer.max_steps=600   # resume
    ultrascale-train -m parallel=zero1,zero2 trainer.max_steps=20                        # a sweep

Every node with a ``_target_`` is built from it: the DataModule under ``data`` (``data._target_=
my_pkg.MyDataModule`` plugs in one's own), each plugin under ``parallel``, each logger under
``logger``, each callback under ``callbacks``. Short keys (``parallel.tp=2``) are expanded to
their nodes (``cli/keys.py``). ``model`` names a preset and changes any of its ``LlamaConfig``
fields (``model=llama_tiny model.n_layers=2``).

One run directory for all ranks: Hydra would otherwise make one per process (each with its own
timestamp; lightning-hydra-template #393, hydra #2070). The directory is fixed once, before any
rank starts, and handed to every rank through ``ULTRASCALE_RUN_DIR``: Lightning's own launcher
passes its environment to the processes it starts; under SLURM and torchrun the name comes from
the job id, which every rank sees. Only rank 0 writes Hydra's ``.hydra/`` record. In a sweep
(``-m``) each job gets ``<run dir>/<job number>``, and the ranks Lightning starts for a job run
that job only.

Every configuration error is raised here, before the Trainer (and so any process group) exists,
as one line naming the config key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import inspect
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lightning_ultrascale.cli.keys import error_keys, expand, plugin_nodes
from lightning_ultrascale.errors import ConfigError, config_keys, is_positive_int, reported

if TYPE_CHECKING:
    from lightning_ultrascale.models import LlamaConfig
    from lightning_ultrascale.parallel.dims import DataShape

log = logging.getLogger("lightning_ultrascale")

# Inside the package, so that a wheel carries them; a user's --config-dir adds groups and options to them.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "conf"
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
MULTIRUN_FLAGS = ("-m", "--multirun")


def run_dir() -> str:
    """The run directory every rank of this job agrees on (and exports for the ranks it starts)."""
    if "ULTRASCALE_RUN_DIR" not in os.environ:
        if os.environ.get("SLURM_JOB_ID"):
            name = f"slurm-{os.environ['SLURM_JOB_ID']}"
        elif os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
            name = f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            name = _torchrun_agent_name()
        else:
            name = time.strftime("%Y-%m-%d/%H-%M-%S")
        os.environ["ULTRASCALE_RUN_DIR"] = str(Path("outputs") / name)
    return os.environ["ULTRASCALE_RUN_DIR"]


def _torchrun_agent_name() -> str:
    """A name all ranks of a torchrun job without ``--rdzv-id`` share: their agent's pid and start time.

    Timestamps taken by each rank could straddle a second. Ranks on one node are children of one
    torchrun agent; ranks on several nodes share nothing before the process group exists.
    """
    if os.environ.get("WORLD_SIZE") != os.environ.get("LOCAL_WORLD_SIZE"):
        raise ConfigError(
            "torchrun on several nodes without --rdzv-id: ranks cannot agree on a run directory; "
            "pass --rdzv-id (any id shared by all nodes) or set ULTRASCALE_RUN_DIR (the recipes' torchrun.sh does)"
        )
    agent = os.getppid()
    start = Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[19]  # field 22: start time
    return f"torchrun-{agent}-{start}"


def _global_rank() -> int:
    for var in ("RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def slurm_tasks_per_node() -> int:
    """``cluster=slurm``'s ``trainer.devices``: SLURM's tasks per node (one per GPU), or a ConfigError naming
    the variable (``--ntasks-per-node`` sets ``SLURM_NTASKS_PER_NODE``; ``SLURM_TASKS_PER_NODE``, e.g.
    ``8(x4)``, is set in every allocation)."""
    value = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "")
    match = re.match(r"\d+", value)
    if match is None:
        raise ConfigError(
            "cluster=slurm needs SLURM_NTASKS_PER_NODE (or SLURM_TASKS_PER_NODE), which SLURM sets for the tasks "
            "srun starts: run inside an sbatch/salloc allocation with --ntasks-per-node=N (one task per GPU), e.g. "
            "the recipes' slurm.sbatch (ultrascale-train --recipes-dir); outside SLURM: cluster=local or torchrun"
        )
    return int(match.group())


def slurm_nodes() -> int:
    """``cluster=slurm``'s ``trainer.num_nodes``: ``SLURM_JOB_NUM_NODES``, or a ConfigError naming it."""
    value = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    if not value or not value.isdigit():
        raise ConfigError(
            "cluster=slurm needs SLURM_JOB_NUM_NODES, which SLURM sets inside an allocation (sbatch/salloc "
            "--nodes=N); outside SLURM use cluster=local or cluster=torchrun"
        )
    return int(value)


OmegaConf.register_new_resolver("ultrascale.div", lambda a, b: int(a) // int(b), replace=True)
OmegaConf.register_new_resolver("ultrascale.slurm_tasks_per_node", slurm_tasks_per_node, replace=True)
OmegaConf.register_new_resolver("ultrascale.slurm_nodes", slurm_nodes, replace=True)
OmegaConf.register_new_resolver("ultrascale.run_dir", run_dir, replace=True)


#: Keys of the ``model`` node the CLI reads itself; every other key is a field of the preset's config
#: (its ``PARTS``, configs of their own, change one setting each: ``model.moe.top_k=4``).
MODEL_KEYS = ("name", "init_from")


def config_dirs(overrides: list[str]) -> list[Path]:
    """The package's config groups, then a user's ``--config-dir=D``: Hydra's search path, in its order."""
    return [CONFIG_DIR, *(Path(a.split("=", 1)[1]) for a in overrides if a.startswith("--config-dir="))]


def expand_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides with short plugin keys expanded to their nodes (``parallel.tp=2``).

    A plugin node of a user's ``--config-dir`` (``mine/parallel/mine/default.yaml``) has short keys too.
    """
    nodes = plugin_nodes(*config_dirs(overrides))
    return [expand(o, nodes) for o in overrides]


def check_group_choices(overrides: list[str]) -> None:
    """``model=llama9``: name the valid options of a config group (Hydra lists its search path instead).

    The group files of a user's ``--config-dir`` are valid options too (``data=mine`` for ``mine/data/mine.yaml``).
    """
    dirs = config_dirs(overrides)
    for override in overrides:
        key, sep, value = override.lstrip("+").partition("=")
        groups = [d / key for d in dirs if (d / key).is_dir()]
        if not sep or "." in key or key.startswith("-") or not groups:
            continue
        valid = sorted({p.stem for group in groups for p in group.glob("*.yaml")})
        for choice in value.strip("[]").split(","):
            if choice.strip() and choice.strip() not in valid:
                where = ", ".join(map(str, groups))
                near = difflib.get_close_matches(choice.strip().replace("-", "_").lower(), valid, n=1, cutoff=0.85)
                meant = f"did you mean {key}={near[0]}? " if near else ""
                raise ConfigError(f"{key}={choice.strip()} is unknown; {meant}valid: {', '.join(valid)} (in {where})")


def _joined_flags(argv: list[str]) -> list[str]:
    """``--config-dir D`` and ``-cd D`` as ``--config-dir=D``: one argument, as a sweep's jobs pass flags on."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in ("--config-dir", "-cd"):
            out[-1] = f"--config-dir={arg}"
        else:
            out.append(arg)
    return out


def hydra_argv(argv: list[str]) -> list[str]:
    """Rewrite ``recipe=NAME`` into Hydra's primary-config flags, expand short keys, force-add ``model.*``
    keys, fix a sweep's directory, and silence ``.hydra/`` off rank 0."""
    argv = _joined_flags(argv)
    check_group_choices(argv)
    out: list[str] = []
    for arg in expand_overrides(argv):
        if arg.startswith("model."):
            # Force-add: a preset's node lists few of its fields (Hydra would stop at "Key 'vocab_size' is
            # not in struct"); _model_config applies each key to the preset or names what is valid instead.
            out.append("++" + arg)
        elif arg.startswith("recipe="):
            name = arg.split("=", 1)[1]
            available = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
            if name not in available:
                raise ConfigError(f"recipe={name!r} is unknown; valid: {', '.join(available)} (in {RECIPES_DIR})")
            out += [f"--config-dir={RECIPES_DIR}", f"--config-name={name}"]
        else:
            out.append(arg)
    if any(a in MULTIRUN_FLAGS for a in out) and not any(a.startswith("hydra.sweep.dir") for a in out):
        out.append(f"hydra.sweep.dir={run_dir()}")  # resolved once: jobs re-point ULTRASCALE_RUN_DIR
    if _global_rank() != 0 and not any(a.startswith("hydra.output_subdir") for a in out):
        out.append("hydra.output_subdir=null")
    return out


def main() -> None:
    """Console entry point of ``ultrascale-train``."""
    if sys.argv[1:] == ["--recipes-dir"]:  # for `cp "$(ultrascale-train --recipes-dir)/torchrun.sh" .`
        print(RECIPES_DIR)
        return
    # One line naming option, value and valid values, exit status 2; no traceback for a user's mistake
    # (also one a resolver raised while OmegaConf resolved the config, e.g. cluster=slurm's variables).
    with reported("ultrascale-train"):
        run_dir()
        sys.argv = [sys.argv[0], *hydra_argv(sys.argv[1:])]
        if not any(a in MULTIRUN_FLAGS for a in sys.argv):  # (a sweep's values are each checked by its job)
            _check_keys(sys.argv[1:])
        hydra.main(config_path=str(CONFIG_DIR), config_name="train", version_base="1.3")(_hydra_task)()


def _check_keys(argv: list[str]) -> None:
    """An override of a key the config does not have: refused naming its near matches (not Hydra's message).
    Whatever else composing finds, Hydra reports as it always did."""
    from lightning_ultrascale.cli.overrides import compose_checked

    try:
        compose_checked(argv, CONFIG_DIR)
    except ConfigError:
        raise
    except Exception:
        return


def _hydra_task(cfg: DictConfig) -> None:
    with _one_job(), config_keys(error_keys(cfg)), reported("ultrascale-train"):
        trainer, module, datamodule = build(cfg)
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)


@contextlib.contextmanager
def _one_job() -> Iterator[None]:
    """In a sweep: this job's own run directory, and ranks Lightning starts that run this job only.

    Hydra runs a sweep's jobs one after another in this process. Lightning starts each job's
    other ranks with this process's command line, which would re-run the whole sweep, so the
    command line becomes this job's overrides; the job's environment (its run directory, the
    port Lightning picked) and its process group end with it.
    """
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        yield
        return
    argv, environ = list(sys.argv), dict(os.environ)
    flags = [a for a in argv[1:] if a.startswith("-") and a not in MULTIRUN_FLAGS]
    sys.argv = [argv[0], *flags, *HydraConfig.get().overrides.task]
    os.environ["ULTRASCALE_RUN_DIR"] = HydraConfig.get().runtime.output_dir
    try:
        yield
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)


def instantiate(node: DictConfig | dict[str, Any], where: str) -> Any:
    """Build ``_target_(**settings)`` (no Hydra wrapper around its errors, so a ConfigError stays one line).

    A key the target does not take, or an argument it needs that the node lacks, is named as the
    config key ``where.key``. A node may say how to install what its target needs (``_install_``);
    a missing package then fails with that hint.
    """
    settings = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    assert isinstance(settings, dict)
    if "_target_" not in settings:
        raise ConfigError(f"{where} has no _target_; valid: {where}._target_=<dotted path of the class to build>")
    target, install = settings.pop("_target_"), settings.pop("_install_", None)
    hint = f"; install it: {install}" if install else ""
    factory = _locate(str(target), where, hint)
    _check_arguments(factory, settings, str(target), where)
    try:
        return factory(**settings)
    except (ImportError, ModuleNotFoundError) as err:
        raise ConfigError(f"{where} ({target}) needs a package that is not installed ({err}){hint}") from None


def _locate(target: str, where: str, hint: str) -> Callable[..., Any]:
    """``module.attribute`` imported, or one line naming ``where._target_`` (Hydra's own lookup logs several)."""
    module_name, _, attribute = target.rpartition(".")
    try:
        factory = getattr(importlib.import_module(module_name), attribute) if module_name else None
    except ModuleNotFoundError as err:
        if err.name is not None and not (module_name + ".").startswith(err.name + "."):
            # The target's module exists but imports a package that is not installed.
            raise ConfigError(f"{where} ({target}) needs a package that is not installed ({err}){hint}") from None
        factory = None
    except AttributeError:
        factory = None
    if not callable(factory):
        raise ConfigError(
            f"{where}._target_={target} cannot be imported; valid: the dotted path of a class importable here "
            "(package.module.Class)"
        )
    return factory  # type: ignore[no-any-return]


def _check_arguments(factory: Callable[..., Any], settings: dict[str, Any], owner: str, where: str) -> None:
    """Name the key the factory does not take, or the argument it needs that is not set, before calling it."""
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): the call itself will tell
        return
    named = [p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        for key, value in settings.items():
            if key not in {p.name for p in named}:
                raise ConfigError(
                    f"{where}.{key}={value!r} is not an argument of {owner}; valid: "
                    f"{', '.join(p.name for p in named)} (drop it with ~{where}.{key})"
                )
    missing = [p.name for p in named if p.default is p.empty and p.name not in settings]
    if missing:
        raise ConfigError(f"{where}.{missing[0]} is not set, and {owner} needs it; valid: +{where}.{missing[0]}=...")


def plugins(parallel: DictConfig) -> list[Any]:
    """The parallelism plugins: one per node of the ``parallel`` group."""
    return [instantiate(node, f"parallel.{name}") for name, node in parallel.items() if "_target_" in node]


def _callbacks(cfg: DictConfig, world_size: int) -> list[Any]:
    """The ``callbacks`` nodes, then the ``profiler`` node's (a callback too: see ``profiling.py``)."""
    from lightning.pytorch.callbacks import ProgressBar

    from lightning_ultrascale.training.snapshots import HFSnapshots

    built = [instantiate(node, f"callbacks.{name}") for name, node in (cfg.get("callbacks") or {}).items()]
    every = (cfg.get("checkpoint") or {}).get("hf_every_n_steps", 0)
    if every and not any(isinstance(c, HFSnapshots) and c.every_n_steps == every for c in built):
        raise ConfigError(
            f"checkpoint.hf_every_n_steps={every}, but no callback writes the snapshots (callbacks=none, or "
            "~callbacks.hf_snapshots, dropped it); valid: callbacks=default, or +callbacks.hf_snapshots={_target_: "
            "lightning_ultrascale.training.snapshots.HFSnapshots, every_n_steps: N}"
        )
    if "_target_" in (cfg.get("profiler") or {}):
        profiler = instantiate(cfg.profiler, "profiler")
        check = getattr(profiler, "check_world_size", None)  # TraceProfiler's ranks, before any process group
        if check is not None:
            check(world_size)
        built.append(profiler)
    if cfg.trainer.get("enable_progress_bar", True):
        return built
    return [c for c in built if not isinstance(c, ProgressBar)]  # Lightning refuses a bar it may not show


def _auto_layout(cfg: DictConfig) -> list[Any] | None:
    """``parallel=auto``: the planner's plugins, with ``data.micro_batch_size`` set to the layout's (else None)."""
    if "auto" not in cfg.parallel:
        return None
    from lightning_ultrascale.cli.auto import choose_layout, world_size_of
    from lightning_ultrascale.parallel.plugin import searched_techniques

    # The planner chooses every technique it searches; the others (compiled blocks) stay as set.
    kept = {
        name: instantiate(node, f"parallel.{name}")
        for name, node in cfg.parallel.items()
        if name != "auto" and "_target_" in node
    }
    searched = [name for name, plugin in kept.items() if isinstance(plugin, searched_techniques())]
    if searched:
        raise ConfigError(
            f"parallel=auto chooses every plugin, but parallel.{searched[0]} is set too; valid: parallel=auto alone "
            "(pin a size with parallel.auto.space, e.g. 'parallel.auto.space={tp: [2]}')"
        )
    chosen, micro_batch_size = choose_layout(cfg, world_size_of(cfg.trainer), workload(cfg))
    cfg.data.micro_batch_size = micro_batch_size
    return [*chosen, *(plugin for plugin in kept.values() if plugin.active)]


def build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """Turn a composed config into (Trainer, LlamaModule, DataModule); validates everything first."""
    with config_keys(error_keys(cfg)):
        return _build(cfg)


def _module_and_data(cfg: DictConfig) -> tuple[Any, Any, int | None]:
    """The LlamaModule, the DataModule the ``data`` node builds, and ``data.global_batch_size``.

    ``global_batch_size`` is the CLI's own key (gradient accumulation is derived from it), so it
    leaves the node before the DataModule is built; every other key is a constructor argument.
    """
    from lightning_ultrascale.training.module import LlamaModule, OptimConfig

    optim = {k: (tuple(v) if k == "betas" else v) for k, v in cfg.optim.items() if k != "grad_clip"}
    init_from = cfg.model.get("init_from")
    kernels = cfg.get("kernels") or {}
    settings = OmegaConf.to_container(cfg.data, resolve=True)
    assert isinstance(settings, dict)
    global_batch_size = settings.pop("global_batch_size", None)
    if cfg.model.name == "hf":
        if settings.get("documents") == "mask":
            from lightning_ultrascale.models.hf.adapter import NO_DOCUMENTS

            raise ConfigError(NO_DOCUMENTS)
        return _hf_module(cfg, OptimConfig(**optim)), instantiate(settings, "data"), global_batch_size
    module = LlamaModule(
        _model_config(cfg.model),
        optim=OptimConfig(**optim),
        seed=cfg.seed,
        init_from=init_from,
        kernels=kernels.get("name", "reference"),
        fused_cross_entropy=kernels.get("fused_cross_entropy"),
    )
    return module, instantiate(settings, "data"), global_batch_size


#: Keys of ``model=hf``: the directory decides the architecture, so no other key applies.
HF_MODEL_KEYS = ("name", "path", "pretrained")


def _hf_module(cfg: DictConfig, optim: Any) -> Any:
    """``model=hf model.path=DIR``: the HF model of the directory, as transformers defines it."""
    from lightning_ultrascale.training.hf_module import HFCausalLMModule

    path = hf_path(cfg.model)
    unknown = [k for k in cfg.model if k not in HF_MODEL_KEYS]
    if unknown:
        raise ConfigError(
            f"model.{unknown[0]}={cfg.model[unknown[0]]!r} does not apply to model=hf, whose architecture is its "
            f"directory's config.json; valid: {', '.join(f'model.{k}' for k in HF_MODEL_KEYS)}"
        )
    kernels = (cfg.get("kernels") or {}).get("name", "reference")
    if kernels != "reference":
        raise ConfigError(
            f"kernels={kernels} swaps our Llama's ops; model=hf runs transformers' own: kernels=reference"
        )
    pretrained = bool(cfg.model.get("pretrained", True))
    return HFCausalLMModule(path, optim=optim, seed=cfg.seed, pretrained=pretrained)


def hf_path(model: DictConfig) -> str:
    """``model.path`` of ``model=hf``, or a one-line error saying how to give it."""
    if OmegaConf.is_missing(model, "path") or not model.get("path"):
        raise ConfigError("model=hf needs model.path=DIR, an HF model directory (config.json, *.safetensors)")
    return str(model.path)


def _data_shape(datamodule: Any, global_batch_size: int | None, module: Any) -> DataShape | None:
    """The batch shape the DataModule declares, checked against the model; None where it declares none."""
    from lightning_ultrascale.parallel.dims import DataShape

    shape = DataShape.declared_by(datamodule)
    if shape is None:
        if global_batch_size is not None:
            raise ConfigError(
                f"data.global_batch_size={global_batch_size} needs the micro batch size, but "
                f"{type(datamodule).__name__} declares no integer micro_batch_size attribute; valid: "
                "data.global_batch_size=null (then trainer.accumulate_grad_batches sets the accumulation)"
            )
        return None
    if shape.seq_len > module.max_seq_len:
        raise ConfigError(
            f"{shape.option('seq_len')} exceeds model.max_seq_len={module.max_seq_len} of {module.model_name}"
        )
    return dataclasses.replace(shape, global_batch_size=global_batch_size)


def workload(cfg: DictConfig) -> Any:
    """The :class:`~lightning_ultrascale.plan.Workload` a composed run config trains."""
    from lightning_ultrascale.plan import Workload

    precision = str(cfg.precision.precision)
    if precision not in ("32-true", "bf16-mixed"):  # bf16-true: priced as bf16-mixed's compute
        precision = "bf16-mixed"
    fp8 = cfg.precision.get("fp8")  # an FP8 recipe on top of that precision: priced from its GEMMs (plan.fp8)
    kernels = cfg.get("kernels") or {}
    fused = bool(kernels.get("fused_cross_entropy")) or kernels.get("name", "reference") != "reference"
    shape = {}
    for key in ("seq_len", "global_batch_size"):
        value = cfg.data.get(key)
        if not is_positive_int(value):
            # A data node of one's own (data._target_=...) may not declare them: the planner needs both.
            raise ConfigError(
                f"data.{key}={value!r}: the planner prices a step of data.seq_len tokens x data.global_batch_size "
                f"sequences; give both as positive integers (e.g. data.{key}={8192 if key == 'seq_len' else 256})"
            )
        shape[key] = value
    reduce_dtype = str((cfg.get("parallel") or {}).get("zero", {}).get("reduce_dtype", "fp32"))
    return Workload(
        _priced_model(cfg.model), **shape, precision=precision, fused_cross_entropy=fused, reduce_dtype=reduce_dtype,
        fused_kernels=kernels.get("name", "reference") != "reference", fp8=None if fp8 is None else str(fp8),
        optimizer=str(cfg.optim.get("name", "adamw")),
    )  # fmt: skip


def _priced_model(model: DictConfig) -> Any:
    """What the planner prices of the ``model`` node: the preset's config; for ``model=hf`` what trains, the HF
    model of a family the adapter trains as it is (:data:`~lightning_ultrascale.models.hf.adapter.FAMILIES`) on the
    meta device, priced from the spec the adapter gives it (transformers' MoE layers, for one, do not fold over
    tensor parallelism where our decoder's would), else the directory's config converted to our decoder."""
    if model.name == "hf":
        from lightning_ultrascale.models.hf.adapter import FAMILIES
        from lightning_ultrascale.training.hf_module import hf_directory, hf_meta_model

        path = hf_path(model)
        try:  # (a directory without a readable config.json: _model_config says so, by name)
            kind = json.loads((Path(path) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            kind = None
        if kind in FAMILIES:
            return hf_meta_model(hf_directory(path))
    return _model_config(model)


def _model_config(model: DictConfig) -> LlamaConfig:
    """The preset ``model.name`` with every other key of the node applied to its ``LlamaConfig``, validated.

    A changed preset is named after what changed, ``llama_tiny(n_layers=2, vocab_size=512)``: the
    name goes into checkpoints and logs, where the preset's own would claim the preset's sizes.
    """
    from lightning_ultrascale.models import get_model_config

    if model.name == "hf":  # the planner prices our Llama's architecture: the directory's, converted
        from lightning_ultrascale.models.hf.convert import hf_directory_config

        path = hf_path(model)
        return hf_directory_config(path, f"model=hf model.path={path} (priced as our Llama)")
    preset = get_model_config(model.name)
    settings = OmegaConf.to_container(model, resolve=True)
    assert isinstance(settings, dict)
    fields = [f.name for f in dataclasses.fields(preset) if f.name != "name"]
    changes: dict[str, Any] = {}
    for key, value in settings.items():
        if key in MODEL_KEYS:
            continue
        if key not in fields:
            raise ConfigError(f"model.{key}={value!r} is unknown; valid: {', '.join([*MODEL_KEYS, *fields])}")
        changes[key] = _model_part(preset, key, value) if key in preset.PARTS else value
    config = dataclasses.replace(preset, **changes)
    changed = _differences(config, preset)
    if changed:
        config = dataclasses.replace(config, name=f"{preset.name}({', '.join(changed)})")
    config.validate()
    return config


def _model_part(preset: LlamaConfig, part: str, value: Any) -> Any:
    """``model.moe.top_k=4``: the preset's ``moe`` with that setting changed; ``model.moe=null`` drops it."""
    from lightning_ultrascale.models import MODEL_CONFIGS

    if value is None:
        return None
    current = getattr(preset, part)
    if not isinstance(value, dict):
        raise ConfigError(f"model.{part}={value!r} must be a node of its settings; valid: model.{part}.<setting>=...")
    if current is None:
        having = ", ".join(n for n, c in MODEL_CONFIGS.items() if getattr(c, part, None) is not None)
        raise ConfigError(
            f"model.{part}.{next(iter(value), '')} is set, but model={preset.name} has no {preset.PARTS[part]}; "
            f"valid: a model with one ({having})"
        )
    fields = [f.name for f in dataclasses.fields(current)]
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigError(f"model.{part}.{unknown[0]} is unknown; valid: {', '.join(fields)}")
    return dataclasses.replace(current, **value)


def _differences(config: Any, preset: Any, prefix: str = "") -> list[str]:
    """``setting=value`` for every field of ``config`` that differs from ``preset`` (inside its parts too)."""
    out: list[str] = []
    for f in dataclasses.fields(config):
        ours, theirs = getattr(config, f.name), getattr(preset, f.name)
        if f.name == "name" or ours == theirs:
            continue
        if dataclasses.is_dataclass(ours) and type(ours) is type(theirs):
            out += _differences(ours, theirs, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}={ours}")
    return out


def _resume_from(cfg: DictConfig, module: Any) -> None:
    """``ckpt_path``: ``auto`` resolved to the newest checkpoint (or None); a path checked (one, of this model)."""
    from lightning_ultrascale.core.checkpoint import check_checkpoint_model, check_checkpoint_path
    from lightning_ultrascale.training.resilience import resolve_ckpt_path

    cfg.ckpt_path = resolve_ckpt_path(cfg.ckpt_path, _checkpoint_dir(cfg))
    if cfg.ckpt_path is not None:
        check_checkpoint_path(cfg.ckpt_path)
        check_checkpoint_model(cfg.ckpt_path, module.hparams)


def _checkpoint_dir(cfg: DictConfig) -> Path:
    """Where the run's checkpoints go (the ``checkpoint`` callback's directory): where ``ckpt_path=auto`` looks."""
    node = (cfg.get("callbacks") or {}).get("checkpoint") or {}
    return Path(node.get("dirpath") or Path(run_dir()) / "checkpoints")


def _cluster_plugins(callbacks: list[Any]) -> list[Any]:
    """Under SLURM with our :class:`~lightning_ultrascale.training.resilience.Preemption`: Lightning's own requeue off
    (it saves inside the signal handler, on whichever rank the signal reaches first, at any point of a step)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_ultrascale.training.resilience import Preemption

    if not SLURMEnvironment.detect() or not any(isinstance(c, Preemption) for c in callbacks):
        return []
    return [SLURMEnvironment(auto_requeue=False)]


def _precision(node: DictConfig) -> dict[str, Any]:
    """The Trainer's precision argument, or, with ``precision.fp8``, the FP8Precision plugin carrying it."""
    fp8 = node.get("fp8")
    if fp8 is None:
        return {"precision": node.precision}
    from lightning_ultrascale.fp8.precision import FP8Precision

    return {"plugins": [FP8Precision(fp8, node.precision, emulate=node.get("emulate"))]}


def _accumulation(t: DictConfig, shape: Any, strategy: Any) -> dict[str, int]:
    """``accumulate_grad_batches`` for ``L.Trainer`` when the data sets a global batch (else nothing)."""
    if shape is None or shape.global_batch_size is None:
        return {}
    if "accumulate_grad_batches" in t:
        raise ConfigError(
            f"trainer.accumulate_grad_batches={t.accumulate_grad_batches} and data.global_batch_size="
            f"{shape.global_batch_size} both set the gradient accumulation; valid: one of them "
            "(data.global_batch_size=null, or drop trainer.accumulate_grad_batches)"
        )
    micro_steps = strategy.parallel_dims.grad_accumulation(shape.global_batch_size, shape.micro_batch_size)
    return {"accumulate_grad_batches": micro_steps}


def _build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    import lightning as L

    from lightning_ultrascale.core.guard import NonFiniteGuard
    from lightning_ultrascale.core.strategy import UltraScaleStrategy

    chosen = _auto_layout(cfg)
    module, datamodule, global_batch_size = _module_and_data(cfg)
    shape = _data_shape(datamodule, global_batch_size, module)
    _resume_from(cfg, module)
    strategy = UltraScaleStrategy(
        *(chosen if chosen is not None else plugins(cfg.parallel)),
        seed=cfg.seed,
        async_checkpoint=cfg.checkpoint["async"],
        guard=NonFiniteGuard(skip_step=cfg.guard.skip_step),
        tf32=cfg.get("tf32", True),
    )
    t = cfg.trainer
    world_size = int(t.devices) * int(t.num_nodes)
    strategy.validate(module.model_spec, shape, world_size=world_size)
    accumulate = _accumulation(t, shape, strategy)
    loggers = [instantiate(node, f"logger.{name}") for name, node in (cfg.get("logger") or {}).items()]
    out = Path(run_dir())
    # Every key of the trainer group goes to L.Trainer as it is: `trainer.X=...` overrides any Trainer argument.
    callbacks = _callbacks(cfg, world_size)
    precision = _precision(cfg.precision)
    lightning_plugins = precision.pop("plugins", []) + _cluster_plugins(callbacks)
    trainer = L.Trainer(
        **OmegaConf.to_container(t, resolve=True),  # type: ignore[arg-type]
        strategy=strategy,
        **precision,
        **({"plugins": lightning_plugins} if lightning_plugins else {}),
        **accumulate,
        gradient_clip_val=cfg.optim.get("grad_clip"),
        logger=loggers or False,
        callbacks=callbacks,
        default_root_dir=str(out),
    )
    if trainer.global_rank == 0:
        log.info("run directory: %s", out.resolve())
        log.info("layout: %s, gradient accumulation %d", strategy.describe(), trainer.accumulate_grad_batches)
        if shape is None:
            log.warning(
                "data: %s declares no integer seq_len and micro_batch_size: its batches are not checked against "
                "the layout before training",
                type(datamodule).__name__,
            )
    return trainer, module, datamodule


if __name__ == "__main__":
    main()
