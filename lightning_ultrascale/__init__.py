"""lightning_ultrascale: the Ultra-Scale Playbook's parallelism techniques as Lightning strategy plugins.

Example:
    >>> import lightning as L
    >>> from lightning_ultrascale import DataParallel, LlamaModule, UltraScaleDataModule, UltraScaleStrategy
    >>> trainer = L.Trainer(strategy=UltraScaleStrategy(DataParallel()), accelerator="cpu", devices=2)  # doctest: +SKIP
    >>> data = UltraScaleDataModule(seq_len=256, micro_batch_size=8)
    >>> trainer.fit(LlamaModule("llama_tiny"), datamodule=data)  # doctest: +SKIP

Under Lightning Fabric the same plugins go to :class:`FabricStrategy` (``lightning_ultrascale.core.fabric``):

    >>> from lightning_ultrascale import FabricStrategy, ZeRO
    >>> fabric = L.Fabric(strategy=FabricStrategy(ZeRO(stage=3)), accelerator="cpu", devices=2)
"""

from importlib import metadata as _metadata

from lightning_ultrascale.core.fabric import FabricStrategy
from lightning_ultrascale.core.strategy import UltraScaleStrategy
from lightning_ultrascale.data import UltraScaleDataModule
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.fp8.precision import FP8Precision
from lightning_ultrascale.models import LlamaConfig, build_model, get_model_config
from lightning_ultrascale.parallel.compile import Compile
from lightning_ultrascale.parallel.context import ContextParallel
from lightning_ultrascale.parallel.data import DataParallel, ZeRO
from lightning_ultrascale.parallel.dims import ParallelDims
from lightning_ultrascale.parallel.expert import ExpertParallel
from lightning_ultrascale.parallel.muon import Muon, muon_param_groups
from lightning_ultrascale.parallel.pipeline import PipelineParallel
from lightning_ultrascale.parallel.recompute import Recompute
from lightning_ultrascale.parallel.tensor import TensorParallel
from lightning_ultrascale.training.hf_module import HFCausalLMModule
from lightning_ultrascale.training.module import LlamaModule, OptimConfig

try:
    __version__ = _metadata.version("lightning-ultrascale")  # the installed distribution's, so one number in one place
except _metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "Compile",
    "ConfigError",
    "ContextParallel",
    "DataParallel",
    "ExpertParallel",
    "FP8Precision",
    "FabricStrategy",
    "HFCausalLMModule",
    "LlamaConfig",
    "LlamaModule",
    "Muon",
    "OptimConfig",
    "ParallelDims",
    "PipelineParallel",
    "Recompute",
    "TensorParallel",
    "UltraScaleDataModule",
    "UltraScaleStrategy",
    "ZeRO",
    "build_model",
    "get_model_config",
    "muon_param_groups",
]
