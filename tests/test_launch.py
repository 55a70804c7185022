"""spawn: return values in rank order, child errors and hangs surface in the parent."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import hybridpar


def _rank_and_env():
    return {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
            "addr": os.environ["MASTER_ADDR"], "threads": torch.get_num_threads()}


def test_children_see_the_torchrun_variables_and_return_in_rank_order():
    out = hybridpar.spawn(_rank_and_env, 3, timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["addr"] == "127.0.0.1" and o["threads"] == 1 for o in out)


def _fail_on_rank_one():
    hybridpar.init()
    if dist.get_rank() == 1:
        raise KeyError("the original error")
    dist.barrier()  # rank 0 would wait here forever without the parent's clean-up


def test_an_exception_in_a_child_is_reraised_with_its_rank_and_traceback():
    start = time.monotonic()
    with pytest.raises(hybridpar.SpawnError, match="rank 1 failed") as info:
        hybridpar.spawn(_fail_on_rank_one, 2, timeout=60)
    assert "KeyError: 'the original error'" in info.value.trace
    assert "_fail_on_rank_one" in info.value.trace
    assert time.monotonic() - start < 30


def _hang():
    time.sleep(600)


def test_a_child_that_hangs_fails_the_call_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(hybridpar.SpawnTimeout, match=r"ranks \[0, 1\] of 2 did not finish"):
        hybridpar.spawn(_hang, 2, timeout=2)
    assert time.monotonic() - start < 20


def _die():
    os._exit(3)


def test_a_child_that_dies_without_a_traceback_is_reported():
    with pytest.raises(hybridpar.SpawnError, match="exited with code 3"):
        hybridpar.spawn(_die, 2, timeout=30)


def test_nprocs_must_be_positive():
    with pytest.raises(ValueError, match="nprocs must be a positive integer"):
        hybridpar.spawn(_rank_and_env, 0)
