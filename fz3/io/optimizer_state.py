"""The optimizer's state the way an unsharded optimizer has it, in and out.

    engine.full_optimizer_state_dict()     every rank (a collective): what optimizer.state_dict()
                                           of the same torch optimizer over the unsharded model
                                           returns after the same training: its state indices,
                                           keys, group settings, each tensor in its param's shape
    optimizer.state_dict()                 RuntimeError naming the call above (never the flat
                                           shards under torch's keys)
    optimizer.load_state_dict(full)        each rank takes its slices of an unsharded state dict
                                           (no collective); a sharded one is refused

[Note: optimizer state of a sharded optimizer] fz3 rebinds the user's optimizer to this rank's
fp32 master shards (fz3/shell/optim.py), so torch's own state_dict() of it answers this rank's
flat shards under torch's keys: nanoGPT's `torch.save(optimizer.state_dict())` silently saved
`exp_avg` of shape (2080,) where DDP saves (65, 64), which no unsharded optimizer can load. Two
answers were possible: (a) state_dict() gathers and returns what the unsharded optimizer would;
(b) state_dict() refuses, naming the call that gathers. fz3 takes (b). A gather is a collective:
every rank must enter it. nanoGPT calls optimizer.state_dict() on rank 0 alone (under `if
master_process:`), so (a) would put rank 0 in a collective the training ranks never join: a hang
until the group's timeout, or at best a DivergenceError at their next gather, instead of a
message at the call. (b) answers at once on whichever rank calls it, with what to do: call
engine.full_optimizer_state_dict() on every rank (it checks that every rank is there: a rank
calling it alone stops with a DivergenceError naming it), then save it on rank 0. fz3's own
checkpoint and flat step read the shards through shell/optim.py's `shard_state_dict`. Loading
needs no collective, each rank slicing its part of the whole, so optimizer.load_state_dict of an
unsharded state dict is simply done. FSDP2 answers the same question with
get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True)).
DeepSpeed: its ZeRO optimizer's state_dict() returns its own flat partitions.
"""
from __future__ import annotations

import weakref

import torch

from fz3.data import layout
from fz3.interpreters import agreement
from fz3.interpreters.agree import every_rank
from fz3.shell.optim import load_shard_state_dict, shard_state_dict


def _param_of_index(engine) -> list[int]:
    """The ParamId of each state index of torch's state_dict of the bound optimizer (its groups'
    masters, in order: bind_optimizer kept the user's order, each param once)."""
    pid = {id(m): p for p, m in enumerate(engine.store.masters)}
    return [pid[id(m)] for g in engine.optimizer.param_groups for m in g["params"]]


def _sharded(engine, p: int, key, value) -> bool:
    """Whether optimizer state `key` of param p is this rank's flat shard of a per-element tensor."""
    return key != "step" and isinstance(value, torch.Tensor) and value.shape == engine.store.masters[p].shape


