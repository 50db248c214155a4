"""The optimizer's state as an unsharded optimizer has it (issue #45 point 4; fz3/io/optimizer_state.py).

nanoGPT saves `optimizer.state_dict()` on rank 0 and resumes with `optimizer.load_state_dict`.
On 2 gloo ranks, against plain torch AdamW in one process over the same model and batches:

    engine.full_optimizer_state_dict()   == the plain optimizer's state_dict(): indices, keys,
                                            shapes, values, param_groups
    optimizer.state_dict()               RuntimeError naming the call above, on any rank
    optimizer.load_state_dict(plain's)   each rank takes its slices; training goes on at parity
    optimizer.load_state_dict(shards)    refused
    full_optimizer_state_dict on rank 0 alone   DivergenceError on both ranks, naming the call

The model has a tied embedding / head, odd numels (shards with padding) and a 0-dim param (whose
per-element state is as 0-dim as its `step`).
"""
from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)
STEPS, WORLD = 3, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(13, 7)
        self.mid = nn.Linear(7, 5)
        self.mid2 = nn.Linear(5, 7)
        self.head = nn.Linear(7, 13, bias=False)
        self.head.weight = self.emb.weight  # tied: one param, one state entry
        self.scale = nn.Parameter(torch.tensor(0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, T, 7)
        h = h + self.mid2(torch.tanh(self.mid(h)))
        return self.head(h) * self.scale  # (B, T, 13)


def _optimizer(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for _, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2)


def _loss(model, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(13, (3, 5), generator=g)  # (B, T)
    y = torch.randint(13, (3, 5), generator=g)
    return F.cross_entropy(model(x).reshape(-1, 13), y.reshape(-1))


def _reference(steps: range, model=None, opt=None):
    """Plain torch in one process: the mean of every rank's loss, as fz3 averages their grads."""
    model = Net() if model is None else model
    opt = _optimizer(model) if opt is None else opt
    for s in steps:
        opt.zero_grad()
        (sum(_loss(model, s, r) for r in range(WORLD)) / WORLD).backward()
        opt.step()
    return model, opt


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def _ranks(rank: int, world: int) -> dict:
    import fz3
    from fz3.shell.optim import shard_state_dict
    model = Net()
    engine = fz3.initialize(model, _optimizer(model), fz3.Config(param_persistence_threshold=0))
    for s in range(STEPS):
        engine.backward(_loss(engine, s, rank))
        engine.step()
    out = {"full": engine.full_optimizer_state_dict()}
    try:
        engine.optimizer.state_dict()
    except RuntimeError as e:
        out["refused"] = str(e)
    try:
        engine.optimizer.load_state_dict(shard_state_dict(engine.optimizer))
    except ValueError as e:
        out["shards_refused"] = str(e)
    # nanoGPT's resume: the model's weights and rank 0's saved optimizer.state_dict(), every rank
    ref_model, ref_opt = _reference(range(STEPS))
    saved = _round_trip({"model": ref_model.state_dict(), "optimizer": ref_opt.state_dict()})
    model = Net()
    model.load_state_dict(saved["model"])
    resumed = fz3.initialize(model, _optimizer(model), fz3.Config(param_persistence_threshold=0))
    resumed.optimizer.load_state_dict(saved["optimizer"])
    out["loaded"] = resumed.full_optimizer_state_dict()
    for s in range(STEPS, STEPS + 2):
        resumed.backward(_loss(resumed, s, rank))
        resumed.step()
    out["resumed_params"] = resumed.full_state_dict()
    try:  # rank 0 alone, as under `if master_process:`; rank 1 trains on
        if rank == 0:
            resumed.full_optimizer_state_dict()
        else:
            resumed.backward(_loss(resumed, 9, rank))
        out["alone"] = None
    except fz3.DivergenceError as e:
        out["alone"] = str(e)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return launch.run(_ranks, world_size=WORLD, timeout=200)


def _assert_same_state_dict(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, entry in want["state"].items():
        assert list(got["state"][i]) == list(entry), i  # keys, in torch's order
        for k, v in entry.items():
            assert got["state"][i][k].shape == v.shape and got["state"][i][k].dtype == v.dtype, (i, k)
            torch.testing.assert_close(got["state"][i][k], v, rtol=1e-5, atol=1e-7, msg=f"state {i} {k!r}")


def test_full_optimizer_state_dict_is_the_plain_optimizers_on_every_rank(runs):
    _, ref_opt = _reference(range(STEPS))
    want = ref_opt.state_dict()
    assert want["state"][0]["exp_avg"].shape == (13, 7) and want["state"][3]["exp_avg"].shape == ()  # scale
    for out in runs:
        _assert_same_state_dict(out["full"], want)


def test_optimizer_state_dict_refuses_naming_the_call_that_gathers(runs):
    for rank, out in enumerate(runs):
        msg = out["refused"]
        assert msg.startswith(f"fz3: optimizer.state_dict() of an optimizer fz3 shards: this rank (rank {rank} of "
                              "2) holds only its flat shard of each param's state (exp_avg of 'emb.weight' is (46,) "
                              "here, (13, 7) unsharded), which an unsharded optimizer cannot load. Call "
                              "engine.full_optimizer_state_dict() on every rank (it gathers: not under `if "
                              "master_process:`)"), msg
        assert "engine.save_checkpoint(save_dir)" in msg, msg


def test_loading_the_plain_optimizers_state_dict_resumes_at_parity(runs):
    ref_model, ref_opt = _reference(range(STEPS))
    want = _round_trip(ref_opt.state_dict())  # a copy: the steps below write the state in place
    _reference(range(STEPS, STEPS + 2), ref_model, ref_opt)
    for out in runs:
        _assert_same_state_dict(out["loaded"], want)
        for k, v in ref_model.state_dict().items():
            torch.testing.assert_close(out["resumed_params"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_a_state_dict_of_shards_is_refused(runs):
    for out in runs:
        msg = out["shards_refused"]
        assert msg.startswith("optimizer.load_state_dict: state 'exp_avg' of param 'emb.weight' (index 0) has shape "
                              "(46,), the param (13, 7): this is not the state dict of an unsharded optimizer"), msg


def test_full_optimizer_state_dict_on_one_rank_alone_stops_both(runs):
    for out in runs:
        msg = out["alone"]
        # collective 1 of the step: the full_state_dict() every rank made
        assert msg is not None and "rank 0: step 3, collective 2: engine.full_optimizer_state_dict()'s gather of " \
                                   "the optimizer state" in msg, msg
        assert "engine.full_optimizer_state_dict() needs every rank (each holds only its shards): every rank must " \
               "call it at the same point of its program, not under `if master_process:`." in msg, msg
