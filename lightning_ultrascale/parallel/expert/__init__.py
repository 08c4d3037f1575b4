"""Expert parallelism: MoE experts split over the ``ep`` ranks, tokens sent to their experts by all-to-all."""

from lightning_ultrascale.parallel.expert.parallel import ExpertParallel

__all__ = ["ExpertParallel"]
