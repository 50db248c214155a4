"""Sharded, atomic training checkpoints: the format and `engine.save_checkpoint`; loading and
resharding are fz3/io/checkpoint_load.py (`engine.load_checkpoint`).

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

A save that fails on any rank fails on every rank (an all-reduce of "ok" instead of a barrier
that would hang) and leaves `latest` and the previous tag untouched; a rank killed mid-save
leaves only a .tmp- folder the next save of that tag removes. The shared checks (`check_tag`,
`check_quiescent`, `agree`) serve the loader too.

Checkpoints are taken at an accumulation boundary (after engine.step(), micro_step 0): the
grad partitions then hold nothing the next window reads (its first write of each is a copy,
the epilogue zeroes the rest), so they are not saved.
DeepSpeed: DeepSpeedEngine.save_checkpoint / load_checkpoint (zero_pp_rank_*_optim_states.pt,
mp_rank_00_model_states.pt, `latest`); fz3 writes one file per rank and reshards on load
(DeepSpeed needs the universal-checkpoint conversion for another world size).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil

import torch

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
    tag = check_tag(f"global_step{engine.optimizer_steps}" if tag is None else tag)
    check_quiescent(engine, "save_checkpoint")
    engine.buffers.sync()  # rank 0's buffers, which the checkpoint keeps, are every rank's
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
    agree(engine, error, f"save_checkpoint({save_dir!r}, tag={tag!r}): creating {tmp} failed")
    try:
        write_rank(engine, os.path.join(tmp, rank_file(engine.rank)))
        if engine.rank == 0:
            torch.save(client_state, os.path.join(tmp, CLIENT))
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    agree(engine, error, f"save_checkpoint({save_dir!r}, tag={tag!r}): writing {tmp} failed")
    if engine.rank == 0:
        try:
            _write_json(os.path.join(tmp, META), metadata(engine, tag, tmp))
            publish(save_dir, tmp, final, tag)
        except Exception as e:  # noqa: BLE001
            error = e
    agree(engine, error, f"save_checkpoint({save_dir!r}, tag={tag!r}): publishing {final} failed")
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
            "grads": {"micro_step": gs.micro_step, "window": gs.window, "backward": gs.backward,
                      "skipped": gs.skipped},
            "global_samples": engine.global_samples,  # DeepSpeed's counter (surface.py)
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


def list_tags(load_dir: str) -> list[str]:
    return sorted(d for d in os.listdir(load_dir) if not d.startswith(".") and
                  os.path.isdir(os.path.join(load_dir, d))) if os.path.isdir(load_dir) else []


# ---- shared checks ---------------------------------------------------------------------------------

def check_tag(tag) -> str:
    if not isinstance(tag, str) or not tag or tag.startswith(".") or "/" in tag or "\\" in tag \
            or tag == LATEST:
        raise CheckpointError(f"checkpoint tag {tag!r}: expected a non-empty folder name, not starting "
                              f"with '.', without '/', and not {LATEST!r}")
    return tag


def check_quiescent(engine, what: str) -> None:
    gs = engine.grads_state
    inside = bool(engine.state.calls.stack)
    if gs.micro_step != 0 or gs.buckets or inside:
        raise CheckpointError(f"{what}: at micro-step {gs.micro_step} of {engine.config.gradient_accumulation_steps}"
                              f"{' inside a forward' if inside else ''}; call it at an accumulation "
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


def agree(engine, error: Exception | None, what: str) -> None:
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
