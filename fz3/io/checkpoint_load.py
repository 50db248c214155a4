"""Loading a sharded checkpoint (format: fz3/io/checkpoint.py): `engine.load_checkpoint`.

    resolve tag (`latest`) --> read + check metadata, rank files, model, optimizer groups
    (nothing is changed yet) --every rank agrees--> masters, optimizer, scheduler, buffers,
    counters; stale full params gathered again

At another world size each shard is rebuilt: the saved ranks' shards concatenated in rank order,
padding dropped, re-sliced (fz3/data/layout.py); optimizer-state tensors shaped like a param's
shard are resharded the same way, other state (`step`) is taken from saved rank 0.
A tag whose files are damaged or missing is an error that also names the newest intact tag and
the call that loads it (`newest_intact`). `fz3/consolidate.py` reads checkpoints through
`tag_folder`, `read_meta` and `load_rank`.
DeepSpeed: DeepSpeedEngine.load_checkpoint (which needs the universal-checkpoint conversion for
another world size).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Iterator

import torch

from fz3.core.events import Resumed
from fz3.core.grad.scaler import LossScale
from fz3.core.grad.verdict import Verdict
from fz3.data import layout
from fz3.io.checkpoint import (CLIENT, FORMAT, LATEST, META, VERSION, CheckpointError, agree,
                                  check_quiescent, check_tag, fingerprint, group_param_ids,
                                  list_tags, param_records, rank_file)
from fz3.shell.optim import load_shard_state_dict

def load_checkpoint(engine, load_dir: str, tag: str | None = None, *, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str, dict]:
    """Load save_dir/<tag> (tag None: the one `latest` names) into this engine, at any world
    size; every rank must call it. Returns (the tag's folder, client_state). Everything is read
    and checked before anything changes; an error on any rank raises on every rank.
    As DeepSpeed's options: load_optimizer_states=False keeps this engine's optimizer state (its
    param groups may then differ from the saved ones), load_lr_scheduler_states=False its
    scheduler, load_module_only=True both and its step counters too (the weights only, e.g. to
    fine-tune). load_module_strict=False is refused: a checkpoint loads into the same model only.
    DeepSpeed: DeepSpeedEngine.load_checkpoint, which returns (None, None) when there is no
    `latest`; fz3 raises instead (a mistyped folder would silently train from scratch)."""
    if load_module_strict is not True:
        raise ValueError(f"load_checkpoint(load_module_strict={load_module_strict!r}): fz3 loads a "
                         "checkpoint into the same model only (names, shapes: strict); for some of "
                         "the weights, consolidate it (python -m fz3.consolidate) and edit the file")
    parts = {"optimizer": load_optimizer_states and not load_module_only,
             "lr_scheduler": load_lr_scheduler_states and not load_module_only,
             "counters": not load_module_only}
    check_quiescent(engine, "load_checkpoint")
    error, loaded = None, None
    try:
        loaded = read_checkpoint(engine, load_dir, tag, parts)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    agree(engine, error, f"load_checkpoint({load_dir!r}, tag={tag!r})")
    apply(engine, loaded, parts)
    return loaded["path"], loaded["client_state"]


def tag_folder(load_dir: str, tag: str | None) -> str:
    """The folder of `tag`, or of the tag `latest` names. A save that re-saved an existing tag
    and was killed between moving the old copy aside and renaming the new one in (`publish`)
    left the old, complete copy at .old-<tag>: that is the one loaded."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointError(f"load_checkpoint: no {latest} file (no checkpoint was completed in "
                                  f"{load_dir!r}); pass tag= to load a given one")
        with open(latest) as f:
            tag = f.read().strip()
        named = f"{latest} names tag {tag!r}, but "
    else:
        named = ""
        check_tag(tag)
    folder, moved = os.path.join(load_dir, tag), os.path.join(load_dir, f".old-{tag}")
    if not os.path.isdir(folder) and os.path.isdir(moved):
        return moved
    if named and not os.path.isdir(folder):
        raise CheckpointError(f"{named}{folder} does not exist; tags present: {list_tags(load_dir)}")
    return folder


def read_meta(folder: str) -> dict:
    """The metadata of a tag folder, checked against the rank files present (count, sizes)."""
    path = os.path.join(folder, META)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    try:
        with open(path) as f:
            meta = json.load(f)
        missing = [k for k in ("format", "version", "world_size", "params", "fingerprint", "state_dict",
                               "files", "optimizer_steps", "grads") if k not in meta]
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint metadata {path} is missing or corrupted: {e}") from e
    if missing or meta["format"] != FORMAT or meta["version"] != VERSION:
        raise CheckpointError(f"checkpoint metadata {path} is corrupted or not an {FORMAT} v{VERSION} "
                              f"record (format {meta.get('format')!r}, version {meta.get('version')!r}, "
                              f"missing keys {missing})")
    world = meta["world_size"]
    present = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "rank_*.pt")))
    expected = [rank_file(r) for r in range(world)] if isinstance(world, int) and world >= 1 else None
    if present != expected:
        raise CheckpointError(f"{path} records world size {world!r}, but {folder} holds the rank files "
                              f"{present}; expected {expected} (a missing rank file, or files of "
                              "another save)")
    for name, size in meta["files"].items():
        file = os.path.join(folder, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual != size:
            raise CheckpointError(f"checkpoint file {file} is {'missing' if actual is None else f'{actual} bytes'}"
                                  f", {path} records {size} bytes (truncated or overwritten)")
    return meta


def check_model(engine, meta: dict, path: str) -> None:
    """The engine's model has the checkpoint's params: names, shapes, requires_grad."""
    saved, ours = meta["params"], param_records(engine)
    if len(saved) != len(ours):
        raise CheckpointError(f"{path} is a checkpoint of a model with {len(saved)} params, this model "
                              f"has {len(ours)} (first names: saved {[p['name'] for p in saved[:5]]}, "
                              f"this {[p['name'] for p in ours[:5]]})")
    for i, (a, b) in enumerate(zip(saved, ours)):
        for key in ("name", "shape", "requires_grad"):
            if a[key] != b[key]:
                raise CheckpointError(f"{path}: param {i} has {key} {a[key]!r} in the checkpoint, "
                                      f"{b[key]!r} in this model ({b['name']!r}); load it into the model "
                                      "it was saved from")
    if meta["fingerprint"] != fingerprint(ours):
        raise CheckpointError(f"{path}: model fingerprint {meta['fingerprint'][:12]} does not match "
                              f"this model's {fingerprint(ours)[:12]}")


def load_rank(folder: str, rank: int, meta: dict) -> dict:
    path = os.path.join(folder, rank_file(rank))
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for a damaged zip
        raise CheckpointError(f"checkpoint file {path} cannot be read (corrupted?): {e}") from e
    want = (FORMAT, rank, meta["world_size"], meta["fingerprint"])
    got = tuple(payload.get(k) for k in ("format", "rank", "world_size", "fingerprint"))
    if got != want:
        raise CheckpointError(f"checkpoint file {path} records (format, rank, world size, fingerprint) "
                              f"{got[:3] + (str(got[3])[:12],)}; {os.path.join(folder, META)} expects "
                              f"{want[:3] + (want[3][:12],)}")
    return payload


ALL_PARTS = {"optimizer": True, "lr_scheduler": True, "counters": True}


def read_checkpoint(engine, load_dir: str, tag: str | None, parts: dict = ALL_PARTS) -> dict:
    """Everything this rank will load (`parts`: which besides the weights), read and checked;
    the engine is not touched."""
    with _or_older(load_dir, os.path.join(load_dir, str(tag)) if tag is not None else None):
        folder = tag_folder(load_dir, tag)
    with _or_older(load_dir, folder):
        meta = read_meta(folder)
    check_model(engine, meta, os.path.join(folder, META))
    world = meta["world_size"]  # the ranks its params were split over
    same = world == engine.shard_world
    ranks = [engine.shard_rank] if same else list(range(world))
    with _or_older(load_dir, folder):
        files = {r: load_rank(folder, r, meta) for r in ranks}
        if 0 not in files:
            files[0] = load_rank(folder, 0, meta)  # buffers, and non-shard optimizer state
    groups = group_param_ids(engine)
    for r, payload in files.items():
        if parts["optimizer"] and payload["group_param_ids"] != groups:
            raise CheckpointError(f"{os.path.join(folder, rank_file(r))}: the optimizer's param groups "
                                  f"hold params {payload['group_param_ids']} (ParamIds), this optimizer's "
                                  f"hold {groups}; build the optimizer with the same groups")
    if parts["lr_scheduler"] and (files[0]["lr_scheduler"] is None) != (engine.lr_scheduler is None):
        raise CheckpointError(f"{folder}: the checkpoint has {'no' if files[0]['lr_scheduler'] is None else 'an'}"
                              f" lr scheduler state, this engine has "
                              f"{'none' if engine.lr_scheduler is None else 'an lr_scheduler'}")
    mine = files[engine.shard_rank] if same else None
    numels = [p["numel"] for p in meta["params"]]
    masters = ([None if t is None else t.clone() for t in mine["masters"]] if same else  # None: left out
               [None if files[0]["masters"][p] is None else
                reshard([files[r]["masters"][p] for r in range(world)], n, engine.shard_rank, engine.shard_world)
                for p, n in enumerate(numels)])
    optim = None if not parts["optimizer"] else \
        _clone(mine["optimizer"]) if same else reshard_optimizer(files, meta, engine, groups)
    client_path = os.path.join(folder, CLIENT)
    with _or_older(load_dir, folder):
        try:
            client_state = torch.load(client_path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint file {client_path} cannot be read (corrupted?): {e}") from e
    return {"path": folder, "meta": meta, "masters": masters, "optimizer": optim,
            "lr_scheduler": (mine or files[0])["lr_scheduler"],
            "buffers": _clone(files[0]["buffers"]), "client_state": client_state}


@contextlib.contextmanager
def _or_older(load_dir: str, damaged: str | None) -> Iterator[None]:
    """A CheckpointError inside (a tag's files damaged or missing) goes on with the newest
    intact tag of `load_dir` besides `damaged` and the call that loads it: a save cut short
    or a file truncated leaves the tags before it whole, and the user should not have to find
    them by hand."""
    try:
        yield
    except CheckpointError as e:
        raise CheckpointError(f"{e}. {newest_intact(load_dir, besides=damaged)}") from e


def newest_intact(load_dir: str, *, besides: str | None = None) -> str:
    """A sentence naming the newest tag of `load_dir` (most optimizer steps, then the latest
    metadata write) whose metadata reads and whose files have the sizes it records (read_meta),
    `besides` excepted, and how to load it; or saying there is none."""
    found = []
    for tag in list_tags(load_dir):
        folder = os.path.join(load_dir, tag)
        if besides is not None and os.path.abspath(folder) == os.path.abspath(besides):
            continue
        try:
            meta = read_meta(folder)
        except CheckpointError:
            continue
        found.append((meta["optimizer_steps"], os.path.getmtime(os.path.join(folder, META)), tag))
    if not found:
        return f"No other tag in {load_dir!r} is intact (tags present: {list_tags(load_dir)})"
    steps, _, tag = max(found)
    return (f"The newest intact checkpoint in {load_dir!r} is tag {tag!r} (optimizer step {steps}): load it "
            f"with engine.load_checkpoint({load_dir!r}, tag={tag!r})")


def reshard(shards: list[torch.Tensor], numel: int, rank: int, world_size: int) -> torch.Tensor:
    """Saved shards (s,) in rank order -> this rank's (s',) at the new world size."""
    return layout.rank_slice(layout.unshard(shards, (numel,)), rank, world_size).clone()


def reshard_optimizer(files: dict, meta: dict, engine, groups: list[list[int]]) -> dict:
    """optimizer.state_dict() for this rank at the new world size: every state tensor shaped
    like its param's saved shard (s,) is resharded, the rest (`step`) is saved rank 0's."""
    world = meta["world_size"]
    base = files[0]["optimizer"]
    pid_of_index = [p for g in groups for p in g]
    state = {}
    for index, entry in base["state"].items():
        p = pid_of_index[index]
        s, numel = meta["params"][p]["shard_numel"], meta["params"][p]["numel"]
        state[index] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.ndim == 1 and value.shape[0] == s:
                value = reshard([files[r]["optimizer"]["state"][index][key] for r in range(world)],
                                numel, engine.shard_rank, engine.shard_world)
            state[index][key] = _clone(value)
    return {"state": state, "param_groups": _clone(base["param_groups"])}


def apply(engine, loaded: dict, parts: dict = ALL_PARTS) -> None:
    """Install what read_checkpoint returned: masters (then the compute shards and every full
    param, now stale), optimizer (state and group options), scheduler, buffers, counters."""
    for master, value in zip(engine.store.masters, loaded["masters"]):
        if value is not None:  # a frozen param the save left out keeps the model's value
            master.data.copy_(value)
    engine.store.refresh_shards()
    if parts["optimizer"]:
        load_shard_state_dict(engine.optimizer, loaded["optimizer"])
        saved_scale = loaded["meta"].get("loss_scale")
        if saved_scale and engine.config.compute_dtype == "fp16":  # with the optimizer's state, as DeepSpeed
            engine.loss_scale = LossScale(*saved_scale)
        engine.overflow = loaded["meta"].get("overflow", False)
    if parts["lr_scheduler"] and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(loaded["lr_scheduler"])
    buffers = dict(engine.module.named_buffers())
    for name, value in loaded["buffers"].items():
        if name in buffers:
            buffers[name].data.copy_(value)
    meta = loaded["meta"]
    # (engine.optimizer_steps is the grad lifecycle's window, restored here with it)
    old = engine.grads_state
    window, backward, skipped = (meta["grads"]["window"], meta["grads"]["backward"],
                                 meta["grads"].get("skipped", 0)) if parts["counters"] else \
        (old.window, old.backward, engine.skipped)
    # the grad lifecycle afresh, at the engine's own place in its cycle of step() calls (DeepSpeed's
    # micro_steps is not restored); persistent params re-gathered
    engine.apply(Resumed(window=window, backward=backward, skipped=skipped,
                         micro_step=engine.micro_steps % engine.config.gradient_accumulation_steps))
    engine.verdict = Verdict()  # its skipped steps are in the core's count now, its pending step gone
    if parts["counters"]:  # DeepSpeed's: global_samples as saved; micro_steps stays this engine's
        per_step = engine.batch.train_batch_size or 0
        engine.global_samples = meta.get("global_samples", window * per_step)


def _clone(obj):
    """A deep copy with tensors cloned (off the mmap'd file)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj
