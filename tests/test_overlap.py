"""bench/systems/overlap.py: the share of a traced step's communication hidden behind compute,
on hand-made chrome traces (device kernels; host ops when there are none)."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from systems.overlap import hidden  # noqa: E402


def _trace(tmp_path, events) -> str:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", **e} for e in events]}))
    return str(path)


def test_kernels_hidden_behind_compute(tmp_path):
    got = hidden(_trace(tmp_path, [
        {"cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "ampere_sgemm_128x64", "ts": 50, "dur": 100},   # covers 50 of its 100
        {"cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum", "ts": 200, "dur": 40},  # alone
        {"cat": "kernel", "name": "vectorized_elementwise_kernel", "ts": 60, "dur": 20},  # inside the gemm
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # host ops do not count beside kernels
    ]))
    assert got["source"] == "device kernels" and got["comm_events"] == 2
    assert (got["comm_us"], got["hidden_us"], got["compute_us"]) == (140, 50, 100)
    assert abs(got["hidden_fraction"] - 50 / 140) < 1e-12


def test_host_ops_stand_in_without_kernels(tmp_path):
    got = hidden(_trace(tmp_path, [
        {"cat": "cpu_op", "name": "c10d::allgather_", "ts": 0, "dur": 100, "tid": 1},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 10, "dur": 20, "tid": 1},  # inside the collective
        {"cat": "cpu_op", "name": "aten::mm", "ts": 90, "dur": 30, "tid": 2},  # another thread: 10 hidden
    ]))
    assert got["source"].startswith("host ops") and (got["comm_us"], got["hidden_us"]) == (100, 10)


def test_no_communication(tmp_path):
    got = hidden(_trace(tmp_path, [{"cat": "kernel", "name": "gemm", "ts": 0, "dur": 5}]))
    assert got["comm_us"] == 0 and got["hidden_fraction"] is None
