"""Pipeline parallelism: stage split, schedules (via torch.distributed.pipelining) and the simulator."""

from lightning_ultrascale.parallel.pipeline.parallel import PipelineParallel
from lightning_ultrascale.parallel.pipeline.schedules import SCHEDULES, stage_ranks
from lightning_ultrascale.parallel.pipeline.split import balance_stages, piece_costs, plan_stages

__all__ = ["SCHEDULES", "PipelineParallel", "balance_stages", "piece_costs", "plan_stages", "stage_ranks"]
