"""fz3.timeline (fz3/observe/timeline.py): one Chrome trace-event file for every rank, with lanes
for compute, communication and the core and a live-bytes counter, whose spans agree with
engine.stats(); nothing left on the engine afterwards; bad paths named; the PNG drawn by
python -m fz3 timeline."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fz3 import launch

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(rank: int, world: int, path: str) -> dict:
    import fz3
    from gpt import GPT, GPTConfig, loss_fn, markov_batch
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, d_model=32, n_head=4, n_layer=2, seq=8))
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            fz3.Config(param_persistence_threshold=0, reduce_bucket_size=3000))
    x, y = markov_batch(0, batch=2 * world, seq=8, vocab=64)
    mine = slice(2 * rank, 2 * rank + 2)
    engine.backward(loss_fn(engine(x[mine]), y[mine]))  # a step before: the counts below are the block's
    engine.step()
    before, door = dict(engine.stats()), vars(engine)["update"]
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    with fz3.timeline(engine, path):
        for _ in range(2):
            engine.backward(loss_fn(engine(x[mine]), y[mine]))
            engine.step()
    after = dict(engine.stats())
    left = {"engine": [] if vars(engine)["update"] is door else ["update"],
            "interp": sorted(k for k in vars(engine.interp) if k in ("run", "_complete_oldest")),
            "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) - hooks}
    names = [n or "<root>" for n in engine.tables.module_names]
    return {"delta": {k: after[k] - before[k] for k in ("all_gather", "reduce")}, "peak": after["peak_live_numel"],
            "left": left, "names": names}


def test_one_file_with_every_rank_and_lane_agreeing_with_stats(tmp_path):
    path = str(tmp_path / "run.json")
    ranks = launch.run(_train, world_size=2, args=(path,), timeout=240)
    events = json.load(open(path))["traceEvents"]
    meta = {(e["pid"], e.get("tid"), e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] != "process_sort_index"}
    for r in (0, 1):
        assert (r, None, f"rank {r}") in meta
        assert {(r, 1, "compute"), (r, 2, "communication"), (r, 3, "core")} <= meta
    for r, out in enumerate(ranks):
        assert out["left"] == {"engine": [], "interp": [], "hooks": 0}, out["left"]  # off: nothing stays
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == r]
        assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
        by_lane = {t: [e["name"] for e in spans if e["tid"] == t] for t in (1, 2, 3)}
        for name in out["names"]:  # every module called ran forward twice (a ModuleList is not called)
            if name == "blocks":
                continue
            assert by_lane[1].count(f"{name} forward") == 2, (name, by_lane[1])
        # every Linear's backward ends at the grad that releases it ([Note: released by its grads])
        assert by_lane[1].count("blocks.0.proj backward") == 2, [n for n in by_lane[1] if "backward" in n]
        assert any(n.endswith(" backward") for n in by_lane[1])
        gathers = [n for n in by_lane[2] if n.startswith("all-gather")]
        assert len(gathers) == out["delta"]["all_gather"], (gathers, out["delta"])
        assert by_lane[2].count("reduce") == out["delta"]["reduce"] > 0
        assert {"Enter", "Leave", "PreBackwardRan", "GradReady", "BackwardEnded",
                "Stepped"} <= set(by_lane[3]), set(by_lane[3])
        live = [e["args"]["live bytes"] for e in events if e["ph"] == "C" and e["pid"] == r]
        assert live and 0 < max(live) <= out["peak"] * 4


@pytest.mark.parametrize("where, message", [
    ("missing/run.json", "does not exist"),
    (".", "is a directory"),
])
def test_a_path_that_cannot_be_written_is_named(tmp_path, where, message):
    import fz3
    from fz3.observe.timeline import TimelineError
    path = str(tmp_path / where) if where != "." else str(tmp_path)
    with pytest.raises(TimelineError, match=message):
        with fz3.timeline(object(), path):
            pass


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fz3", "timeline", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)


def test_the_picture(tmp_path):
    path, png = str(tmp_path / "run.json"), str(tmp_path / "run.png")
    launch.run(_train, world_size=2, args=(path,), timeout=240)
    got = _cli(path, png)
    assert got.returncode == 0, got.stderr
    assert "2 ranks" in got.stdout
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_picture_of_a_bad_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for args, message in (((str(bad), str(tmp_path / "x.png")), "no traceEvents"),
                          ((str(tmp_path / "none.json"), str(tmp_path / "x.png")), "cannot read")):
        got = _cli(*args)
        assert got.returncode == 2 and message in got.stderr and "Traceback" not in got.stderr, got.stderr
