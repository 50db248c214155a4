"""engine.save_checkpoint / load_checkpoint and python -m fz3.consolidate (issue #11).

Four launches, in order, each doing several checks (one process start per rank each):

    W=1  reference run A1 (4 windows, saved after 2)          -> ckpt/1/<model>
    W=2  reference run A2 (saved after 2) -> ckpt/2/<model>; resume from ckpt/2 (same world
         size: bit for bit); resume from ckpt/1 (1->2); atomicity; every bad-input error
    W=3  reference run A3 -> ckpt/3/<model>; resume from ckpt/2 (2->3)
    W=2  resume from ckpt/3 (3->2)

Models: "gpt" (tied embeddings, bool buffers) and "odd" (odd numels, a 0-dim param, numels
below the world size), AdamW in two param groups, a LambdaLR scheduler, gas 2, no persistence.
A resumed run at another world size must load exactly the saved params and optimizer state,
then train at parity (fp32 tolerance) with the uninterrupted W=1 run.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fz3.config.config import Config
from fz3.launch import run
from tests.support.parity import make_optimizer, make_scheduler
from tests.support.parity_models import MODELS, rank_slice

NAMES = ("gpt", "odd")
GAS, BEFORE, AFTER = 2, 2, 2  # windows before the save, after it
CFG = Config(param_persistence_threshold=0, gradient_accumulation_steps=GAS)
TIMEOUT = 180


# ---- the rank side ------------------------------------------------------------------------------

def _engine(name: str, model=None):
    import fz3
    model = MODELS[name].build() if model is None else model
    opt = make_optimizer("adamw", model)
    return fz3.initialize(model, opt, CFG, lr_scheduler=make_scheduler(opt))


def _train(name: str, engine, rank: int, world: int, windows: range) -> list[float]:
    spec, losses = MODELS[name], []
    for w in windows:
        for k in range(GAS):
            i = w * GAS + k
            loss = spec.loss(engine, rank_slice(spec.batch(i), rank, world), i)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _snapshot(engine) -> dict:
    """What a checkpoint must carry: full params, this rank's optimizer state by ParamId, the
    group options, the scheduler, the counters."""
    opt = {p: {k: v.clone() for k, v in engine.optimizer.state[m].items()}
           for p, m in enumerate(engine.store.masters) if m in engine.optimizer.state}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    return {"params": engine.full_state_dict(), "opt": opt, "groups": groups,
            "sched": engine.lr_scheduler.state_dict(), "steps": engine.optimizer_steps,
            "numels": [p.numel for p in engine.spec.params]}


def _reference(name: str, rank: int, world: int, save_dir: str) -> dict:
    engine = _engine(name)
    losses = _train(name, engine, rank, world, range(BEFORE))
    engine.save_checkpoint(save_dir, client_state={"epoch": 3, "t": torch.arange(3)})
    saved = _snapshot(engine)
    losses += _train(name, engine, rank, world, range(BEFORE, BEFORE + AFTER))
    return {"losses": losses, "saved": saved, "final": engine.full_state_dict()}


def _resume(name: str, rank: int, world: int, load_dir: str) -> dict:
    engine = _engine(name)
    for g in engine.optimizer.param_groups:  # options the checkpoint must overwrite
        g["weight_decay"], g["lr"] = 0.5, 1.0
    path, client = engine.load_checkpoint(load_dir)
    loaded = _snapshot(engine)
    losses = _train(name, engine, rank, world, range(BEFORE, BEFORE + AFTER))
    return {"path": path, "client": client, "loaded": loaded, "losses": losses,
            "final": engine.full_state_dict()}


def _launch_1(rank: int, world: int, root: str) -> dict:
    return {n: _reference(n, rank, world, f"{root}/1/{n}") for n in NAMES}


def _launch_2(rank: int, world: int, root: str) -> dict:
    out = {"ref": {n: _reference(n, rank, world, f"{root}/2/{n}") for n in NAMES}}
    out["same"] = {n: _resume(n, rank, world, f"{root}/2/{n}") for n in NAMES}
    out["from1"] = {n: _resume(n, rank, world, f"{root}/1/{n}") for n in NAMES}
    out["atomic"] = _atomicity(rank, world, f"{root}/atomic")
    out["errors"] = _errors(rank, world, root)
    return out


def _launch_3(rank: int, world: int, root: str) -> dict:
    return {"ref": {n: _reference(n, rank, world, f"{root}/3/{n}") for n in NAMES},
            "from2": {n: _resume(n, rank, world, f"{root}/2/{n}") for n in NAMES}}


def _launch_4(rank: int, world: int, root: str) -> dict:
    return {"from3": {n: _resume(n, rank, world, f"{root}/3/{n}") for n in NAMES},
            "into_trained": _into_trained(rank, world, f"{root}/3/gpt"),
            "partial": _partial(rank, world, f"{root}/3/gpt")}


def _partial(rank: int, world: int, load_dir: str) -> dict:
    """DeepSpeed's load options, each on a fresh engine that trained one window first (its own
    optimizer state, scheduler and counters): the weights always load; what else loads is
    what the options say. The module-only engine has other param groups (fine-tuning)."""
    import fz3
    out = {}
    for name, options in (("no_optimizer", {"load_optimizer_states": False}),
                          ("no_scheduler", {"load_lr_scheduler_states": False}),
                          ("module_only", {"load_module_only": True})):
        model = MODELS["gpt"].build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if name == "module_only" else \
            make_optimizer("adamw", model)
        engine = fz3.initialize(model, opt, CFG, lr_scheduler=make_scheduler(opt))
        _train("gpt", engine, rank, world, range(1))
        before = _snapshot(engine)
        engine.load_checkpoint(load_dir, **options)
        out[name] = {"before": before, "after": _snapshot(engine)}
    try:
        engine.load_checkpoint(load_dir, load_module_strict=False)
    except ValueError as e:
        out["strict"] = str(e)
    return out


def _into_trained(rank: int, world: int, load_dir: str) -> list[float]:
    """Load into an engine that has trained, with every param persistent (gathered between
    steps, so their full values go stale on load) and a buffer changed: the continued losses
    must be those of a fresh engine loading the same checkpoint."""
    import fz3
    model = MODELS["gpt"].build()
    opt = make_optimizer("adamw", model)
    engine = fz3.initialize(model, opt, CFG.replace(param_persistence_threshold=100_000),
                            lr_scheduler=make_scheduler(opt))
    _train("gpt", engine, rank, world, range(BEFORE + 1))  # past the checkpoint's window
    model.blocks[0].mask.fill_(True)  # a buffer the checkpoint restores
    engine.load_checkpoint(load_dir)
    return _train("gpt", engine, rank, world, range(BEFORE, BEFORE + AFTER))


def _atomicity(rank: int, world: int, save_dir: str) -> dict:
    """A save that fails on rank 1 after writing half its file leaves tag "a" current."""
    from fz3.io import checkpoint
    from fz3.io.checkpoint import CheckpointError
    engine = _engine("odd")
    _train("odd", engine, rank, world, range(1))
    engine.save_checkpoint(save_dir, tag="a")
    at_a = engine.full_state_dict()
    _train("odd", engine, rank, world, range(1, 2))
    real = checkpoint.write_rank

    def crash(eng, path, *rest):
        real(eng, path, *rest)
        if eng.rank == 1:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            raise OSError("simulated crash while writing")
    checkpoint.write_rank = crash
    try:
        engine.save_checkpoint(save_dir, tag="b")
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        checkpoint.write_rank = real
    with open(f"{save_dir}/latest") as f:
        latest = f.read()
    tags = checkpoint.list_tags(save_dir)
    fresh = _engine("odd")
    path, _ = fresh.load_checkpoint(save_dir)
    loaded_a = fresh.full_state_dict()
    engine.save_checkpoint(save_dir, tag="b")  # the crashed save's leftovers do not get in the way
    with open(f"{save_dir}/latest") as f:
        latest_after = f.read()
    return {"error": error, "latest": latest, "tags": tags, "path": path,
            "equal": all(torch.equal(at_a[k], loaded_a[k]) for k in at_a), "latest_after": latest_after,
            "leftovers": sorted(os.listdir(save_dir))}


def _killed_mid_save(rank: int, world: int, save_dir: str) -> None:
    """Saves tag "a" (its params kept in a-params.pt), then dies (os._exit) halfway through
    writing its file of tag "b": a rank killed mid-save."""
    from fz3.io import checkpoint
    engine = _engine("odd")
    _train("odd", engine, rank, world, range(1))
    engine.save_checkpoint(save_dir, tag="a")
    torch.save(engine.full_state_dict(), f"{save_dir}/a-params.pt")
    _train("odd", engine, rank, world, range(1, 2))

    def killed(eng, path, *rest):
        with open(path, "wb") as f:
            f.write(b"PK\3\4 half a zip")
        os._exit(1)
    checkpoint.write_rank = killed
    engine.save_checkpoint(save_dir, tag="b")


def _bad_copy(rank: int, root: str, case: str, edit) -> str:
    import torch.distributed as dist
    dst = f"{root}/bad/{case}"
    if rank == 0:
        shutil.copytree(f"{root}/2/odd", dst)
        edit(dst)
    dist.barrier()
    return dst


def _truncate(path: str, size: int | None = None) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2 if size is None else size)


def _clobber_tail(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size - 200)
        f.write(b"\0" * 200)


def _edit_meta(folder: str, **changes) -> None:
    path = f"{folder}/global_step2/fz3_meta.json"
    with open(path) as f:
        meta = json.load(f)
    meta.update(changes)
    with open(path, "w") as f:
        json.dump(meta, f)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _errors(rank: int, world: int, root: str) -> dict:
    """Each bad input: the message on this rank, and whether the engine stayed as it was."""
    from torch import nn
    from fz3.io.checkpoint import CheckpointError
    step = "global_step2"
    cases = {
        "missing_rank": lambda d: os.remove(f"{d}/{step}/rank_00001.pt"),
        "extra_rank": lambda d: shutil.copy(f"{d}/{step}/rank_00001.pt", f"{d}/{step}/rank_00002.pt"),
        "truncated": lambda d: _truncate(f"{d}/{step}/rank_00001.pt"),
        "damaged_same_size": lambda d: _clobber_tail(f"{d}/{step}/rank_00001.pt"),
        "latest_missing_tag": lambda d: _write(f"{d}/latest", "global_step9"),
        "corrupt_meta": lambda d: _write(f"{d}/{step}/fz3_meta.json", '{"format": "fz3-zero3-che'),
        "world_size": lambda d: _edit_meta(d, world_size=3),
        "no_latest": lambda d: os.remove(f"{d}/latest"),
    }
    out = {}
    odd_engine = _engine("odd")
    _train("odd", odd_engine, rank, world, range(1))
    before = odd_engine.full_state_dict()

    def attempt(engine, folder, tag=None):
        try:
            engine.load_checkpoint(folder, tag)
            return "loaded"
        except CheckpointError as e:
            return str(e)
    for case, edit in cases.items():
        out[case] = attempt(odd_engine, _bad_copy(rank, root, case, edit))
    out["other_model"] = attempt(odd_engine, f"{root}/2/gpt")
    wide = MODELS["odd"].build()
    wide.c = nn.Linear(1, 4)
    out["other_shape"] = attempt(_engine("odd", wide), f"{root}/2/odd")
    after = odd_engine.full_state_dict()
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["optimizer_steps"] = odd_engine.optimizer_steps
    try:
        odd_engine.save_checkpoint(f"{root}/bad/client", client_state={"f": object()})
    except CheckpointError as e:
        out["client_state"] = str(e)
    spec = MODELS["odd"]
    loss = spec.loss(odd_engine, rank_slice(spec.batch(2), rank, world), 2)
    odd_engine.backward(loss)
    try:
        odd_engine.save_checkpoint(f"{root}/bad/mid")
    except CheckpointError as e:
        out["mid_window"] = str(e)
    return out


# ---- the test side ---------------------------------------------------------------------------------

def _full_opt(snaps: list[dict]) -> dict:
    """{(ParamId, state key): the whole value} from every rank's snapshot: shard-shaped state
    concatenated in rank order, padding dropped; `step` as it is."""
    out = {}
    for p, entry in snaps[0]["opt"].items():
        for k, v in entry.items():
            if v.ndim == 1:
                out[(p, k)] = torch.cat([s["opt"][p][k] for s in snaps])[:snaps[0]["numels"][p]]
            else:
                out[(p, k)] = v
    return out


def _mean_losses(results: list[dict]) -> torch.Tensor:
    return torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    out = {"root": root}
    out[1] = run(_launch_1, world_size=1, args=(root,), timeout=TIMEOUT)
    out[2] = run(_launch_2, world_size=2, args=(root,), timeout=TIMEOUT)
    out[3] = run(_launch_3, world_size=3, args=(root,), timeout=TIMEOUT)
    out[4] = run(_launch_4, world_size=2, args=(root,), timeout=TIMEOUT)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_same_world_size_resumes_bit_for_bit(runs, name):
    ref = [r["ref"][name] for r in runs[2]]
    res = [r["same"][name] for r in runs[2]]
    for a, b in zip(ref, res):
        assert b["losses"] == a["losses"][GAS * BEFORE:]
        for k, v in a["final"].items():
            assert torch.equal(v, b["final"][k]), k
        for p, entry in a["saved"]["opt"].items():
            for k, v in entry.items():
                assert torch.equal(v, b["loaded"]["opt"][p][k]), (p, k)
        assert b["loaded"]["groups"] == a["saved"]["groups"]  # options restored, lr included
        assert b["loaded"]["sched"] == a["saved"]["sched"]
        assert b["loaded"]["steps"] == a["saved"]["steps"] == BEFORE
        assert b["path"] == f"{runs['root']}/2/{name}/global_step{BEFORE}"
        assert b["client"]["epoch"] == 3 and torch.equal(b["client"]["t"], torch.arange(3))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("src, dst, key", [(1, 2, "from1"), (2, 3, "from2"), (3, 2, "from3")])
def test_other_world_size_loads_exactly_then_trains_at_parity(runs, name, src, dst, key):
    saver = [r[name] if src == 1 else r["ref"][name] for r in runs[src]]
    loader = [r[key][name] for r in runs[{"from1": 2, "from2": 3, "from3": 4}[key]]]
    assert len(saver) == src and len(loader) == dst
    for k, v in saver[0]["saved"]["params"].items():
        for r in loader:
            assert torch.equal(v, r["loaded"]["params"][k]), k
    want = _full_opt([s["saved"] for s in saver])
    got = _full_opt([r["loaded"] for r in loader])
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert all(r["loaded"]["groups"] == saver[0]["saved"]["groups"] for r in loader)
    uninterrupted = runs[1][0][name]
    torch.testing.assert_close(_mean_losses(loader), torch.tensor(uninterrupted["losses"][GAS * BEFORE:],
                                                                  dtype=torch.float64), rtol=1e-5, atol=1e-6)
    for k, v in uninterrupted["final"].items():
        torch.testing.assert_close(loader[0]["final"][k], v, rtol=1e-5, atol=1e-5)


def test_load_into_a_trained_engine_refreshes_persistent_params_and_buffers(runs):
    for out in runs[4]:
        torch.testing.assert_close(out["into_trained"], out["from3"]["gpt"]["losses"], rtol=1e-6, atol=1e-7)


def test_failed_save_leaves_previous_tag_current(runs):
    for r, out in enumerate(runs[2]):
        a = out["atomic"]
        assert a["error"] is not None
        assert ("simulated crash" if r == 1 else "rank(s) [1] failed") in a["error"], a["error"]
        assert a["latest"] == "a" and a["tags"] == ["a"]
        assert a["path"].endswith("/a") and a["equal"]
        assert a["latest_after"] == "b" and a["leftovers"] == ["a", "b", "latest"]


def test_rank_killed_mid_save_leaves_previous_tag_current(tmp_path):
    from fz3.consolidate import fp32_state_dict
    save_dir = str(tmp_path / "killed")
    with pytest.raises(RuntimeError, match="exited without a result"):
        run(_killed_mid_save, world_size=1, args=(save_dir,), timeout=TIMEOUT)
    assert open(f"{save_dir}/latest").read() == "a"
    assert sorted(os.listdir(save_dir)) == [".tmp-b", "a", "a-params.pt", "latest"]
    state, tied = fp32_state_dict(save_dir)  # the tag `latest` names, read whole
    want = torch.load(f"{save_dir}/a-params.pt")
    assert state.keys() == want.keys() and not tied
    assert all(torch.equal(state[k], want[k]) for k in want)


EXPECTED_ERRORS = {  # case -> text every rank's message holds (rank 1's own read error aside)
    "missing_rank": "rank_00001.pt",
    "extra_rank": "rank_00002.pt",
    "truncated": "rank_00001.pt is",
    "latest_missing_tag": "names tag 'global_step9'",
    "corrupt_meta": "fz3_meta.json is missing or corrupted",
    "world_size": "records world size 3",
    "no_latest": "no checkpoint was completed",
    "other_model": "this model has 8",
    "other_shape": "'c.weight'",
}


@pytest.mark.parametrize("case", sorted(EXPECTED_ERRORS))
def test_bad_checkpoint_raises_and_loads_nothing(runs, case):
    for out in runs[2]:
        assert EXPECTED_ERRORS[case] in out["errors"][case], out["errors"][case]
    assert all(out["errors"]["unchanged"] and out["errors"]["optimizer_steps"] == 1 for out in runs[2])


def test_a_rank_that_cannot_read_its_file_fails_every_rank(runs):
    msgs = [out["errors"]["damaged_same_size"] for out in runs[2]]
    assert "rank_00001.pt cannot be read" in msgs[1]
    assert "rank(s) [1] failed" in msgs[0]
    assert all(out["errors"]["unchanged"] for out in runs[2])


def test_save_refuses_mid_window_and_unsafe_client_state(runs):
    for out in runs[2]:
        assert "with the grads of 1 backward(s) not yet stepped" in out["errors"]["mid_window"]  # a backward, no step()
        assert "weights_only" in out["errors"]["client_state"]


def test_consolidate_tied_gpt_loads_with_load_model(runs, tmp_path):
    from safetensors.torch import load_file, load_model
    from fz3.consolidate import consolidate
    out = str(tmp_path / "gpt.safetensors")
    consolidate(f"{runs['root']}/2/gpt", out)
    saved = runs[2][0]["ref"]["gpt"]["saved"]["params"]
    flat = load_file(out)
    assert set(flat) == set(saved) - {"lm_head.weight"}  # tied: stored once, under the first key
    for k, v in flat.items():
        assert torch.equal(v, saved[k]), k
    model = MODELS["gpt"].build()
    missing, unexpected = load_model(model, out, strict=True)
    assert not missing and not unexpected
    assert model.lm_head.weight is model.wte.weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_consolidate_cli_untied_loads_strict(runs, tmp_path, capsys):
    from safetensors.torch import load_file
    from fz3.consolidate import main
    out = str(tmp_path / "odd.safetensors")
    done = subprocess.run([sys.executable, "-m", "fz3.consolidate", f"{runs['root']}/3/odd", out,
                           "--tag", f"global_step{BEFORE}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    model = MODELS["odd"].build()
    model.load_state_dict(load_file(out), strict=True)
    saved = runs[3][0]["ref"]["odd"]["saved"]["params"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert main([f"{runs['root']}/3/odd", out, "--tag", "nope"]) == 2  # a usage error, as every other
    assert "does not exist" in capsys.readouterr().err


def test_resave_of_the_latest_tag_killed_between_its_renames_loads_the_old_copy(runs, tmp_path):
    """publish() moves an existing <tag> aside to .old-<tag>, then renames .tmp-<tag> in. A kill
    between the two leaves `latest` naming a tag whose complete copy is at .old-<tag>: loading
    (here through consolidate, the same tag_folder) takes it, not an error nor the torn .tmp-."""
    from safetensors.torch import load_file
    from fz3.consolidate import consolidate
    src = f"{runs['root']}/2/gpt"
    crashed = str(tmp_path / "gpt")
    shutil.copytree(src, crashed)
    with open(os.path.join(crashed, "latest")) as f:
        tag = f.read().strip()
    os.rename(os.path.join(crashed, tag), os.path.join(crashed, f".old-{tag}"))
    os.makedirs(os.path.join(crashed, f".tmp-{tag}"))  # the new copy, not renamed in
    consolidate(src, str(tmp_path / "before.safetensors"))
    consolidate(crashed, str(tmp_path / "after.safetensors"))
    before, after = load_file(str(tmp_path / "before.safetensors")), load_file(str(tmp_path / "after.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_load_options_choose_what_loads_besides_the_weights(runs):
    saved = runs[3][0]["ref"]["gpt"]["saved"]
    for rank, out in enumerate(runs[4]):
        p = out["partial"]
        for name, case in p.items():
            if name == "strict":
                continue
            after, before = case["after"], case["before"]
            assert all(torch.equal(after["params"][k], v) for k, v in saved["params"].items()), (rank, name)
            kept_opt = name in ("no_optimizer", "module_only")
            same_opt = all(torch.equal(after["opt"][p_][k], before["opt"][p_][k])
                           for p_ in before["opt"] for k in before["opt"][p_])
            assert same_opt == kept_opt, (rank, name, "optimizer state")
            kept_sched = name in ("no_scheduler", "module_only")
            assert (after["sched"] == before["sched"]) == kept_sched, (rank, name, "scheduler")
            assert after["steps"] == (before["steps"] if name == "module_only" else saved["steps"]), (rank, name)
        assert "load_module_strict=False" in p["strict"], p["strict"]


def _bf16_resume(rank: int, world: int, save_dir: str) -> dict:
    """compute_dtype bf16: the checkpoint holds the fp32 masters; resuming refreshes the bf16
    compute shards from them, so training continues bit for bit."""
    import fz3
    cfg = CFG.replace(compute_dtype="bf16")
    model = MODELS["gpt"].build()
    engine = fz3.initialize(model, make_optimizer("adamw", model), cfg)
    _train("gpt", engine, rank, world, range(BEFORE))
    engine.save_checkpoint(save_dir)
    ref = _train("gpt", engine, rank, world, range(BEFORE, BEFORE + AFTER))
    model = MODELS["gpt"].build()
    resumed = fz3.initialize(model, make_optimizer("adamw", model), cfg)
    resumed.load_checkpoint(save_dir)
    got = _train("gpt", resumed, rank, world, range(BEFORE, BEFORE + AFTER))
    a, b = engine.full_state_dict(), resumed.full_state_dict()
    return {"losses": ref == got, "differ": [k for k in a if not torch.equal(a[k], b[k])]}


def test_bf16_compute_resumes_bit_for_bit(tmp_path):
    for rank, out in enumerate(run(_bf16_resume, world_size=2, args=(str(tmp_path),), timeout=TIMEOUT)):
        assert out["losses"] and out["differ"] == [], f"rank {rank}: {out}"
