"""``ultrascale-plan``: the fastest layout that fits, before any GPU is booked; ``--check`` proves it at scale.

Examples::

    ultrascale-plan recipe=llama3_8b --world-size 64                  # search: the best layouts on 64 H100s
    ultrascale-plan model=llama3_70b data.seq_len=8192 --world-size 512 --gpu h200 --top 5 --plot mfu.png
    ultrascale-plan recipe=llama3_70b --world-size 512 --space tp=8 --space recompute=none,full
    ultrascale-plan recipe=mixtral_8x7b --world-size 64 --expert-load 1.3     # a router's measured imbalance
    ultrascale-plan --check recipe=llama3_8b                           # the recipe's 8 ranks
    ultrascale-plan --check model=llama3_405b parallel=zero3 parallel.tp=8 --world-size 2048 --ranks all

**Search** (the default) takes the model, ``data.seq_len``, ``data.global_batch_size`` and the
precision from the composed config (the run's own), enumerates every layout the plugins accept
(:func:`lightning_ultrascale.plan.search`), drops those over the GPU's usable memory, and prints
the best ``--top`` with their memory parts, MFU and tokens/s, then why each popular layout family
loses (out of memory by X GiB, the bubble, tensor parallelism across nodes, ...). ``--plot`` draws
the best MFU for each (tp, pp) as a heatmap PNG (needs matplotlib). The config's own ``parallel``
settings are not read: pin dimensions with ``--space KEY=V1,V2``. Exit 1 if no layout fits.

**--check**: for the chosen ranks (default: the first and the last rank of every pipeline stage) it
builds the real model on the meta device, applies the real plugins under torch's fake process group
at the job's world size, and holds every parameter's local shape against the planner's prediction
(:func:`lightning_ultrascale.plan.predict_shards`). It prints each rank's coordinates, parameters
and their bytes, and exits 1 if a rank holds anything else than predicted. The same validation as
a run comes first: a layout that does not fit the model fails with the run's message.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from lightning_ultrascale.errors import ConfigError, config_keys, reported

__all__ = ["check", "main", "plan"]


def compose_run(overrides: Sequence[str]) -> DictConfig:
    """The config ``ultrascale-train`` would compose from these overrides (``recipe=NAME`` included); an
    override of a key the config does not have is refused naming its near matches."""
    from lightning_ultrascale.cli.overrides import compose_checked
    from lightning_ultrascale.cli.train import CONFIG_DIR, hydra_argv

    return compose_checked(hydra_argv(list(overrides)), CONFIG_DIR)


def _world_size(cfg: DictConfig, given: int | None) -> int:
    if given is not None:
        return given
    try:
        return int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    except Exception as err:  # an unset launcher variable (torchrun, SLURM) behind devices / num_nodes
        first_line = str(err).splitlines()[0]
        raise ConfigError(
            f"trainer.devices x trainer.num_nodes come from the launcher's environment here ({first_line}); "
            "pass --world-size N"
        ) from None


def _ranks(spec: str, world: int, pp: int) -> list[int]:
    if spec == "all":
        return list(range(world))
    if spec == "stages":
        per_stage = world // pp
        return sorted({r for s in range(pp) for r in (s * per_stage, (s + 1) * per_stage - 1)})
    ranks = [int(r) for r in spec.split(",")]
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ConfigError(f"--ranks {spec}: ranks {bad} are outside the job's 0..{world - 1}")
    return ranks


def check(overrides: Sequence[str], world_size: int | None = None, ranks: str = "stages") -> bool:
    """Dry-run ``ranks`` of the composed run against the planner; print a table; True if all agree."""
    from lightning_ultrascale.cli.keys import error_keys
    from lightning_ultrascale.cli.train import _model_config, plugins
    from lightning_ultrascale.core.strategy import UltraScaleStrategy
    from lightning_ultrascale.models import build_model
    from lightning_ultrascale.plan import dry_run, predict_shards
    from lightning_ultrascale.utils.memory import format_bytes

    cfg = compose_run(overrides)
    with config_keys(error_keys(cfg)):
        config = _model_config(cfg.model)
        world = _world_size(cfg, world_size)
        strategy = UltraScaleStrategy(*plugins(cfg.parallel))
        meta = build_model(config, device="meta")  # predictions read it and leave it as it is
        strategy.validate(meta.spec, world_size=world)
        dims = strategy.parallel_dims
        chosen = _ranks(ranks, world, dims.pp)
    param_bytes = 4  # fp32 parameters (bf16-mixed keeps fp32 masters; FSDP gathers bf16 copies)
    print(f"{config.name} on {world} ranks: {dims.describe()}; {len(chosen)} ranks checked")
    print(f"{'rank':>6}  {'coordinate (pp, dp_r, dp_s, cp, tp)':<36}{'parameters':>16}{'fp32':>12}  dry run")
    agree = True
    for rank in chosen:
        plan = predict_shards(strategy, meta, world, rank)
        measured = dry_run(
            lambda: UltraScaleStrategy(*plugins(cfg.parallel)), lambda: build_model(config, device="meta"), world, rank
        )
        same = measured == plan.shapes
        agree &= same
        coordinate = str(tuple(dims.coordinate(rank).values()))
        differing = {n for n in set(measured) | set(plan.shapes) if measured.get(n) != plan.shapes.get(n)}
        verdict = "= planner" if same else f"DIFFERS in {len(differing)} parameters, e.g. {sorted(differing)[0]}"
        size = format_bytes(plan.numel * param_bytes)
        print(f"{rank:>6}  {coordinate:<36}{plan.numel:>16,}{size:>12}  {verdict}")
    return agree


def _gpu_precision(overrides: list[str], gpu: str) -> tuple[list[str], str | None]:
    """Overrides planned in ``bf16-mixed`` on a GPU where neither a recipe nor a precision was given, and the
    line that says so: the default config's ``fp32`` is the CPU job's, a precision no one trains a large
    model in on GPUs (every GPU recipe uses bf16-mixed or FP8 on it)."""
    if gpu == "cpu" or any(o.lstrip("+~").startswith(("recipe=", "precision=", "precision.")) for o in overrides):
        return overrides, None
    if any(o.startswith("--config-name") for o in overrides):
        return overrides, None
    note = (
        "ultrascale-plan: planned in bf16-mixed, as the GPU recipes train (no recipe= or precision= given; "
        "the default config's fp32 is the CPU job's: precision=fp32 plans in 32-true)"
    )
    return [*overrides, "precision=bf16_mixed"], note


def _parse_space(items: Sequence[str]) -> dict[str, list[Any]]:
    space: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ConfigError(f"--space {item}: expected KEY=V1,V2 (e.g. --space tp=4,8)")
        parsed: list[Any] = []
        for v in values.split(","):
            parsed.append(int(v) if v.lstrip("-").isdigit() else {"true": True, "false": False}.get(v.lower(), v))
        space[key] = parsed
    return space


def expert_load_option(value: str | None) -> dict[str, Any]:
    """``--expert-load``'s Workload fields: a number (the busiest expert rank's rows over the mean) or ``forced``.

    Example:
        >>> expert_load_option("1.3"), expert_load_option("forced"), expert_load_option(None)
        ({'expert_load': 1.3}, {'force_balanced': True}, {})
    """
    if value is None:
        return {}
    if value == "forced":
        return {"force_balanced": True}
    try:
        load = float(value)
    except ValueError:
        load = float("nan")
    if not load >= 1.0:
        raise ConfigError(
            f"--expert-load={value}: a number >= 1.0 (the busiest expert rank's routed rows over the mean; 1.0: "
            "uniform), or 'forced' (Megatron's force-balanced routing); default: a balanced router's, as this "
            "library's MoE runs measured it"
        )
    return {"expert_load": load}


def plan(
    overrides: Sequence[str],
    world_size: int | None,
    gpu: str = "h100",
    top: int = 10,
    space: Sequence[str] = (),
    plot: str | None = None,
    expert_load: str | None = None,
) -> Any:
    """Search the composed run's workload on ``world_size`` GPUs; print the table; return the result."""
    from lightning_ultrascale.cli.keys import error_keys
    from lightning_ultrascale.cli.train import workload
    from lightning_ultrascale.plan import get_hardware, search

    hardware = get_hardware(gpu)
    overrides, note = _gpu_precision(list(overrides), hardware.name)
    cfg = compose_run(overrides)
    with config_keys(error_keys(cfg)):
        work = dataclasses.replace(workload(cfg), **expert_load_option(expert_load))
        world = _world_size(cfg, world_size)
    if note:
        print(note, flush=True)
    result = search(work, world, hardware, space=_parse_space(space))
    print(render(result, top))
    if plot:
        heatmap(result, plot)
        print(f"\nheatmap of the best MFU per (tp, pp): {plot}")
    return result


