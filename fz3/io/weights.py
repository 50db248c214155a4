"""Pretrained weights from safetensors straight into the shards: `fz3.load_weights(engine, path)`.

    path: a .safetensors file, or a Hugging Face folder (model.safetensors, or
          model-0000i-of-0000n.safetensors with model.safetensors.index.json)

      headers only            -> every key matched to model.state_dict(): missing, unexpected
                                 and mis-shaped keys listed together, each with file and shapes
      this rank's slices only -> param p: flat [r*s, min((r+1)*s, numel)) read as whole rows
                                 plus partial head / tail rows (get_slice), never the rest;
                                 buffers (replicated on every rank): read whole
      every rank agrees       -> one all_reduce of "this rank failed": nothing is written
                                 anywhere unless every rank read everything
      write                   -> fp32 masters (cast from the file's dtype, padding zeroed),
                                 compute-dtype shards refreshed, buffers copied; the full params
                                 now stale (persistent or held) freed and gathered again, as
                                 after an optimizer step (fz3.core.param.step.end_of_step)

Keys are model.state_dict() names. One Parameter under two names (tied embeddings) needs either
name in the file: Hugging Face's save_pretrained and safetensors' save_model store it once.
A pretrained model so never materialises whole on a rank: each rank holds its shard and, while
loading, one more copy of it in the file's dtype.
DeepSpeed has no sharded load: HF's from_pretrained under zero.Init reads every tensor whole and
scatters it through GatheredParameters(modifier_rank=0) (see load_weights).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from fz3.core.events import ShardsReplaced
from fz3.data import layout
from fz3.interpreters.agree import failed_ranks

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


@dataclass(frozen=True)
class Target:
    """One tensor of the model: its state_dict names (two or more when tied), its shape, and
    either its ParamId (sharded) or the buffer itself (replicated)."""
    names: tuple[str, ...]
    shape: tuple[int, ...]
    pid: Optional[int]
    buffer: Optional[torch.Tensor]


def load_weights(engine, path: str | os.PathLike) -> None:
    """Load a safetensors file or Hugging Face folder into `engine`'s shards, each rank reading
    only its own slices. Every rank must call it (they agree before anything is written), outside
    a forward or backward pass. On any missing, unexpected or mis-shaped key, or a rank that could
    not read its slices, every rank raises and the engine is left as it was.

    Corresponds to transformers' from_pretrained under DeepSpeed ZeRO-3
    (_load_state_dict_into_zero3_model: each param gathered whole with
    GatheredParameters(modifier_rank=0), rank 0 copying the whole tensor in); departs in reading
    only this rank's flat range of each param, so no rank ever holds a param whole.
    """
    from fz3.shell.engine import Engine
    if not isinstance(engine, Engine):
        raise TypeError(f"load_weights: expected the engine fz3.initialize returned, got {type(engine).__name__}")
    if engine.state.calls.stack or engine.state.calls.backward:
        raise RuntimeError("load_weights: called inside a forward or backward pass; call it between steps")
    error: Optional[BaseException] = None
    slices: dict[int, torch.Tensor] = {}
    try:
        files = _files(path)
        targets = _targets(engine)
        chosen = _match(targets, files)
        slices = _read(engine, targets, chosen, files)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
        error = e
    failed = failed_ranks(engine, error is not None)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"load_weights: rank(s) {failed} could not load {os.fspath(path)!r} (see their "
                           "errors); nothing was loaded on any rank")
    with engine.resident():  # the masters are written (optimizer offload: on disk until now)
        _write(engine, targets, slices)


# ---- where the tensors are -------------------------------------------------------------------------

def _files(path: str | os.PathLike) -> dict[str, str]:
    """tensor name -> the .safetensors file holding it (headers only)."""
    from safetensors import safe_open
    path = os.fspath(path)
    if os.path.isdir(path):
        index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            return {name: os.path.join(path, file) for name, file in weight_map.items()}
        if not os.path.isfile(single):
            raise FileNotFoundError(f"load_weights: {path!r} holds neither {SINGLE} nor {INDEX} "
                                    f"(found: {sorted(os.listdir(path))})")
        path = single
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"load_weights: no such file or folder {path!r}")
    with safe_open(path, framework="pt") as f:
        return {name: path for name in f.keys()}


def _targets(engine) -> list[Target]:
    """The model's state_dict grouped by tensor identity: a tied param is one Target."""
    by_id: dict[int, Target] = {}
    for name, t in engine.module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue  # get_extra_state's payload: not a tensor a safetensors file can hold
        old = by_id.get(id(t))
        if old is not None:
            by_id[id(t)] = Target(old.names + (name,), old.shape, old.pid, old.buffer)
        elif id(t) in engine.param_ids:
            pid = engine.param_ids[id(t)]
            by_id[id(t)] = Target((name,), tuple(engine.store.shapes[pid]), pid, None)
        else:
            by_id[id(t)] = Target((name,), tuple(t.shape), None, t)
    return list(by_id.values())


