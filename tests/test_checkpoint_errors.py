"""Checkpoint mistakes and accidents named in the user's words, on every rank (issue #45 point 4).

    split save_dir      ranks that pass different save_dir (or tag) are refused before anything is
                        written, each rank's named
    interrupted save    a rank hit by SIGINT or SIGTERM mid-save tells the others, which name it and
                        its signal; one killed is named as gone; `latest` keeps the previous tag
    truncated shard     the load error names the newest intact tag and the call that loads it

Two gloo ranks (tests/test_checkpoint.py covers the format, resharding and the other bad inputs).
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)


def _engine():
    import fz3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    return fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                          fz3.Config(param_persistence_threshold=0))


def _step(engine, rank: int, i: int) -> None:
    g = torch.Generator().manual_seed(10 * i + rank)
    engine.backward(engine(torch.randn(4, 8, generator=g)).square().mean())
    engine.step()


def _attempt(call) -> str | None:
    from fz3.io.checkpoint import CheckpointError
    try:
        call()
    except CheckpointError as e:
        return str(e)
    return None


# ---- split save_dir, truncated shard (one launch) ------------------------------------------------

def _split_and_truncated(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    engine = _engine()
    _step(engine, rank, 0)
    out = {"dir": _attempt(lambda: engine.save_checkpoint(f"{root}/run-{rank}")),  # HelloDeepSpeed's clock
           "tag": _attempt(lambda: engine.save_checkpoint(f"{root}/same", tag=f"t{rank}")),
           "both": _attempt(lambda: engine.save_checkpoint(f"{root}/x{rank}", tag=f"t{rank}")),
           "written": sorted(os.listdir(root))}
    ckpt = f"{root}/ckpt"
    engine.save_checkpoint(ckpt, tag="a")  # the engine is as it was: the next save works
    at_a = engine.full_state_dict()
    _step(engine, rank, 1)
    engine.save_checkpoint(ckpt, tag="b")
    dist.barrier()
    if rank == 0:
        path = f"{ckpt}/b/rank_00001.pt"
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    dist.barrier()
    out["truncated"] = _attempt(lambda: engine.load_checkpoint(ckpt))
    out["loaded"], _ = engine.load_checkpoint(ckpt, tag="a")  # what the message says to do
    now = engine.full_state_dict()
    out["equal_a"] = all(torch.equal(now[k], at_a[k]) for k in at_a)
    return out


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("split"))
    return root, launch.run(_split_and_truncated, world_size=2, args=(root,), timeout=200)


def test_ranks_that_give_different_save_dirs_are_named_and_nothing_is_written(split_runs):
    root, outs = split_runs
    for out in outs:
        msg = out["dir"]
        assert msg is not None and msg.startswith(
            f"save_checkpoint: the ranks gave different save_dir: rank 0: save_dir '{root}/run-0'; rank 1: "
            f"save_dir '{root}/run-1'. Every rank must pass the same save_dir and tag"), msg
        assert "torch.distributed.broadcast_object_list" in msg and msg.endswith("nothing was written"), msg
        assert "Parent directory" not in msg
        assert out["tag"].startswith("save_checkpoint: the ranks gave different tag: rank 0: tag 't0'; rank 1: "
                                     "tag 't1'."), out["tag"]
        assert out["both"].startswith(f"save_checkpoint: the ranks gave different save_dir and tag: rank 0: "
                                      f"save_dir '{root}/x0', tag 't0'; rank 1: save_dir '{root}/x1', tag 't1'."), \
            out["both"]
        assert out["written"] == []  # no folder of any of them


def test_a_truncated_shard_names_the_newest_intact_tag_and_how_to_load_it(split_runs):
    root, outs = split_runs
    ckpt = f"{root}/ckpt"
    for out in outs:
        msg = out["truncated"]
        assert f"checkpoint file {ckpt}/b/rank_00001.pt is" in msg and "(truncated or overwritten)" in msg, msg
        assert msg.endswith(f". The newest intact checkpoint in {ckpt!r} is tag 'a' (optimizer step 1): load it "
                            f"with engine.load_checkpoint({ckpt!r}, tag='a')"), msg
        assert out["loaded"] == f"{ckpt}/a" and out["equal_a"]


def test_newest_intact_skips_damaged_tags_and_says_when_none_is_left(tmp_path):
    from fz3.io.checkpoint import META
    from fz3.io.checkpoint_load import newest_intact
    for tag, steps in (("early", 1), ("late", 5), ("torn", 9)):
        os.makedirs(tmp_path / tag)
        (tmp_path / tag / "rank_00000.pt").write_bytes(b"12345")
        meta = {"format": "fz3-zero3-checkpoint", "version": 1, "world_size": 1, "params": [], "fingerprint": "",
                "state_dict": [], "optimizer_steps": steps, "grads": {},
                "files": {"rank_00000.pt": 5 if tag != "torn" else 9}}
        (tmp_path / tag / META).write_text(json.dumps(meta))
    d = str(tmp_path)
    assert newest_intact(d).startswith(f"The newest intact checkpoint in {d!r} is tag 'late' (optimizer step 5)")
    assert "is tag 'early'" in newest_intact(d, besides=f"{d}/late")
    (tmp_path / "early" / "rank_00000.pt").write_bytes(b"1")
    assert newest_intact(d, besides=f"{d}/late") == \
        f"No other tag in {d!r} is intact (tags present: ['early', 'late', 'torn'])"


# ---- a rank interrupted or killed mid-save -------------------------------------------------------

def _interrupted(rank: int, world: int, root: str, how: str) -> None:
    """Saves tag "a"; at tag "b" rank 1 writes half its file, then is interrupted (`how`). Rank 0
    writes down what it got. (Files: a rank that leaves fails launch.run, results and all.)"""
    from fz3.io import checkpoint
    if how == "SIGINT":  # Python's own handler, as in a terminal: a shell's background job starts
        signal.signal(signal.SIGINT, signal.default_int_handler)  # with SIGINT ignored (CI under nohup ... &)
    engine = _engine()
    _step(engine, rank, 0)
    engine.save_checkpoint(root, tag="a")
    _step(engine, rank, 1)
    real = checkpoint.write_rank

    def interrupted(eng, path, *rest):
        real(eng, path, *rest)
        if eng.rank == 1:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            os.kill(os.getpid(), getattr(signal, how))
            time.sleep(5)  # the signal's handler runs first
    checkpoint.write_rank = interrupted
    t0 = time.monotonic()
    try:
        engine.save_checkpoint(root, tag="b")
        out = {"error": None}
    except BaseException as e:  # noqa: BLE001 - rank 1's KeyboardInterrupt too: written down, raised on
        out = {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}
        if isinstance(e, KeyboardInterrupt):
            _write_down(root, rank, out)
            raise
    _write_down(root, rank, out)


def _write_down(root: str, rank: int, out: dict) -> None:
    out["latest"] = open(f"{root}/latest").read()
    out["listing"] = sorted(n for n in os.listdir(root) if not n.endswith(".json"))
    with open(f"{root}/rank{rank}.json", "w") as f:
        json.dump(out, f)


@pytest.mark.parametrize("how, words", [
    ("SIGINT", "rank 1 was interrupted by SIGINT (KeyboardInterrupt, Ctrl-C)"),
    ("SIGTERM", "rank 1 was interrupted by SIGTERM"),
    ("killed", "rank 1 left: its process ended (killed, or stopped by a signal it could not report) while this "
               "rank waited for it (")])
def test_a_rank_interrupted_mid_save_is_named_with_its_signal_and_latest_stays(tmp_path, how, words):
    root = str(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="a rank failed") as failed:
        launch.run(_interrupted, world_size=2, args=(root, how), timeout=120)
    assert time.monotonic() - t0 < 90
    out = json.load(open(f"{root}/rank0.json"))
    assert out["error"] is not None and out["seconds"] < 60, out
    assert out["error"].startswith(f"CheckpointError: save_checkpoint({root!r}, tag='b'): writing {root}/.tmp-b "
                                   f"failed: {words}"), out["error"]
    assert out["error"].endswith(f"; nothing was published: {root}/latest still names tag 'a'"), out["error"]
    assert "Connection closed" not in out["error"].split("(")[0]
    assert out["latest"] == "a" and out["listing"] == ["a", "latest"], out  # the partial .tmp-b removed
    if how == "SIGINT":  # rank 1 goes on raising KeyboardInterrupt once rank 0 knows
        assert "rank 1:" in str(failed.value) and "KeyboardInterrupt" in str(failed.value)
        rank1 = json.load(open(f"{root}/rank1.json"))
        assert rank1["error"].startswith("KeyboardInterrupt"), rank1
    else:
        assert not os.path.exists(f"{root}/rank1.json")  # it ended by its signal, as without fz3