def render(result: Any, top: int = 10) -> str:
    """The search's table: the best ``top`` layouts, then each popular family's best and why it loses."""
    w, gpu = result.workload, result.gpu
    gib = 2**30
    optimizer = ", Muon" if w.optimizer == "muon" else ""
    lines = [
        f"{w.name}: seq_len {w.seq_len}, global batch {w.global_batch_size} ({w.tokens_per_step:,} tokens), "
        f"{w.precision}{f' + FP8 {w.fp8}' if w.fp8 else ''}{optimizer}, on {result.world_size} x {gpu.name} "
        f"({gpu.usable_bytes / gib:.0f} GiB usable per GPU)",
        f"{len(result.fitting)} layouts fit, {len(result.too_big)} do not, {result.refused} refused by the plugins, "
        f"{len(result.dominated)} not priced (a layout of the same sizes with less sharding/recomputation fits)",
        "",
        f"{'#':>3}  {'layout':<58}{'peak':>7}{'params':>8}{'optim':>7}{'grads':>7}{'activ':>7}{'work':>6}"
        f"{'MFU':>7}{'tokens/s':>12}{'bubble':>8}",
    ]
    for i, p in enumerate(result.fitting[:top], 1):
        m = p.memory_gib()
        lines.append(
            f"{i:>3}  {p.candidate.label():<58}{p.peak / gib:>7.1f}{m['params']:>8.1f}{m['optimizer']:>7.1f}"
            f"{m['grads']:>7.1f}{m['activations']:>7.1f}{m['working']:>6.1f}{p.mfu:>7.1%}{p.tokens_per_s:>12,.0f}"
            f"{p.slowest.bubble:>8.2f}"
        )
    against = ", against the bf16 peak" if w.fp8 else ""
    lines += [
        "",
        f"(GiB on the busiest rank; MFU from the time model{against}, not measured)",
        "",
        "Popular alternatives:",
    ]
    for family, priced, why in result.alternatives():
        label = priced.candidate.label() if priced is not None else "-"
        lines.append(f"  {family:<32}{label:<58} {why}")
    return "\n".join(lines)


