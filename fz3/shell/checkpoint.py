"""Sharded, atomic training checkpoints: `engine.save_checkpoint` / `engine.load_checkpoint`.

    save_dir/
      latest                 text: the newest complete tag (replaced atomically, os.replace)
      <tag>/                 default tag global_step{optimizer_steps}
        fz3_meta.json        rank 0: format, world size, params (name, shape, numel, shard
                             numel, requires_grad, dtype), state_dict keys (param id or buffer),
                             model fingerprint, config, step counters, every rank file's size
        rank_00000.pt ...    each rank (torch.save, weights_only-loadable): its fp32 master
                             shards (s,) by ParamId, optimizer.state_dict() (state tensors
                             shaped like the shard, `step` as it is), the ParamIds of each param
                             group, lr_scheduler.state_dict(); rank 0 also the model's buffers
        client_state.pt      rank 0: the client_state dict

    save:  write into save_dir/.tmp-<tag> --every rank agrees it wrote--> rank 0 writes the
           metadata, renames .tmp-<tag> -> <tag>, replaces `latest` --barrier--> done
    load:  resolve tag --> read + check metadata, files, model, optimizer groups (nothing is
           changed yet) --every rank agrees--> masters, optimizer, scheduler, buffers, counters

A save that fails on any rank fails on every rank (an all-reduce of "ok" instead of a barrier
that would hang) and leaves `latest` and the previous tag untouched; a rank killed mid-save
leaves only a .tmp- folder the next save of that tag removes. Loading at another world size
rebuilds each shard: the saved ranks' shards concatenated in rank order, padding dropped,
re-sliced (fz3/data/layout.py); optimizer-state tensors shaped like a param's shard are
resharded the same way, other state (`step`) is taken from saved rank 0.

Checkpoints are taken at an accumulation boundary (after engine.step(), micro_step 0): the
grad partitions then hold nothing the next window reads (its first write of each is a copy,
the epilogue zeroes the rest), so they are not saved.
DeepSpeed: DeepSpeedEngine.save_checkpoint / load_checkpoint (zero_pp_rank_*_optim_states.pt,
mp_rank_00_model_states.pt, `latest`); fz3 writes one file per rank and reshards on load
(DeepSpeed needs the universal-checkpoint conversion for another world size).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import json
import os
import shutil

import torch

from fz3.core.grads import init_grad_state
from fz3.core.step import end_of_step
from fz3.data import layout
from fz3.shell.agree import failed_ranks

FORMAT, VERSION = "fz3-zero3-checkpoint", 1
META, CLIENT, LATEST = "fz3_meta.json", "client_state.pt", "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked; nothing was loaded."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


# ---- what identifies a model -------------------------------------------------------------------

def param_records(engine) -> list[dict]:
    return [{"name": name, "shape": list(shape), "numel": ps.numel, "shard_numel": ps.shard_numel,
             "requires_grad": trainable, "dtype": str(param.dtype).removeprefix("torch.")}
            for name, shape, ps, trainable, param in zip(engine.tables.names, engine.store.shapes,
                                                         engine.spec.params, engine.store.trainable,
                                                         engine.tables.params)]


def fingerprint(params: list[dict]) -> str:
    """sha256 of the params' names and shapes in ParamId order: the model's identity."""
    text = json.dumps([[p["name"], p["shape"]] for p in params])
    return hashlib.sha256(text.encode()).hexdigest()


def state_dict_keys(engine) -> list[list]:
    """[key, "param", ParamId] or [key, "buffer", None] per model.state_dict() key, in order."""
    pid = {id(p): i for i, p in enumerate(engine.tables.params)}
    return [[k, "param", pid[id(t)]] if id(t) in pid else [k, "buffer", None]
            for k, t in engine.module.state_dict(keep_vars=True).items()]


def group_param_ids(engine) -> list[list[int]]:
    """The ParamIds of each optimizer param group (they hold the master shards)."""
    pid = {id(m): i for i, m in enumerate(engine.store.masters)}
    return [[pid[id(m)] for m in g["params"]] for g in engine.optimizer.param_groups]


# ---- save ----------------------------------------------------------------------------------------

def save_checkpoint(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> bool:
    """Write this rank's shards and optimizer state under save_dir/<tag>, atomically; every
    rank must call it. tag defaults to global_step{optimizer_steps}; `latest` names it after.
    DeepSpeed: DeepSpeedEngine.save_checkpoint (same arguments, returns True)."""
    tag = _check_tag(f"global_step{engine.optimizer_steps}" if tag is None else tag)
    _check_quiescent(engine, "save_checkpoint")
    client_state = {} if client_state is None else client_state
    _check_weights_only(client_state)
    tmp, final = os.path.join(save_dir, f".tmp-{tag}"), os.path.join(save_dir, tag)
    error = None
    if engine.rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save of this tag left
            os.makedirs(tmp)
        except OSError as e:
            error = e
    _agree(engine, error, f"save_checkpoint({save_dir!r}, tag={tag!r}): creating {tmp} failed")
    try:
        write_rank(engine, os.path.join(tmp, rank_file(engine.rank)))
        if engine.rank == 0:
            torch.save(client_state, os.path.join(tmp, CLIENT))
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    _agree(engine, error, f"save_checkpoint({save_dir!r}, tag={tag!r}): writing {tmp} failed")
    if engine.rank == 0:
        try:
            _write_json(os.path.join(tmp, META), metadata(engine, tag, tmp))
            publish(save_dir, tmp, final, tag)
        except Exception as e:  # noqa: BLE001
            error = e
    _agree(engine, error, f"save_checkpoint({save_dir!r}, tag={tag!r}): publishing {final} failed")
    return True


def write_rank(engine, path: str) -> None:
    """torch.save this rank's part: master shards, optimizer, scheduler (rank 0: buffers)."""
    payload = {"format": FORMAT, "rank": engine.rank, "world_size": engine.world_size,
               "fingerprint": fingerprint(param_records(engine)),
               "masters": [m.detach().cpu() for m in engine.store.masters],  # (s,) by ParamId
               "optimizer": engine.optimizer.state_dict(),
               "group_param_ids": group_param_ids(engine),
               "lr_scheduler": None if engine.lr_scheduler is None else engine.lr_scheduler.state_dict()}
    if engine.rank == 0:
        pids = {id(p) for p in engine.tables.params}
        payload["buffers"] = {k: t.detach().cpu() for k, t in engine.module.state_dict(keep_vars=True).items()
                              if id(t) not in pids}
    torch.save(payload, path)


