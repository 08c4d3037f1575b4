"""Data parallelism: plain DP and ZeRO 1-3 (HSDP), as gradient-sync engines per parameter group."""

from lightning_ultrascale.parallel.data.zero import DataParallel, ZeRO

__all__ = ["DataParallel", "ZeRO"]
