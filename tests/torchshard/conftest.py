"""torchshard's ported tests: each test gets a free port for its ranks' rendezvous, and
their ``mp.spawn`` starts the ranks from a forkserver (ts_launch.py says why)."""

import os
import socket
import sys
from pathlib import Path

import pytest
import torch.multiprocessing

sys.path.insert(0, str(Path(__file__).parent))   # `from ts_testing import ...` in the ranks

import ts_launch  # on the path just above


@pytest.fixture(autouse=True)
def free_port(monkeypatch):
    monkeypatch.setattr(torch.multiprocessing, "spawn", ts_launch.spawn)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HYBRIDPAR_TS_PORT", str(port))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield port
    os.environ.pop("HYBRIDPAR_TS_PORT", None)


_MISSES_THRESHOLD = {
    "test_parallel_transformer_block":
        "misses torchshard's own 1e-6 threshold on CPU (diff 1.9e-6, float32 sums in another "
        "order); torchshard 0.1.0 itself misses it on CPU (diff 1.4e-6)",
}


# Passes or misses the 1e-6 threshold by an ulp or two of a float32 loss depending on the CPU
# and the thread count (the GEMM kernels' summation order): on a 2-core Intel Xeon with one
# thread per rank it misses by 9e-7 (diff 1.9e-6), and torchshard 0.1.0 itself misses it
# there (and both cross-entropy tests); with two threads, or on an AMD EPYC, it passes. The
# failure reaches pytest as the ranks' ProcessRaisedException, so the mark cannot single out
# that assertion: it covers the whole test.
_MAY_MISS_THRESHOLD = {
    "test_parallel_cross_entropy_within_ddp_mode_and_row_parallel":
        "the summed float32 loss misses torchshard's 1e-6 threshold by an ulp or two on some "
        "CPUs and thread counts (diff 1.9e-6 on an Intel Xeon, 1 thread), as torchshard 0.1.0 "
        "itself does there",
}


def pytest_collection_modifyitems(items):
    for item in items:
        reason = _MISSES_THRESHOLD.get(item.name)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
        reason = _MAY_MISS_THRESHOLD.get(item.name)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(strict=False, reason=reason))
