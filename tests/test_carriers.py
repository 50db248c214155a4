"""Each carrier alone (fz3/interpreters/carriers.py), on 2 and 3 thread ranks: its gather gives
every rank the params' full values, and its reduce gives every rank its own slice of the SUM of
the ranks' grads, for odd sizes (padded shards, empty ones at W=3) and batches of several params.

The carrier is taken from a real engine's interpreter (its pool, transport and divergence check)
and called directly, on the engine's own shards and on drawn small-integer grads. Then the
interpreter follows the core's route for each grad (fz3.core.grad.grads.grad_route): told that its
carrier reads grads in place (p2p), the core holds them (HoldGrad) and no bucket buffer is made;
with the native carrier it copies them (CopyToBucket); the partitions are the same bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fz3 import launch
from fz3.core.effects import AllGather, CopyToBucket, HoldGrad, ReduceBucket, Slot, Wait
from fz3.core.ids import BucketId, Handle
from fz3.data import layout

SIZES = [(3, 1), (1, 5), (7, 2)]  # Linear(in, out): weights of 3, 5, 14 elements, biases of 1, 5, 2


def _carrier(rank: int, world: int, name: str) -> dict:
    import fz3
    from fz3.interpreters.carriers import CARRIERS
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(i, o) for i, o in SIZES))
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0))
    it = engine.interp
    carrier = CARRIERS[name](it.gather.ctx)  # the context the interpreter built for its own
    ps = tuple(range(len(engine.spec.params)))
    work, fulls, keep = carrier.gather(ps, [it.store.shards[p] for p in ps])
    if work is not None:
        work.wait()
    gathered = [f.clone() for f in fulls()]
    grads = [torch.arange(n, dtype=torch.float32) * (rank + 1) + rank for n in (s.numel for s in engine.spec.params)]
    offsets = [sum(g.numel() for g in grads[:i]) for i in range(len(grads))]
    e = ReduceBucket(bucket=BucketId(0), slots=tuple(Slot(p, o, g.numel()) for p, o, g in zip(ps, offsets, grads)),
                     path="allreduce" if name == "all_reduce" else "reduce_scatter", dtype="float32",
                     predivide=1.0, contiguous=False)
    work, finish, keep = carrier.reduce(e, [g.clone() for g in grads], None)
    if work is not None:
        work.wait()
    reduced = {p: t.clone() for p, t in finish().items()}
    full = [model_param.detach().reshape(-1).clone() for model_param in _fulls(engine)]
    return {"gathered": gathered, "reduced": reduced, "full": full, "grads": grads}


def _fulls(engine):
    state = engine.full_state_dict()
    return [state[n] for n in engine.tables.names]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["p2p", "native", "all_reduce"])
def test_a_carrier_gathers_full_values_and_reduces_each_rank_its_slice(name, world):
    outs = launch.run_threads(_carrier, world, args=(name,))
    total = [sum(out["grads"][i] for out in outs) for i in range(len(outs[0]["grads"]))]
    for r, out in enumerate(outs):
        for got, want in zip(out["gathered"], out["full"]):
            assert torch.equal(got.reshape(-1)[:want.numel()], want), (name, r)
        for p, part in out["reduced"].items():
            assert torch.equal(part, layout.shard(total[p], world)[r]), (name, r, p)


def _refresh(rank: int, world: int, name: str) -> dict:
    """A carrier's refresh into full values filled with garbage: -> what they hold after, and
    whether they are still the same tensors."""
    import fz3
    from fz3.interpreters.carriers import CARRIERS
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(i, o) for i, o in SIZES))
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0))
    it = engine.interp
    carrier = CARRIERS[name](it.gather.ctx)
    ps = tuple(range(len(engine.spec.params)))
    fulls = [torch.full((s.numel,), float("nan")) for s in engine.spec.params]
    kept = [f.data_ptr() for f in fulls]
    for _ in range(2):  # the second by the layout the first made (p2p)
        work, then = carrier.refresh(ps, [it.store.shards[p] for p in ps], fulls)
        if work is not None:
            work.wait()
        then()
    return {"fulls": [f.clone() for f in fulls], "in_place": [f.data_ptr() for f in fulls] == kept,
            "full": [t.detach().reshape(-1).clone() for t in _fulls(engine)]}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["p2p", "native", "all_reduce"])
def test_a_carrier_refreshes_full_values_where_they_lie(name, world):
    """effects.Refresh: the step's gather of the persistent params writes into the full values
    they have (no buffer taken, no param set again)."""
    for r, out in enumerate(launch.run_threads(_refresh, world, args=(name,))):
        assert out["in_place"], (name, r)
        for got, want in zip(out["fulls"], out["full"]):
            assert torch.equal(got, want), (name, r)


def _persistent_steps(rank: int, world: int) -> dict:
    """Three steps with every param persistent, then a hold over a step and its release: where
    the params' full values lie after each step, and what the p2p carrier keeps."""
    import fz3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fz3.Config())
    ptrs, layouts, values, reduces = [], [], [], []
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
        ptrs.append([p.data_ptr() for p in model.parameters()])
        layouts.append(engine.interp.gather.layout)
        reduces.append(dict(engine.interp.reduce_scatter.reduce_layouts))
        values.append(all(torch.equal(p.detach(), v) for p, v in zip(model.parameters(),
                                                                      engine.full_state_dict().values())))
    return {"ptrs": ptrs, "layouts": layouts, "values": values, "reduces": reduces}


