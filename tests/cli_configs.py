"""The training config the command line composes: shared by the unit, multi-process and end-to-end tiers."""

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lightning_ultrascale.cli.train import CONFIG_DIR, hydra_argv


def compose_train(*overrides: str) -> DictConfig:
    """The config ``ultrascale-train`` composes from these overrides (its argv rewriting included)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=hydra_argv(list(overrides)))