def _match(targets: list[Target], files: dict[str, str]) -> list[str]:
    """The name each Target is read under (its first name the file has); every problem at once."""
    from safetensors import safe_open
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if files.get(name) == file:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    absent = sorted(set(files) - set(shapes))
    known = {n for t in targets for n in t.names}
    missing, wrong, chosen = [], [], []
    for t in targets:
        present = [n for n in t.names if n in shapes]
        if not present:
            missing.append(f"  {' / '.join(t.names)}  {list(t.shape)}")
        wrong += [f"  {n}  {list(shapes[n])} in {_base(files[n])}, model has {list(t.shape)}"
                  for n in present if shapes[n] != t.shape]
        chosen.append(present[0] if present else "")
    unexpected = [f"  {n}  {list(shapes[n])} in {_base(files[n])}" for n in sorted(set(shapes) - known)]
    problems = [(f"{len(missing)} missing (in the model, in no file)", missing),
                (f"{len(unexpected)} unexpected (in a file, not in model.state_dict())", unexpected),
                (f"{len(wrong)} mis-shaped", wrong),
                (f"{len(absent)} listed in {INDEX} but absent from their file",
                 [f"  {n}  in {_base(files[n])}" for n in absent])]
    if any(lines for _, lines in problems):
        raise ValueError("load_weights: the weights do not fit the model; nothing was loaded\n" +
                         "\n".join(head + ":\n" + "\n".join(lines) for head, lines in problems if lines))
    return chosen


def _base(file: str) -> str:
    return os.path.basename(file)


# ---- reading this rank's part ----------------------------------------------------------------------

def _read(engine, targets: list[Target], chosen: list[str],
          files: dict[str, str]) -> dict[int, torch.Tensor]:
    """Target index -> its part for this rank: the flat range (hi - lo,) of a param in the file's
    dtype, or a buffer whole; a param whose range is empty gets none and reads nothing. Each file
    is opened once."""
    from safetensors import safe_open
    by_file: dict[str, list[int]] = {}
    for i, name in enumerate(chosen):
        by_file.setdefault(files[name], []).append(i)
    out: dict[int, torch.Tensor] = {}
    for file, items in by_file.items():
        with safe_open(file, framework="pt") as f:
            for i in items:
                t, name = targets[i], chosen[i]
                if t.pid is None:
                    out[i] = f.get_tensor(name)
                    continue
                lo, hi = _flat_range(t.shape, engine.shard_rank, engine.shard_world)
                if hi > lo:
                    piece = f.get_slice(name)
                    out[i] = torch.cat([piece[ix].reshape(-1) for ix in _pieces(t.shape, lo, hi)])
    return out


def _flat_range(shape: tuple[int, ...], rank: int, world_size: int) -> tuple[int, int]:
    """This rank's [lo, hi) of the flattened param, clipped to numel."""
    numel = 1
    for d in shape:
        numel *= d
    return layout.rank_span(numel, rank, world_size)


def _pieces(shape: tuple[int, ...], lo: int, hi: int, prefix: tuple = ()) -> Iterator[tuple]:
    """Indices whose reads, flattened and concatenated, are exactly flat [lo, hi) of a tensor of
    `shape` (row-major): whole rows as one slice, a partial first or last row split along the
    next dimension. At most 2 * ndim + 1 reads, and not one element outside the range."""
    if not shape:
        yield prefix  # a 0-d tensor: lo, hi = 0, 1
        return
    inner = 1
    for d in shape[1:]:
        inner *= d
    r0, r1 = lo // inner, -(-hi // inner)  # rows touched
    if lo % inner == 0 and hi % inner == 0:
        yield prefix + (slice(r0, r1),)
    elif r1 - r0 == 1:
        yield from _pieces(shape[1:], lo - r0 * inner, hi - r0 * inner, prefix + (slice(r0, r0 + 1),))
    else:
        yield from _pieces(shape[1:], lo - r0 * inner, inner, prefix + (slice(r0, r0 + 1),))
        if r1 - r0 > 2:
            yield prefix + (slice(r0 + 1, r1 - 1),)
        yield from _pieces(shape[1:], 0, hi - (r1 - 1) * inner, prefix + (slice(r1 - 1, r1),))


# ---- agreeing and writing --------------------------------------------------------------------------

@torch.no_grad()
def _write(engine, targets: list[Target], parts: dict[int, torch.Tensor]) -> None:
    """Masters (fp32, padding zeroed), compute shards, buffers; then the stale full params out."""
    store = engine.store
    for i, t in enumerate(targets):
        if t.pid is None:
            t.buffer.copy_(parts[i])
            continue
        master = store.masters[t.pid].data  # (s,)
        master.zero_()
        if i in parts:
            master[:parts[i].numel()].copy_(parts[i])
    store.refresh_shards()
    engine.apply(ShardsReplaced())
