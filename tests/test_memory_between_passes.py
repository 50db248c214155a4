"""What a rank holds between passes and at the backward's peak (issue #11: wide GPT peak RSS).

Three rules, each checked on 2 gloo ranks with fz3's defaults (DeepSpeed's) but for
param_persistence_threshold 0 (this tiny GPT's params are all below 1e5 elements, and
persistent params are never freed), numbers against one process:

  - the grad partitions' memory exists from a window's first write to its optimizer step
    (effects.FreePartitions): after engine.step() a rank holds no gradient memory;
  - the CPU buffer pool keeps a buffer only for a gather of the same pass (Free.refetch) and
    drops the rest at the end of the backward: after a step it holds nothing, and with
    max_reuse_distance=0 the backward's gathers still reuse the forward's buffers;
  - a call with no grad-requiring input whose forward saved none of its params (the token
    embedding) needs no fetch in backward ([Note: backward reads no param], engine.py): the tied
    embedding / lm_head weight is freed before the embedding's backward, where autograd holds the
    lm_head's grad, the embedding's and their sum. A call whose forward did save its param (a
    custom autograd Function) is still gathered for its backward.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)


def _gpt(d_model: int = 32):
    from gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=128, d_model=d_model, n_head=4, n_layer=2, seq=16))


def _free_pooled(engine) -> int:
    """Bytes the pool keeps that nobody uses."""
    from fz3.data.pool import _users
    return sum(t.numel() * t.element_size() for t in engine.interp.buffers_pool.kept() if _users(t) == 0)


def _train(rank: int, world: int, config: dict, d_model: int = 32) -> dict:
    import fz3
    from gpt import loss_fn, markov_batch
    model, ref = _gpt(d_model), _gpt(d_model)
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5),
                            fz3.Config(param_persistence_threshold=0, **config))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    wte = model.wte.weight
    out = {"status_at_embedding_backward": [], "after_backward": [], "after_step": [], "hits": []}

    def at_embedding_backward(module, inputs, output):  # runs in forward; its hook in backward
        output.register_hook(lambda g: out["status_at_embedding_backward"].append(engine.param_status(wte)))
    model.wte.register_forward_hook(at_embedding_backward)
    for step in range(3):
        x, y = markov_batch(step, batch=4, seq=16, vocab=128)
        per = 4 // world
        hits = engine.interp.buffers_pool.hits
        loss = loss_fn(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        out["hits"].append(engine.interp.buffers_pool.hits - hits)
        s = engine.stats()
        out["after_backward"].append((s["grad_partitions"], _free_pooled(engine)))
        engine.step()
        s = engine.stats()
        out["after_step"].append((s["grad_partitions"], _free_pooled(engine),
                                  [m.grad is None for m in engine.store.masters]))
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        opt.step()
    out["masters"] = sum(m.numel() for m in engine.store.masters)
    out["pooled_params"] = sum(s.numel() * 4 >= engine.interp.buffers_pool.min_bytes for s in engine.store.shapes)
    full = engine.full_state_dict()
    out["max_diff"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return out


def test_between_steps_a_rank_holds_no_grads_and_no_pooled_buffers():
    for rank, out in enumerate(launch.run(_train, world_size=2, args=({},), timeout=240)):
        for step, ((grads, _), (grads_after, pool_after, unbound)) in enumerate(
                zip(out["after_backward"], out["after_step"])):
            assert grads == 4 * out["masters"], (rank, step, grads)  # written in the backward
            assert grads_after == 0 and all(unbound), (rank, step, grads_after)
            assert pool_after == 0, (rank, step, pool_after)
        assert out["max_diff"] < 1e-5, f"rank {rank}: params differ from one process by {out['max_diff']}"


def test_tied_weight_is_freed_before_the_embedding_backward():
    for rank, out in enumerate(launch.run(_train, world_size=2, args=({},), timeout=240)):
        # DeepSpeed's defaults keep every param gathered from forward to backward; the lm_head's
        # backward was the tied weight's last reader
        assert out["status_at_embedding_backward"] == ["NOT_AVAILABLE"] * 3, (rank, out)


def test_backward_regathers_reuse_the_forward_buffers():
    config = {"max_reuse_distance": 0}
    # d_model 128: the blocks' weights (16 Ki to 64 Ki elements) and the tied embedding are
    # pooled, the biases and norms are below the pool's least size ([Note: small buffers
    # unpooled], fz3/data/pool.py)
    for rank, out in enumerate(launch.run(_train, world_size=2, args=(config, 128), timeout=240)):
        # every module's backward gathers again into the buffers its forward let go of: at
        # least one hit per pooled param a step (and the collectives' scratch)
        assert out["pooled_params"] == 9, out["pooled_params"]  # qkv, proj, fc, fc2 of 2 blocks; wte
        assert all(h >= out["pooled_params"] for h in out["hits"][1:]), (rank, out["hits"])
        assert all(pool == 0 for _, pool, _ in out["after_step"]), (rank, out["after_step"])
        assert out["max_diff"] < 1e-5, (rank, out["max_diff"])


READ_IN_BACKWARD: list[tuple] = []  # (shape, stride) of the weight each ScaleRows backward read


class ScaleRows(torch.autograd.Function):
    """weight[ids] * weight.sum(), saving the weight Parameter itself: its backward reads it."""

    @staticmethod
    def forward(ctx, weight, ids):
        ctx.save_for_backward(weight, ids)
        return weight[ids] * weight.sum()

    @staticmethod
    def backward(ctx, grad):
        weight, ids = ctx.saved_tensors
        READ_IN_BACKWARD.append((tuple(weight.shape), weight.stride()))
        g = torch.zeros_like(weight).index_add_(0, ids.reshape(-1), grad.reshape(-1, weight.shape[1]))
        rows = weight[ids]
        return g * weight.sum() + (grad * rows).sum(), None


class SavesItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 8))

    def forward(self, ids):
        return ScaleRows.apply(self.weight, ids)


class TableWithOffset(nn.Module):
    """Token ids in, no param saved for backward: a table and a 0-d offset (add saves nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 8))
        self.offset = nn.Parameter(torch.tensor(0.5))

    def forward(self, ids):
        return torch.nn.functional.embedding(ids, self.weight) + self.offset


