"""[Note: flat steps] (fz3/shell/flat_step.py): each param group's masters step as a few flat
tensors, bit-identical to torch stepping them shard by shard, with the state torch keeps per
master still there (views of the chunks'), and every case that must step by shard doing so.

The per-shard run is the same engine with a step pre-hook on the optimizer (hooks would see the
chunks, so a hooked optimizer never steps flat): what fz3 did before flat steps.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fz3 import launch
from fz3.data import store as tensor_store
from fz3.shell.optim import shard_state_dict

pytestmark = pytest.mark.timeout(300)

STEPS = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(6, 9), nn.Linear(9, 7), nn.Linear(7, 1)
        self.aux = nn.Linear(7, 1)  # called only where `aux` says: a param with no grad

    def forward(self, x, aux: bool = False):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.c(h) + (self.aux(h) if aux else 0.0)


OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1),
    "adam-amsgrad": lambda groups: torch.optim.Adam(groups, lr=0.05, amsgrad=True, weight_decay=0.01),
    "sgd-nesterov": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1),
}


def _groups(model: Net, frozen_first: bool = False) -> list[dict]:
    """Weights and biases apart, interleaved in model order (decay / no decay, as HF builds);
    `frozen_first`: a's params frozen, in a group of their own before the others."""
    if frozen_first:
        model.a.requires_grad_(False)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and p.requires_grad]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias") and p.requires_grad]
    first = [{"params": list(model.a.parameters()), "lr": 1.0}] if frozen_first else []
    return first + [{"params": weights}, {"params": biases, "weight_decay": 0.0}]


def _train(rank: int, world: int, name: str, by_shard: bool, aux_steps: tuple[int, ...], chunk: int,
           frozen_first: bool) -> dict:
    import fz3
    tensor_store.MIN_SEGMENT = chunk  # thread ranks share the module: every rank sets the same
    model = Net()
    opt = OPTIMIZERS[name](_groups(model, frozen_first))
    if by_shard:
        opt.register_step_pre_hook(lambda *_: None)
    engine = fz3.initialize(model, opt, fz3.Config(param_persistence_threshold=0))
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        x = torch.randn(4, 6, generator=g)
        engine.backward(engine(x, aux=step in aux_steps).square().mean())
        engine.step()
    masters = engine.store.masters
    state = {(i, k): v.clone() for i, m in enumerate(masters) for k, v in opt.state.get(m, {}).items()}
    storages = [{k: v.untyped_storage().data_ptr() for k, v in opt.state[m].items() if v.ndim}
                for m in masters if opt.state.get(m)]
    return {"masters": [m.detach().clone() for m in masters], "state": state, "storages": storages,
            "chunks": [len(g.chunks) if g else 0 for g in engine.flat_steps.groups],
            "sd_keys": sorted(shard_state_dict(opt)["state"])}  # torch's own (opt.state_dict() refuses)


def _shared(storages: list[dict]) -> bool:
    """Some two masters' state lies in one storage: they stepped as one flat chunk."""
    seen = [s for d in storages for s in d.values()]
    return len(seen) > len(set(seen))


def _both(name: str, aux_steps=tuple(range(STEPS)), chunk: int = tensor_store.MIN_SEGMENT, frozen_first: bool = False):
    flat = launch.run_threads(_train, 2, args=(name, False, aux_steps, chunk, frozen_first))
    shard = launch.run_threads(_train, 2, args=(name, True, aux_steps, chunk, frozen_first))
    tensor_store.MIN_SEGMENT = 1 << 16
    return flat, shard


def _assert_same(flat: list[dict], shard: list[dict]) -> None:
    for a, b in zip(flat, shard):
        for x, y in zip(a["masters"], b["masters"]):
            assert torch.equal(x, y)
        assert a["state"].keys() == b["state"].keys()
        for k, v in a["state"].items():
            assert torch.equal(v, b["state"][k]), k
        assert a["sd_keys"] == b["sd_keys"]  # state_dict() names the masters, never a chunk


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_flat_step_is_bit_identical_to_stepping_shard_by_shard(name):
    flat, shard = _both(name)
    _assert_same(flat, shard)
    if name != "sgd":  # plain SGD keeps no state
        assert _shared(flat[0]["storages"]) and not _shared(shard[0]["storages"])
    assert flat[0]["chunks"] == [1, 1]  # weights and biases: one chunk each, both groups


def test_chunks_hold_whole_shards_up_to_the_chunk_size():
    # a floor of 8 elements: the weight shards (27, 32, 4, 4) in chunks of up to the largest, 32:
    # a's and b's alone, c's and aux's together; the bias shards (5, 4, 1, 1) in chunks of 8: two
    flat, shard = _both("adamw", chunk=8)
    _assert_same(flat, shard)
    assert flat[0]["chunks"] == [3, 2]
    assert _shared(flat[0]["storages"])


def test_a_group_of_frozen_params_takes_no_chunk_and_moves_no_other_group():
    # the first group holds only frozen params: its run is empty, the others' runs stay theirs
    flat, shard = _both("adamw", frozen_first=True)
    _assert_same(flat, shard)
    assert flat[0]["chunks"] == [0, 1, 1] and _shared(flat[0]["storages"])


def test_a_param_without_grad_sends_its_group_to_shard_steps_for_good():
    # aux runs at steps 0, 1 and 3: both groups (aux has a weight and a bias) step flat at 0 and
    # 1, by shard at 2 (aux has no grad: it must not step), and by shard at 3 too, as aux's step
    # count is behind the others' for good
    flat, shard = _both("adamw", aux_steps=(0, 1, 3))
    _assert_same(flat, shard)
    steps = {k: float(v) for k, v in flat[0]["state"].items() if k[1] == "step"}
    assert sorted(set(steps.values())) == [3.0, 4.0]


def _set_by_hand(rank: int, world: int) -> dict:
    """A state the user replaces between steps is what the next step reads (taken in flat)."""
    import fz3
    model = Net()
    opt = OPTIMIZERS["adamw"](_groups(model))
    engine = fz3.initialize(model, opt, fz3.Config(param_persistence_threshold=0))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        engine.backward(engine(x, aux=True).square().mean())
        engine.step()
    for m in engine.store.masters:
        if m in opt.state:
            opt.state[m]["exp_avg"] = torch.zeros_like(m)  # a new tensor, not the chunk's view
            opt.state[m]["exp_avg_sq"].fill_(1.0)  # in place, through the view where flat
    engine.backward(engine(x, aux=True).square().mean())
    engine.step()
    return {"masters": [m.detach().clone() for m in engine.store.masters], "shared": _shared([{k: v.untyped_storage().data_ptr() for k, v in opt.state[m].items()
                                                   if v.ndim} for m in engine.store.masters])}


def test_a_state_set_by_hand_is_what_the_next_step_reads():
    flat = launch.run_threads(_set_by_hand, 2)
    handle = register_optimizer_step_pre_hook(lambda *_: None)  # every optimizer steps by shard
    try:
        shard = launch.run_threads(_set_by_hand, 2)
    finally:
        handle.remove()
    for a, b in zip(flat, shard):
        for x, y in zip(a["masters"], b["masters"]):
            assert torch.equal(x, y)
    assert flat[0]["shared"] and not shard[0]["shared"]