def full_optimizer_state_dict(engine) -> dict:
    """Every rank must call it (it gathers each per-element state tensor whole); -> on every rank,
    the state dict torch's optimizer.state_dict() returns for the same optimizer over the
    unsharded model: state by index (the model's param order in the groups), every state tensor
    in its param's full shape, on the CPU; `step` and other scalars as they are; param_groups as
    the optimizer has them. [Note: optimizer state of a sharded optimizer]"""
    sd = shard_state_dict(engine.optimizer)
    index_param = _param_of_index(engine)
    todo = [(i, k) for i in sorted(sd["state"]) for k, v in sd["state"][i].items()
            if _sharded(engine, index_param[i], k, v)]
    every_rank(engine, agreement.OPTIMIZER_STATE, len(todo))  # and gathers as many tensors
    state = {i: {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
             for i, entry in sd["state"].items()}
    for i, k in todo:
        p = index_param[i]
        shard = sd["state"][i][k].detach().to(engine.store.device).contiguous()  # (s,); host state (offload) too
        if not shard.numel():  # a param of no elements: nothing to gather on any rank
            state[i][k] = shard.cpu().view(engine.store.shapes[p])
            continue
        whole = torch.empty(shard.numel() * engine.world_size, dtype=shard.dtype, device=shard.device)  # (W * s,)
        engine.transport.all_gather_into(whole, shard)
        state[i][k] = whole[:engine.spec.params[p].numel].view(engine.store.shapes[p]).cpu().clone()
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optimizer_state_dict(engine, sd: dict) -> None:
    """optimizer.load_state_dict of an unsharded state dict (what full_optimizer_state_dict, or a
    plain torch optimizer over the same model, returned): each rank takes its slice of every
    per-element tensor; nothing is gathered. A state dict of flat shards is refused."""
    index_param = _param_of_index(engine)
    state = {}
    for i, entry in sd.get("state", {}).items():
        if not isinstance(i, int) or not 0 <= i < len(index_param):
            raise ValueError(f"optimizer.load_state_dict: state index {i!r} is not one of this optimizer's "
                             f"{len(index_param)} params")
        p = index_param[i]
        name, shape = engine.tables.names[p], tuple(engine.store.shapes[p])
        state[i] = {}
        for k, v in entry.items():
            if k != "step" and isinstance(v, torch.Tensor) and v.ndim >= 1 and tuple(v.shape) != shape:
                raise ValueError(
                    f"optimizer.load_state_dict: state {k!r} of param {name!r} (index {i}) has shape "
                    f"{tuple(v.shape)}, the param {shape}: this is not the state dict of an unsharded optimizer "
                    "(a rank's flat shards, as torch's own state_dict of a ZeRO-3 optimizer returns them?). "
                    "Load what engine.full_optimizer_state_dict() or a plain torch optimizer over this model "
                    "returned, or resume fz3's sharded checkpoint with engine.load_checkpoint(save_dir)")
            if k != "step" and isinstance(v, torch.Tensor) and tuple(v.shape) == shape:
                v = layout.rank_slice(v.detach().reshape(-1), engine.shard_rank, engine.shard_world).clone()  # (s,)
            state[i][k] = v
    load_shard_state_dict(engine.optimizer, {**sd, "state": state})


def install(engine) -> None:
    """optimizer.state_dict and optimizer.load_state_dict of `engine`'s optimizer, answered as
    above (instance attributes over torch's methods, which fz3's own readers call through
    shell/optim.py)."""
    opt, ref = engine.optimizer, weakref.ref(engine)
    if not isinstance(opt, torch.optim.Optimizer):
        return

    def state_dict():
        raise RuntimeError(_refusal(ref()))

    def load_state_dict(sd):
        load_full_optimizer_state_dict(ref(), sd)
    opt.state_dict, opt.load_state_dict = state_dict, load_state_dict


def _refusal(engine) -> str:
    """optimizer.state_dict()'s error: what it would have returned (a state tensor's shard shape
    beside its param's), and the calls to use instead."""
    sd, index_param = shard_state_dict(engine.optimizer), _param_of_index(engine)
    example = next(((k, engine.tables.names[index_param[i]], tuple(v.shape), tuple(engine.store.shapes[index_param[i]]))
                    for i in sorted(sd["state"]) for k, v in sd["state"][i].items()
                    if _sharded(engine, index_param[i], k, v)), None)
    seen = "" if example is None else \
        f" ({example[0]} of {example[1]!r} is {example[2]} here, {example[3]} unsharded)"
    return (f"fz3: optimizer.state_dict() of an optimizer fz3 shards: this rank (rank {engine.rank} of "
            f"{engine.world_size}) holds only its flat shard of each param's state{seen}, which an unsharded "
            "optimizer cannot load. Call engine.full_optimizer_state_dict() on every rank (it gathers: not "
            "under `if master_process:`) for what the unsharded optimizer's state_dict() returns, keys and "
            "shapes as torch's, and save it on rank 0 (optimizer.load_state_dict takes it back on every rank); "
            "or save and resume with engine.save_checkpoint(save_dir) and engine.load_checkpoint(save_dir) "
            "on every rank (sharded, any world size)")