def metadata(engine, tag: str, folder: str) -> dict:
    params = param_records(engine)
    files = [rank_file(r) for r in range(engine.world_size)] + [CLIENT]
    gs = engine.grads_state
    return {"format": FORMAT, "version": VERSION, "tag": tag, "world_size": engine.world_size,
            "params": params, "fingerprint": fingerprint(params), "state_dict": state_dict_keys(engine),
            "config": dataclasses.asdict(engine.config), "optimizer_steps": engine.optimizer_steps,
            "grads": {"micro_step": gs.micro_step, "window": gs.window, "backward": gs.backward},
            "files": {f: os.path.getsize(os.path.join(folder, f)) for f in files}}


def publish(save_dir: str, tmp: str, final: str, tag: str) -> None:
    """Rank 0, once every file is written: .tmp-<tag> becomes <tag>, then `latest` names it.
    A tag saved before is moved aside first and removed only after the rename."""
    old = os.path.join(save_dir, f".old-{tag}")
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    latest_tmp = os.path.join(save_dir, f".{LATEST}.tmp")
    with open(latest_tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(save_dir, LATEST))


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# ---- load ----------------------------------------------------------------------------------------

def load_checkpoint(engine, load_dir: str, tag: str | None = None) -> tuple[str, dict]:
    """Load save_dir/<tag> (tag None: the one `latest` names) into this engine, at any world
    size; every rank must call it. Returns (the tag's folder, client_state). Everything is read
    and checked before anything changes; an error on any rank raises on every rank.
    DeepSpeed: DeepSpeedEngine.load_checkpoint, which returns (None, None) when there is no
    `latest`; fz3 raises instead (a mistyped folder would silently train from scratch)."""
    _check_quiescent(engine, "load_checkpoint")
    error, loaded = None, None
    try:
        loaded = read_checkpoint(engine, load_dir, tag)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    _agree(engine, error, f"load_checkpoint({load_dir!r}, tag={tag!r})")
    apply(engine, loaded)
    return loaded["path"], loaded["client_state"]


def resolve_tag(load_dir: str, tag: str | None) -> str:
    if tag is not None:
        return _check_tag(tag)
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        raise CheckpointError(f"load_checkpoint: no {latest} file (no checkpoint was completed in "
                              f"{load_dir!r}); pass tag= to load a given one")
    with open(latest) as f:
        tag = f.read().strip()
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise CheckpointError(f"{latest} names tag {tag!r}, but {os.path.join(load_dir, tag)} does not "
                              f"exist; tags present: {list_tags(load_dir)}")
    return tag


def list_tags(load_dir: str) -> list[str]:
    return sorted(d for d in os.listdir(load_dir) if not d.startswith(".") and
                  os.path.isdir(os.path.join(load_dir, d))) if os.path.isdir(load_dir) else []


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


