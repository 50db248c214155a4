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

A save that fails on any rank fails on every rank (each rank's outcome sent to every other
instead of a barrier that would hang) and leaves `latest` and the previous tag untouched; rank 0
removes the partial .tmp-<tag>. A rank interrupted mid-save (SIGINT, SIGTERM) tells the others
first, and one killed is named as gone (fz3/io/interrupts.py: [Note: interrupted saves]); what
it left is only a .tmp- folder, never `latest`. Ranks that give different save_dir or tag are
refused before anything is written (`check_same_place`). The shared checks (`check_tag`,
`check_quiescent`, `agree`) serve the loader too.

Checkpoints are taken at an accumulation boundary (after engine.step(), no grads waiting): the
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

from fz3.io import interrupts
from fz3.interpreters.agree import outcomes, strings
from fz3.shell.optim import shard_state_dict

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

def save_checkpoint(engine, save_dir: str, tag: str | None = None, client_state: dict | None = None, *,
                    exclude_frozen_parameters: bool = False) -> bool:
    """Write this rank's shards and optimizer state under save_dir/<tag>, atomically; every
    rank must call it. tag defaults to global_step{optimizer_steps}; `latest` names it after.
    `exclude_frozen_parameters`: the params that do not require grad are left out (their master
    shards are None in the files): a load keeps the values the model has for them, and
    consolidation leaves them out. DeepSpeed: DeepSpeedEngine.save_checkpoint (same arguments,
    returns True)."""
    tag = f"global_step{engine.optimizer_steps}" if tag is None else tag
    check_same_place(engine, save_dir, tag)
    tag = check_tag(tag)
    check_quiescent(engine, "save_checkpoint")
    engine.read_verdict(every_rank=False)  # a skipped step's lr scheduler put back before it is saved
    engine.buffers.sync()  # rank 0's buffers, which the checkpoint keeps, are every rank's
    client_state = {} if client_state is None else client_state
    _check_weights_only(client_state)
    tmp, final = os.path.join(save_dir, f".tmp-{tag}"), os.path.join(save_dir, tag)
    call, rank0 = f"save_checkpoint({save_dir!r}, tag={tag!r})", engine.rank == 0

    def create() -> None:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed save of this tag left
        os.makedirs(tmp)

    def write() -> None:
        if engine.rank < engine.shard_world:  # one copy of each shard (stage 0: rank 0's whole params)
            write_rank(engine, os.path.join(tmp, rank_file(engine.shard_rank)), exclude_frozen_parameters)
        if rank0:
            torch.save(client_state, os.path.join(tmp, CLIENT))

    def finish() -> None:
        _write_json(os.path.join(tmp, META), metadata(engine, tag, tmp))
        publish(save_dir, tmp, final, tag)

    def tidy() -> None:  # rank 0, once some rank failed: the partial folder goes
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
    with interrupts.raising():  # [Note: interrupted saves]
        agree(engine, _attempt(create if rank0 else None), f"{call}: creating {tmp} failed",
              left=lambda: _unpublished(save_dir), tidy=tidy)
        agree(engine, _attempt(write), f"{call}: writing {tmp} failed", left=lambda: _unpublished(save_dir),
              tidy=tidy)
        agree(engine, _attempt(finish if rank0 else None), f"{call}: publishing {final}",
              left=lambda: _published(save_dir, final, tag))
    return True


def _attempt(step) -> BaseException | None:
    """Run `step` (None: nothing for this rank to do); -> what it raised: an error, or the
    KeyboardInterrupt / Interrupted of a signal ([Note: interrupted saves]), reported to every
    rank by `agree` before this rank goes on raising it."""
    try:
        if step is not None:
            step()
    except (Exception, KeyboardInterrupt, interrupts.Interrupted) as e:  # noqa: BLE001 - agreed on below
        return e
    return None


def _unpublished(save_dir: str) -> str:
    latest = os.path.join(save_dir, LATEST)
    try:
        with open(latest) as f:
            return f"nothing was published: {latest} still names tag {f.read().strip()!r}"
    except OSError:
        return f"nothing was published (no checkpoint in {save_dir!r} was completed before)"


def _published(save_dir: str, final: str, tag: str) -> str:
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            done = f.read().strip() == tag and os.path.isdir(final)
    except OSError:
        done = False
    return f"{final} was published whole ({LATEST} names it)" if done else _unpublished(save_dir)