def heatmap(result: Any, path: str) -> None:
    """The playbook's picture: the best MFU of each (tp, pp) that fits; "OOM" where only layouts over memory exist."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'lightning-ultrascale[plot]'") from None
    import numpy as np

    tps = sorted({p.candidate.tp for p in result.fitting + result.too_big})
    pps = sorted({p.candidate.pp for p in result.fitting + result.too_big})
    grid = np.full((len(pps), len(tps)), np.nan)
    for p in result.fitting:
        i, j = pps.index(p.candidate.pp), tps.index(p.candidate.tp)
        grid[i, j] = max(p.mfu, 0.0 if np.isnan(grid[i, j]) else grid[i, j])
    fig, ax = plt.subplots(figsize=(1.2 * len(tps) + 2, 0.8 * len(pps) + 1.5))
    ax.imshow(grid, cmap="viridis", vmin=0, vmax=max(0.01, float(np.nanmax(grid))), origin="lower")
    for i, pp in enumerate(pps):
        for j, tp in enumerate(tps):
            if not np.isnan(grid[i, j]):
                text = f"{grid[i, j]:.1%}"
            elif any(p.candidate.tp == tp and p.candidate.pp == pp for p in result.too_big):
                text = "OOM"
            else:
                text = "-"
            ax.text(j, i, text, ha="center", va="center", color="k")
    ax.set_xticks(range(len(tps)), [str(t) for t in tps])
    ax.set_yticks(range(len(pps)), [str(p) for p in pps])
    ax.set_xlabel("tensor parallel size (tp)")
    ax.set_ylabel("pipeline parallel size (pp)")
    w = result.workload
    ax.set_title(f"{w.name}, seq {w.seq_len}, {result.world_size} x {result.gpu.name}: best MFU")
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)


def gpu_profile(text: str) -> str | dict[str, Any]:
    """``--gpu``: a built-in profile's name, or ``[BASE,]KEY=VALUE,...`` of ``plan.Hardware``'s fields.

    ``memory_gib`` and ``reserved_gib`` may stand for ``memory_bytes`` and ``reserved_bytes``.

    Example:
        >>> gpu_profile("h100,memory_gib=96")["memory_bytes"] == 96 * 2**30
        True
    """
    from dataclasses import asdict

    from lightning_ultrascale.plan.hardware import get_hardware

    if "=" not in text:
        return text
    parts = [p.strip() for p in text.split(",") if p.strip()]
    base: dict[str, Any] = {}
    if "=" not in parts[0]:
        base, parts = asdict(get_hardware(parts[0])), parts[1:]
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not value:
            raise ConfigError(f"--gpu {text}: {part!r} is not KEY=VALUE (e.g. memory_gib=96)")
        if key in ("memory_gib", "reserved_gib"):
            key, value = key.replace("_gib", "_bytes"), str(float(value) * 2**30)
        try:
            base[key] = value if key == "name" else float(value)
        except ValueError:
            raise ConfigError(f"--gpu {text}: {key}={value!r} is not a number") from None
    for key in ("memory_bytes", "reserved_bytes", "gpus_per_node"):
        if isinstance(base.get(key), float):
            base[key] = int(base[key])
    base.setdefault("name", "custom")
    get_hardware(base)  # refuses unknown keys and missing fields, naming them
    return base


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``ultrascale-plan``."""
    parser = argparse.ArgumentParser(
        prog="ultrascale-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="dry-run ranks at full scale against the planner")
    parser.add_argument("--world-size", type=int, default=None, help="GPUs of the job (default: the config's)")
    parser.add_argument(
        "--gpu", default="h100",
        help="search: a GPU profile (h100, h200, a100; default h100), or your own as KEY=VALUE,... of "
        "lightning_ultrascale.plan.Hardware's fields, on a built-in base or not: "
        "'h100,memory_gib=96,peak_flops=800e12' or 'name=mi300x,peak_flops=1307e12,memory_gib=192'",
    )  # fmt: skip
    parser.add_argument("--top", type=int, default=10, help="search: layouts to print (default 10)")
    parser.add_argument("--space", action="append", default=[], help="search: pin a dimension, KEY=V1,V2")
    parser.add_argument("--plot", default=None, help="search: write the (tp, pp) MFU heatmap to this PNG")
    parser.add_argument(
        "--expert-load", default=None,
        help="search, MoE: the busiest expert rank's routed rows over the mean (>= 1.0), or 'forced' (Megatron's "
        "force-balanced routing); default: a balanced router's, as this library's MoE runs measured it",
    )  # fmt: skip
    parser.add_argument("--ranks", default="stages", help="--check: 'stages' (default), 'all', or a list: 0,7,511")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for ultrascale-train (recipe=NAME ...)")
    args = parser.parse_intermixed_args(argv)  # options before, between or after the overrides
    with reported("ultrascale-plan"):
        # gpu=NAME reads like an override; it is the --gpu option.
        gpus = [o for o in args.overrides if o.startswith("gpu=")]
        args.overrides = [o for o in args.overrides if not o.startswith("gpu=")]
        args.gpu = gpu_profile(gpus[-1][4:] if gpus else args.gpu)
        if args.check:
            ok = check(args.overrides, args.world_size, args.ranks)
        else:
            plan(args.overrides, args.world_size, args.gpu, args.top, args.space, args.plot, args.expert_load)
            ok = True
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
