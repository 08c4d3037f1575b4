"""Test-wide setup.

Multi-process tests fork gloo workers (lightning_ultrascale.testing.run_workers). Forking is only
safe while the parent has not started its intra-op thread pool, and is fastest when the parent
has already imported the distributed packages the workers use (0.25 s instead of 10 s for two
workers), so both happen here, before any test module runs.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)

# Without a GPU, Triton kernels (lightning_ultrascale.kernels) run in Triton's interpreter on CPU
# tensors. Triton reads this when a kernel is defined, so before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed.fsdp  # noqa: E402
import torch.distributed.pipelining  # noqa: E402
import torch.distributed.tensor  # noqa: E402