def check_same_place(engine, save_dir, tag) -> None:
    """Every rank gave the same save_dir and tag, or every rank raises, naming each rank's,
    before anything is written. HelloDeepSpeed names its folder by the current second: ranks a
    second apart each wrote half a checkpoint into a folder the other never made ("Parent
    directory ... does not exist"). Compared as absolute paths; named as given."""
    given = os.fspath(save_dir) if isinstance(save_dir, (str, os.PathLike)) else repr(save_dir)
    mine = [os.path.abspath(given) if isinstance(given, str) else repr(given), str(tag), str(given)]
    every = [json.loads(s) for s in strings(engine, json.dumps(mine))]
    dirs, tags = {d for d, _, _ in every}, {t for _, t, _ in every}
    if len(dirs) == 1 and len(tags) == 1:
        return
    given = len({g for _, _, g in every}) == len(dirs)  # the given paths tell them apart
    shown = [((g if given else d) if len(dirs) > 1 else None, t if len(tags) > 1 else None) for d, t, g in every]
    groups: dict[tuple, list[int]] = {}
    for r, key in enumerate(shown):
        groups.setdefault(key, []).append(r)
    each = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: "
                     + ", ".join(x for x in (f"save_dir {d!r}" if d is not None else "",
                                             f"tag {t!r}" if t is not None else "") if x)
                     for (d, t), rs in groups.items())
    what = " and ".join(x for x in ("save_dir" if len(dirs) > 1 else "", "tag" if len(tags) > 1 else "") if x)
    raise CheckpointError(
        f"save_checkpoint: the ranks gave different {what}: {each}. Every rank must pass the same "
        "save_dir and tag: each rank writes its shard into the one folder rank 0 creates and publishes. "
        "Make the name once and share it (on rank 0, then torch.distributed.broadcast_object_list), or "
        "derive it from what every rank agrees on (engine.global_steps, not the clock); nothing was written")


def write_rank(engine, path: str, exclude_frozen: bool = False) -> None:
    """torch.save this rank's part: master shards (None for a frozen param left out), optimizer,
    scheduler (rank 0: buffers)."""
    payload = {"format": FORMAT, "rank": engine.shard_rank, "world_size": engine.shard_world,
               "fingerprint": fingerprint(param_records(engine)),
               "masters": [None if exclude_frozen and not trained else m.detach().cpu()  # (s,) by ParamId
                           for m, trained in zip(engine.store.masters, engine.store.trainable)],
               "optimizer": shard_state_dict(engine.optimizer),
               "group_param_ids": group_param_ids(engine),
               "lr_scheduler": None if engine.lr_scheduler is None else engine.lr_scheduler.state_dict()}
    if engine.rank == 0:
        pids = {id(p) for p in engine.tables.params}
        payload["buffers"] = {k: t.detach().cpu() for k, t in engine.module.state_dict(keep_vars=True).items()
                              if id(t) not in pids}
    torch.save(payload, path)


def metadata(engine, tag: str, folder: str) -> dict:
    params = param_records(engine)
    files = [rank_file(r) for r in range(engine.shard_world)] + [CLIENT]
    gs = engine.grads_state
    # world_size: the ranks the params were split over (1 at stage 0), what a load reshards from
    return {"format": FORMAT, "version": VERSION, "tag": tag, "world_size": engine.shard_world,
            "params": params, "fingerprint": fingerprint(params), "state_dict": state_dict_keys(engine),
            "config": dataclasses.asdict(engine.config), "optimizer_steps": engine.optimizer_steps,
            "grads": {"micro_step": gs.micro_step, "window": gs.window, "backward": gs.backward,
                      "skipped": engine.skipped},
            "global_samples": engine.global_samples,  # DeepSpeed's counter (surface.py)
            # fp16's loss scale (fz3/core/grad/scaler.py): DeepSpeed keeps it in its optimizer's state
            "loss_scale": list(engine.loss_scale) if engine.config.compute_dtype == "fp16" else None,
            "overflow": engine.overflow,
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
    pending = gs.micro_backwards + gs.committed + gs.averaged  # grads of an open window
    if gs.micro_step != 0 or pending or gs.buckets or inside:
        waiting = f" with the grads of {gs.micro_backwards} backward(s) not yet stepped" if gs.micro_backwards else ""
        raise CheckpointError(f"{what}: at micro-step {gs.micro_step} of {engine.config.gradient_accumulation_steps}"
                              f"{waiting}{' inside a forward' if inside else ''}; call it at an accumulation "
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


def agree(engine, error: BaseException | None, what: str, *, left=lambda: "nothing was changed",
          tidy=lambda: None) -> None:
    """Every rank learns how every rank fared; if any failed, each raises: its own error, or
    which ranks failed, were interrupted (and by which signal) or left (their process ended),
    then `left()` (what stays as it was). `tidy()` runs first on every rank. A rank a signal
    interrupted raises that again once the others know ([Note: interrupted saves]). Replaces a
    barrier a failed rank would never reach."""
    got = outcomes(engine, interrupts.code_of(error))
    bad = {r: c for r, c in sorted(got.codes.items()) if c}
    if not bad and not got.gone:
        return
    tidy()
    if interrupts.signal_of(error) is not None:
        interrupts.resume(error)
    if error is not None:
        if isinstance(error, CheckpointError):
            raise CheckpointError(str(error)) from error
        raise CheckpointError(f"{what}: {type(error).__name__}: {error}") from error
    failed = [r for r, c in bad.items() if c == 1]
    parts = ([f"rank(s) {failed} failed (their error is raised there)"] if failed else []) + \
        [f"rank {r} was {interrupts.words(c)}" for r, c in bad.items() if c != 1] + \
        [f"rank {r} left: its process ended (killed, or stopped by a signal it could not report) while this "
         f"rank waited for it ({why})" for r, why in sorted(got.gone.items())]
    raise CheckpointError(f"{what}: {'; '.join(parts)}; {left()}")