class TableNet(nn.Module):
    def __init__(self, table: type) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = table()
        self.head = nn.Linear(8, 4)

    def forward(self, ids):
        return self.head(self.table(ids)).square().mean()


def _train_table(rank: int, world: int, table: type) -> dict:
    """Two SGD steps of TableNet(table) on 2 ranks against one process, no persistent params;
    -> what ScaleRows' backwards read of the weight and the largest param difference."""
    import fz3
    net, ref = TableNet(table), TableNet(table)
    engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = torch.arange(12).reshape(4, 3) % 16
    seen = []
    for _ in range(2):
        before = len(READ_IN_BACKWARD)
        engine.backward(engine(ids[rank * 2:(rank + 1) * 2]))
        seen += READ_IN_BACKWARD[before:]
        engine.step()
        opt.zero_grad()
        torch.stack([ref(ids[r * 2:(r + 1) * 2]) for r in range(world)]).mean().backward()
        opt.step()
    full = engine.full_state_dict()
    return {"seen": seen, "max_diff": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())}


def test_a_call_whose_forward_saved_its_param_is_gathered_for_its_backward():
    for rank, out in enumerate(launch.run(_train_table, world_size=2, args=(SavesItsWeight,), timeout=240)):
        # the gathered full value, not the empty freed .data nor a shape-only placeholder
        assert out["seen"] == [((16, 8), (8, 1))] * 2, (rank, out["seen"])
        assert out["max_diff"] < 1e-6, (rank, out["max_diff"])


def test_a_freed_0d_param_keeps_its_shape_until_its_grad_is_in():
    """The table's forward reads no param for backward, so both its params are freed before
    their grads arrive; AccumulateGrad needs their shapes, a 0-d one included."""
    for rank, out in enumerate(launch.run(_train_table, world_size=2, args=(TableWithOffset,), timeout=200)):
        assert out["max_diff"] < 1e-6, (rank, out["max_diff"])


def _read_between(rank: int, world: int) -> dict:
    import fz3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0))
    ids = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(rank))
    loss = nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.flatten())
    weight = model[0].weight  # read past fz3's hooks: between the forward and its backward
    out = {"shape": tuple(weight.shape), "all_nan": bool(torch.isnan(weight).all())}
    engine.backward(loss)
    engine.step()
    out["grad_fine"] = engine.get_global_grad_norm() is not None and engine.was_step_applied()
    return out


def test_a_freed_param_read_past_the_hooks_is_nan_not_garbage():
    """The embedding's weight is freed after its forward, its grad still due (it keeps its
    shape over one element for AccumulateGrad); a read of it fz3 cannot see gives NaN, where it
    gave whatever the element's memory held (fz3.check found it: a head tied through a list)."""
    for out in launch.run_threads(_read_between, 2):
        assert out == {"shape": (16, 8), "all_nan": True, "grad_fine": True}, out
