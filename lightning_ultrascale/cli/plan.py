"""``ultrascale-plan --check``: prove a run's layout at its full world size, in one process, in seconds.

Examples::

    ultrascale-plan --check recipe=llama3_8b                   # the recipe's 8 ranks
    ultrascale-plan --check recipe=llama3_8b --world-size 512 parallel.tp=8 parallel.pp=4
    ultrascale-plan --check model=llama3_405b parallel=zero3 parallel.tp=8 --world-size 2048 --ranks all

For the chosen ranks (default: the first and the last rank of every pipeline stage) it builds the
real model on the meta device, applies the real plugins under torch's fake process group at the
job's world size, and holds every parameter's local shape against the planner's prediction
(:func:`lightning_ultrascale.plan.predict_shards`). It prints each rank's coordinates, parameters
and their bytes, and exits 1 if a rank holds anything else than predicted. The same validation as
a run comes first: a layout that does not fit the model fails with the run's message.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lightning_ultrascale.errors import ConfigError, config_keys

__all__ = ["check", "main"]


def compose_run(overrides: Sequence[str]) -> DictConfig:
    """The config ``ultrascale-train`` would compose from these overrides (``recipe=NAME`` included)."""
    from lightning_ultrascale.cli.train import CONFIG_DIR, hydra_argv

    config_dir, name, rest = CONFIG_DIR, "train", []
    for arg in hydra_argv(list(overrides)):
        if arg.startswith("--config-dir="):
            config_dir = arg.split("=", 1)[1]
        elif arg.startswith("--config-name="):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if name != "train":  # a recipe: its defaults name the groups of conf/
        rest.append(f"hydra.searchpath=[file://{CONFIG_DIR}]")
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(name, overrides=rest)


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
    from lightning_ultrascale.models import build_model
    from lightning_ultrascale.plan import dry_run, predict_shards
    from lightning_ultrascale.strategy import UltraScaleStrategy
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


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``ultrascale-plan``."""
    parser = argparse.ArgumentParser(
        prog="ultrascale-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="dry-run ranks at full scale against the planner")
    parser.add_argument("--world-size", type=int, default=None, help="ranks of the job (default: the config's)")
    parser.add_argument("--ranks", default="stages", help="'stages' (default), 'all', or a comma list: 0,7,511")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for ultrascale-train (recipe=NAME ...)")
    args = parser.parse_args(argv)
    if not args.check:
        parser.error("only --check is built so far (the layout search comes next)")
    try:
        ok = check(args.overrides, args.world_size, args.ranks)
    except ConfigError as err:
        raise SystemExit(f"ultrascale-plan: {err}") from None
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