def read_checkpoint(engine, load_dir: str, tag: str | None) -> dict:
    """Everything this rank will load, read and checked; the engine is not touched."""
    tag = resolve_tag(load_dir, tag)
    folder = os.path.join(load_dir, tag)
    meta = read_meta(folder)
    check_model(engine, meta, os.path.join(folder, META))
    world = meta["world_size"]
    same = world == engine.world_size
    ranks = [engine.rank] if same else list(range(world))
    files = {r: load_rank(folder, r, meta) for r in ranks}
    if 0 not in files:
        files[0] = load_rank(folder, 0, meta)  # buffers, and non-shard optimizer state
    groups = group_param_ids(engine)
    for r, payload in files.items():
        if payload["group_param_ids"] != groups:
            raise CheckpointError(f"{os.path.join(folder, rank_file(r))}: the optimizer's param groups "
                                  f"hold params {payload['group_param_ids']} (ParamIds), this optimizer's "
                                  f"hold {groups}; build the optimizer with the same groups")
    if (files[0]["lr_scheduler"] is None) != (engine.lr_scheduler is None):
        raise CheckpointError(f"{folder}: the checkpoint has {'no' if files[0]['lr_scheduler'] is None else 'an'}"
                              f" lr scheduler state, this engine has "
                              f"{'none' if engine.lr_scheduler is None else 'an lr_scheduler'}")
    mine = files[engine.rank] if same else None
    numels = [p["numel"] for p in meta["params"]]
    masters = ([t.clone() for t in mine["masters"]] if same else
               [reshard([files[r]["masters"][p] for r in range(world)], n, engine.rank, engine.world_size)
                for p, n in enumerate(numels)])
    optim = _clone(mine["optimizer"]) if same else reshard_optimizer(files, meta, engine, groups)
    client_path = os.path.join(folder, CLIENT)
    try:
        client_state = torch.load(client_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint file {client_path} cannot be read (corrupted?): {e}") from e
    return {"path": folder, "meta": meta, "masters": masters, "optimizer": optim,
            "lr_scheduler": (mine or files[0])["lr_scheduler"],
            "buffers": _clone(files[0]["buffers"]), "client_state": client_state}


def reshard(shards: list[torch.Tensor], numel: int, rank: int, world_size: int) -> torch.Tensor:
    """Saved shards (s,) in rank order -> this rank's (s',) at the new world size."""
    full = torch.cat([s.reshape(-1) for s in shards])[:numel]  # (numel,): padding dropped
    return layout.rank_slice(full, rank, world_size).clone()


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
                                numel, engine.rank, engine.world_size)
            state[index][key] = _clone(value)
    return {"state": state, "param_groups": _clone(base["param_groups"])}


def apply(engine, loaded: dict) -> None:
    """Install what read_checkpoint returned: masters (then the compute shards and every full
    param, now stale), optimizer (state and group options), scheduler, buffers, counters."""
    for master, value in zip(engine.store.masters, loaded["masters"]):
        master.data.copy_(value)
    engine.store.refresh_shards()
    engine.optimizer.load_state_dict(loaded["optimizer"])
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(loaded["lr_scheduler"])
    buffers = dict(engine.module.named_buffers())
    for name, value in loaded["buffers"].items():
        if name in buffers:
            buffers[name].data.copy_(value)
    meta = loaded["meta"]
    engine.optimizer_steps = meta["optimizer_steps"]
    # fresh per-param grad records: ones left by training before the load could equal the
    # restored window / backward counters and turn a first write into an add (fz3/core/grads.py)
    engine.grads_state = init_grad_state(engine.spec)._replace(window=meta["grads"]["window"],
                                                               backward=meta["grads"]["backward"])
    engine._params(end_of_step(engine.params_state, config=engine.config))  # re-gather persistent


# ---- shared checks ---------------------------------------------------------------------------------

def _check_tag(tag) -> str:
    if not isinstance(tag, str) or not tag or tag.startswith(".") or "/" in tag or "\\" in tag \
            or tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r}: expected a non-empty folder name, not starting "
                              f"with '.', without '/', and not {LATEST!r}")
    return tag


def _check_quiescent(engine, what: str) -> None:
    gs = engine.grads_state
    if gs.micro_step != 0 or gs.buckets or engine.stack:
        raise CheckpointError(f"{what}: at micro-step {gs.micro_step} of {engine.config.gradient_accumulation_steps}"
                              f"{' inside a forward' if engine.stack else ''}; call it at an accumulation "
                              "boundary, after engine.step() (grad partitions are not saved)")
    if engine.params_state.held:
        raise CheckpointError(f"{what}: inside fz3.gathered_parameters; call it outside the block")


def _check_weights_only(client_state) -> None:
    """client_state must load with torch.load(weights_only=True): tensors, numbers, strings,
    lists, tuples, dicts. Checked before anything is written."""
    if not isinstance(client_state, dict):
        raise CheckpointError(f"client_state must be a dict, got {type(client_state).__name__}")
    buf = io.BytesIO()
    torch.save(client_state, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError("client_state holds objects torch.load(weights_only=True) refuses (use "
                              f"tensors, numbers, strings, lists, tuples, dicts): {e}") from e


def _agree(engine, error: Exception | None, what: str) -> None:
    """Every rank learns whether any rank failed; each then raises (its own error, or which
    ranks failed). Replaces a barrier a failed rank would never reach."""
    ranks = failed_ranks(engine, error is not None)
    if not ranks:
        return
    if error is not None:
        if isinstance(error, CheckpointError):
            raise CheckpointError(str(error)) from error
        raise CheckpointError(f"{what}: {type(error).__name__}: {error}") from error
    raise CheckpointError(f"{what}: rank(s) {ranks} failed (their error is raised there); nothing "
                          "was changed")


def _clone(obj):
    """A deep copy with tensors cloned (off the mmap'd file)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj
