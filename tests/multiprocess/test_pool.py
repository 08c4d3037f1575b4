"""The suite's warm workers (lightning_ultrascale/testing/pool.py): a job finds the process as a fresh one
would, and a job that could leave the workers unusable gets fresh ones for the next."""

import os

import pytest
import torch
import torch.distributed as dist

from lightning_ultrascale.testing import WorkerError, run_pooled, worker_pools


def _pid() -> int:
    return os.getpid()


def _change_the_process(where: str) -> None:
    os.environ["ULTRASCALE_POOL_TEST"] = "set by a job"
    os.chdir(where)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(1234)


def _what_a_job_sees() -> tuple:
    return (
        os.environ.get("ULTRASCALE_POOL_TEST"), os.getcwd(), torch.get_default_dtype(), torch.is_grad_enabled(),
        torch.rand(2).tolist(),
    )  # fmt: skip


def test_a_job_finds_the_process_as_the_one_before_it_left_it_not_as_it_changed_it(tmp_path):
    with worker_pools():
        before = run_pooled(_what_a_job_sees, 2)
        pids = run_pooled(_pid, 2)
        run_pooled(_change_the_process, 2, str(tmp_path))
        assert run_pooled(_what_a_job_sees, 2) == before
        assert run_pooled(_pid, 2) == pids  # (the same warm processes)


def _raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("on purpose")


def _one_more_collective_on_rank_0() -> None:
    group = dist.new_group()
    dist.all_reduce(torch.ones(1), group=group)
    if dist.get_rank() == 0:  # issued, never matched: the next job's collectives would pair with it
        dist.all_reduce(torch.ones(1), group=group, async_op=True)


def test_a_job_that_raised_or_left_its_groups_uneven_hands_the_next_job_fresh_workers():
    with worker_pools():
        pids = run_pooled(_pid, 2)
        with pytest.raises(WorkerError, match="on purpose"):
            run_pooled(_raise_on_rank_1, 2)
        fresh = run_pooled(_pid, 2)
        assert not set(fresh) & set(pids)
        assert run_pooled(_pid, 2) == fresh  # a healthy job keeps them
        run_pooled(_one_more_collective_on_rank_0, 2)
        assert not set(run_pooled(_pid, 2)) & set(fresh)


def test_a_pool_whose_port_was_taken_before_its_group_formed_starts_on_another(monkeypatch):
    # Another process (a second lane of the suite) may bind the free port before the pool's rank 0 does: seen as
    # a worker that exited before its first job (a broken pipe). The pool now waits for its group, and retries.
    import socket

    from lightning_ultrascale.testing import pool

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = pool.free_port
    monkeypatch.setattr(pool, "free_port", lambda: next(ports, None) or real())
    try:
        with worker_pools():
            assert len(set(run_pooled(_pid, 2))) == 2
    finally:
        taken.close()
