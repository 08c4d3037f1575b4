"""The planner: which layout to run, and what it puts on each rank, predicted without processes.

``search`` prices every valid layout of a workload on N GPUs with the cost model (``estimate``:
per-rank memory, communication per mesh dim, step time and MFU on a ``Hardware`` profile) and
ranks those that fit.

``predict_shards`` composes each plugin's pure :meth:`~lightning_ultrascale.parallel.plugin.ParallelPlugin.plan_shards`
in the strategy's fixed order; ``dry_run`` builds the real model on the meta device and applies
the real plugins in one process under torch's fake process group, at any world size (thousands of
ranks in seconds), and reports what one rank holds. The two must agree parameter by parameter.

Example:
    >>> from lightning_ultrascale import TensorParallel, UltraScaleStrategy, ZeRO
    >>> from lightning_ultrascale.models import build_model
    >>> model = build_model("llama3_70b", device="meta")
    >>> plan = predict_shards(UltraScaleStrategy(TensorParallel(8), ZeRO(3)), model, world_size=64, rank=0)
    >>> f"{plan.numel / 1e9:.2f} B parameters on rank 0"
    '1.10 B parameters on rank 0'
"""

from lightning_ultrascale.plan.candidate import Candidate
from lightning_ultrascale.plan.cost import Cost, Workload, estimate, expert_load
from lightning_ultrascale.plan.hardware import GPUS, Hardware, get_hardware
from lightning_ultrascale.plan.search import NoLayoutFits, Priced, SearchResult, search
from lightning_ultrascale.plan.shards import dry_run, predict_shards

__all__ = [
    "GPUS",
    "Candidate",
    "Cost",
    "Hardware",
    "NoLayoutFits",
    "Priced",
    "SearchResult",
    "Workload",
    "dry_run",
    "estimate",
    "expert_load",
    "get_hardware",
    "predict_shards",
    "search",
]
