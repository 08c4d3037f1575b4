"""An override the config does not have, named with what the user most likely meant: never Hydra's traceback.

``ultrascale-train trainer.precision=bf16-mixed`` used to end in Hydra's ``ConfigCompositionException``
("Could not override 'trainer.precision'. To append to your config use +trainer.precision=..."),
which points at the wrong fix: the precision is the ``precision`` config group's. :func:`compose_checked`
composes the config as the run would and turns such a failure into one
:class:`~lightning_ultrascale.errors.ConfigError` line that names the override and its near matches:

- a config group whose option sets this very key to this very value (``precision=bf16_mixed``,
  whose file says ``precision: bf16-mixed``);
- a config group of that name, with its valid choices;
- the config's keys that look alike (``data.seqlen`` -> ``data.seq_len``);
- and where a node takes keys it does not list (``trainer.*``: Lightning Trainer arguments), how to add one.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from lightning_ultrascale.errors import ConfigError

#: Nodes whose consumer takes any key: ``+node.key=value`` adds one the config does not list.
OPEN_NODES = {"trainer": "a Lightning Trainer argument"}


def compose_checked(argv: Sequence[str], config_dir: Path, default_name: str = "train") -> DictConfig:
    """The config Hydra composes from ``argv`` (overrides after :func:`~lightning_ultrascale.cli.train.hydra_argv`,
    ``--config-dir=`` / ``--config-name=`` included); an override of a key the config does not have raises
    a :class:`ConfigError` naming its near matches."""
    user_dirs: list[Path] = []
    name, overrides = default_name, []
    for arg in argv:
        if arg.startswith("--config-dir="):
            user_dirs.append(Path(arg.split("=", 1)[1]))
        elif arg.startswith("--config-name="):
            name = arg.split("=", 1)[1]
        elif not arg.startswith("hydra."):
            overrides.append(arg)
    # A recipe or a user's primary config lives in a --config-dir and names the groups of config_dir;
    # the default config is config_dir's, and a user's directory adds group options after it.
    primary = user_dirs[-1] if name != default_name and user_dirs else config_dir
    search = [d for d in (config_dir, *user_dirs) if d != primary]
    if search:
        overrides.append(f"hydra.searchpath=[{','.join(f'file://{d}' for d in search)}]")
    config_dirs = [config_dir, *user_dirs]
    try:
        return _compose(primary, name, overrides)
    except ConfigCompositionException as err:
        raise unknown_override(err, overrides, config_dirs, lambda rest: _compose(primary, name, rest)) from None


def _compose(config_dir: Path, name: str, overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(name, overrides=overrides)


def unknown_override(
    err: ConfigCompositionException, overrides: list[str], config_dirs: Sequence[Path], compose_without: Any
) -> Exception:
    """The :class:`ConfigError` for Hydra's "Could not override 'KEY'", or ``err`` itself for another failure."""
    match = re.search(r"Could not override '([^']+)'", str(err))
    if match is None:
        return err
    key = match.group(1)
    given = next((o for o in overrides if o.lstrip("+~").partition("=")[0] == key), f"{key}=...")
    value = given.partition("=")[2]
    hints = [*_group_hints(key, value, config_dirs)]
    try:
        rest = compose_without([o for o in overrides if o != given])
    except Exception:  # another bad override: the hints from the groups alone
        rest = None
    tree = OmegaConf.to_container(rest, resolve=False) if rest is not None else None
    parent, _, _ = key.rpartition(".")
    if tree is not None:
        near = difflib.get_close_matches(key, list(_keys(tree)), n=3, cutoff=0.85)
        siblings = [k for k in near if k.rpartition(".")[0] == parent]  # data.seqlen: data's keys first
        hints += [f"{k}={value}" for k in siblings or near]
    message = f"{given}: the config has no key {key!r}"
    if hints:
        message += f"; did you mean {' or '.join(dict.fromkeys(hints))}"
    elif tree is not None:
        node = OmegaConf.select(rest, parent) if parent else rest
        if isinstance(node, DictConfig):
            message += f"; {parent + ' has' if parent else 'its top-level keys are'}: {', '.join(map(str, node))}"
    root = key.split(".", 1)[0]
    if root in OPEN_NODES and "." in key and not any("group sets" in h for h in hints):
        message += f" (to pass {OPEN_NODES[root]} the config does not list: +{given})"
    return ConfigError(message)


def _group_hints(key: str, value: str, config_dirs: Sequence[Path]) -> Iterator[str]:
    """``group=option`` where an option of a group sets ``key``'s last part to ``value``, or the group of that name."""
    leaf = key.rsplit(".", 1)[-1]
    for group in sorted({p.name for d in config_dirs if d.is_dir() for p in d.iterdir() if p.is_dir()}):
        options = {p.stem: p for d in config_dirs for p in sorted((d / group).glob("*.yaml"))}
        valid = f"valid: {', '.join(options)}"
        setting = [
            (option, found[0]) for option, path in options.items() if (found := _setting(path, leaf))[1] == value
        ]
        if setting:
            option, name = setting[0]
            yield f"{group}={option} (the {group} group sets {name}; {valid})"
        elif options and difflib.get_close_matches(leaf, [group], cutoff=0.85):
            near = difflib.get_close_matches(value.replace("-", "_").lower(), list(options), n=1, cutoff=0.6)
            yield f"{group}={near[0] if near else '...'} ({valid})"


def _setting(path: Path, key: str) -> tuple[str, str | None]:
    """The key of an option file spelled ``key`` or nearly so, and the value it gives it (a string)."""
    try:
        node = OmegaConf.load(path)
    except Exception:  # (a file Hydra would refuse names itself when composed)
        return key, None
    near = (
        difflib.get_close_matches(key, [str(k) for k in node], n=1, cutoff=0.85) if isinstance(node, DictConfig) else []
    )
    value = node.get(near[0]) if near else None
    return (near[0] if near else key), (None if value is None or isinstance(value, DictConfig) else str(value))


def _keys(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _keys(v, f"{prefix}{k}.")
        if prefix:
            yield prefix[:-1]
    elif prefix:
        yield prefix[:-1]