def test_the_step_refreshes_persistent_params_in_place_by_one_layout():
    """After the step the persistent params keep their memory (the same data_ptr every step),
    hold the new values, and the p2p carrier's layouts are made once, then reused: the
    refresh's, and each bucket's reduce's (p2p.ReduceLayout)."""
    for out in launch.run_threads(_persistent_steps, 2):
        assert out["ptrs"][0] == out["ptrs"][1] == out["ptrs"][2]
        assert all(out["values"])
        assert out["layouts"][0] is not None and out["layouts"][0] is out["layouts"][1] is out["layouts"][2]
        first = out["reduces"][0]
        assert first and all(r.keys() == first.keys() and all(r[k] is first[k] for k in r) for r in out["reduces"])


def _sharded_steps(rank: int, world: int) -> list[dict]:
    """The p2p carrier's gather plans after each of three steps, every param sharded."""
    import fz3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0))
    plans = []
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
        plans.append(dict(engine.interp.gather.gather_plans))
    return plans


def test_a_gathers_spans_are_planned_once_per_param_set():
    """p2p.GatherPlan: the spans of a gather of the same params are made the first time and
    reused every later time; only the slices of the new full values are made again. (The first
    step gathers module by module, the next ones as the recorded trace prefetches.)"""
    for plans in launch.run_threads(_sharded_steps, 2):
        assert plans[1] and plans[1].keys() == plans[2].keys()
        for a, b in zip(plans, plans[1:]):
            assert all(b[k] is a[k] for k in a), (a, b)


def _stale_graph(rank: int, world: int) -> str:
    """A graph built before a step, backwarded after it: -> the error, or "no error"."""
    import fz3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fz3.Config())
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    kept = engine(torch.randn(2, 4)).sum()
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    try:
        kept.backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_graph_from_before_the_refresh_fails_loudly_as_in_torch():
    """The refresh writes the persistent params in place: a graph saved before it must not read
    the new values silently (plain torch raises the same after optimizer.step())."""
    for msg in launch.run(_stale_graph, world_size=2, timeout=120):
        assert "modified by an inplace operation" in msg, msg


def _forgotten(rank: int, world: int) -> dict:
    """A non-persistent param held by gathered_parameters over a step is refreshed; once the hold
    goes and it is freed, the p2p carrier no longer keeps a view of its full value."""
    import fz3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0))
    w = model[0].weight
    with fz3.gathered_parameters([w]):
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
        during = engine.interp.gather.layout is not None
    return {"during": during, "after": engine.interp.gather.layout}


def test_a_freed_param_leaves_no_view_in_the_carrier():
    for out in launch.run_threads(_forgotten, 2):
        assert out["during"] and out["after"] is None


def _route(rank: int, world: int, carrier: str) -> dict:
    """A backward's grads (reverse param order, buckets of 12 elements) through the core with the
    interpreter's `capabilities.in_place_reduce_scatter`, run by that interpreter; -> what it did."""
    import fz3
    from fz3.core.grad import epilogue, grads
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(i, o) for i, o in SIZES))
    config = fz3.Config(param_persistence_threshold=0, reduce_bucket_size=12)
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config,
                            options=fz3.Options(gloo_reduce_scatter=carrier))
    it, spec = engine.interp, engine.spec
    ps = tuple(range(len(spec.params)))
    it.run([AllGather(Handle(10**6), ps, False, False), Wait(Handle(10**6))])  # shapes for .grad
    state = grads.init_grad_state(spec, in_place_reduce_scatter=it.capabilities.in_place_reduce_scatter)
    sent = [torch.arange(s.numel, dtype=torch.float32) * (rank + 1) - rank for s in spec.params]
    placed, most = [], 0
    for p in reversed(ps):
        it.store.params[p].grad = sent[p].view(it.store.params[p].shape).clone()
        state, eff = grads.bucket_add(state, p, config=config)
        it.run(eff)
        placed += [type(e).__name__ for e in eff if isinstance(e, (CopyToBucket, HoldGrad))]
        most = max(most, it.bucket_bytes())
    state, eff = epilogue.epilogue(state, config=config)
    it.run(eff)
    state, eff = epilogue.micro_step_end(state, config=config)  # the step(): the average
    it.run(eff)
    return {"in_place": it.capabilities.in_place_reduce_scatter, "placed": placed, "bucket_bytes": most,
            "parts": [it.store.partitions[p].clone() for p in ps], "sent": sent}


@pytest.mark.parametrize("world", [2, 3])
def test_the_interpreter_holds_or_copies_as_the_core_says(world):
    """p2p sends each grad from where it lies and native packs the held grads in its one copy-in
    (_chunk_cat): both hold; the all-reduce carrier reduces a flat bucket: it copies."""
    runs = {c: launch.run_threads(_route, world, args=(c,)) for c in ("p2p", "native", "all_reduce")}
    for r in range(world):
        copied = runs["all_reduce"][r]
        assert not copied["in_place"] and set(copied["placed"]) == {"CopyToBucket"} and copied["bucket_bytes"] > 0
        for held in (runs["p2p"][r], runs["native"][r]):
            assert held["in_place"] and set(held["placed"]) == {"HoldGrad"} and held["bucket_bytes"] == 0, held
            for p, (a, b) in enumerate(zip(held["parts"], copied["parts"])):
                total = sum(out["sent"][p] for out in runs["p2p"]) / world
                assert torch.equal(a, b) and torch.equal(a, layout.shard(total, world)[r]), (r, p)


def _train(rank: int, world: int, coalesce: int, persistence: int) -> dict:
    """Three steps of a model of many small params on the p2p carriers; -> losses, the full params
    after, and the sends posted."""
    import fz3
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6)) for _ in range(5)), nn.Linear(6, 1))
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                            fz3.Config(param_persistence_threshold=persistence),
                            options=fz3.Options(gloo_coalesce_numel=coalesce))
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x = torch.randn(4, 6, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "params": engine.full_state_dict(), "sends": engine.stats()["p2p_sends"]}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("persistence", [0, 100])  # gathered per module / refreshed after the step
def test_small_params_travel_packed_and_train_the_same(world, persistence):
    """Options.gloo_coalesce_numel: the small params of each gather and reduce share one message
    per peer (fz3.interpreters.messages); the training is the same bit for bit as one message per param."""
    packed = launch.run_threads(_train, world, args=(65_536, persistence))
    alone = launch.run_threads(_train, world, args=(0, persistence))
    for a, b in zip(packed, alone):
        assert a["losses"] == b["losses"]
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        assert a["sends"] * 4 <= b["sends"], (a["sends"], b["sends"])


def test_gloo_coalesce_numel_is_checked():
    import fz3
    for bad in (-1, 1.5, True, "64k"):
        with pytest.raises(ValueError, match="gloo_coalesce_numel must be an int >= 0.*" + repr(bad).replace(".", r"\.")):
            fz3.Options(gloo_coalesce_numel=bad)


def _held(rank: int, world: int) -> dict:
    """Two steps of a model of 13 params (3 .. 36 elements) on the p2p carriers, with DeepSpeed's
    default reduce_bucket_size (5e8) and every param sharded."""
    import fz3
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(6, 6) for _ in range(6)), nn.Linear(6, 1))
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0))
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).sum())
        engine.step()
    s = engine.stats()
    return {k: s[k] for k in ("reduce", "peak_held_grad_bytes", "held_grad_bytes")} | {
        "params": engine.full_state_dict()}


def test_held_grads_are_bounded_by_the_carriers_hold_budget(monkeypatch):
    """[Note: hold budget] (fz3/core/grad/grads.py): with the p2p carrier's budget at 50 elements,
    a backward's held grads are reduced in buckets of at most 50, so at most two buckets' grads
    (one reducing, one filling) are held at once; without the budget, every grad of the backward
    waits for reduce_bucket_size. Training is the same."""
    from fz3.interpreters import carriers
    unbounded = launch.run_threads(_held, 2)
    monkeypatch.setattr(carriers.P2P, "hold_budget", 50)
    bounded = launch.run_threads(_held, 2)
    total = sum(6 * 6 + 6 for _ in range(6)) + 7
    for a, b in zip(unbounded, bounded):
        assert a["reduce"] == 2 and a["peak_held_grad_bytes"] == 4 * total
        assert b["reduce"] > 2 * (total // 50) and b["peak_held_grad_bytes"] <= 4 * 2 * 50
        assert a["held_grad_bytes"] == b["held_grad_bytes"] == 0  # let go after each backward
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
