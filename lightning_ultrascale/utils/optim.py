"""Optimizer helpers that do not depend on the layout."""

from __future__ import annotations

import torch


@torch.no_grad()
def initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of every parameter that has none, so a checkpoint can be saved from or loaded into it.

    A step with zero gradients at ``lr=0`` (what ``torch.distributed.checkpoint.state_dict`` does):
    it changes no parameter, and states that already exist sit it out (their gradients are set
    aside). A collective where step hooks are (a sharded optimizer's all-gather): every rank calls it.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state for p in params):
        return
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = None if p in optimizer.state else torch.zeros_like(p)
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad
