"""Grad partitions by segment (fz3/data/store.py): each run of params is cut into segments of
whole params, each with a storage of its own that exists from the window's first write into it
to the optimizer step. A backward that frees gathered params as its grads come in holds the
two together at no moment; fz3.plan reports the peak of what comes and goes together, not the
sum of each one's peak.
"""
from __future__ import annotations

import torch
from torch import nn

import fz3
from fz3.data import store as tensor_store
from fz3.data.store import TensorStore


def _store(sizes: list[int], runs=()) -> TensorStore:
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    shards = [torch.zeros((n + 1) // 2) for n in sizes]
    return TensorStore(params, tuple(f"p{i}" for i in range(len(sizes))), shards, rank=0, world_size=2,
                       compute_dtype="fp32", device=torch.device("cpu"), runs=runs)


def test_a_segment_gets_memory_at_its_first_write_and_gives_it_back_at_the_step(monkeypatch):
    monkeypatch.setattr(tensor_store, "MIN_SEGMENT", 8)
    s = _store([20, 4, 4, 6, 2], runs=[(0, 1, 2), (3, 4)])  # shards 10, 2, 2, 3, 1
    # run 0 cut at its largest shard, 10: (0,) (1, 2); run 1 at MIN_SEGMENT 8: (3, 4)
    assert [seg.params for seg in s.segments] == [(0,), (1, 2), (3, 4)]
    assert s.grad_bytes() == 0  # none before the first window's first write
    s.ensure_partitions((2,))
    assert s.grad_bytes() == 4 * 4
    s.partitions[1].copy_(torch.ones(2))  # its segment's other param: writable now
    s.ensure_partitions((0, 4))
    assert s.grad_bytes() == 4 * (10 + 4 + 4)
    s.free_partitions()
    assert s.grad_bytes() == 0 and all(m.grad is None for m in s.masters)
    s.ensure_partitions()
    assert s.grad_bytes() == 4 * 18 and s.shard_bytes()["grad_partitions"] == 4 * 18


def test_masters_of_a_segment_lie_side_by_side_and_frozen_ones_apart():
    params = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(6), requires_grad=False),
              nn.Parameter(torch.zeros(2))]
    shards = [torch.arange(2.0), torch.arange(3.0), torch.arange(1.0) + 7]
    s = TensorStore(params, ("a", "b", "c"), shards, rank=0, world_size=2, compute_dtype="fp32",
                    device=torch.device("cpu"), runs=[(2, 0)])
    (seg,) = s.segments
    assert seg.params == (2, 0) and torch.equal(seg.masters, torch.tensor([7.0, 0.0, 1.0]))  # run order: c, a
    assert s.masters[2].data_ptr() == seg.masters.data_ptr()
    assert s.masters[0].untyped_storage().data_ptr() == seg.masters.untyped_storage().data_ptr()  # one storage
    assert not s.masters[1].requires_grad and s.partitions[1] is None and s.segment_of[1] == -1


def test_under_offload_a_segment_closes_at_sub_group_size_and_the_shards_are_copies():
    """segment_numel (the sub_group_size): whole params up to it, one larger alone; separate_shards:
    the fp32 compute shards are not the masters, which can leave memory."""
    params = [nn.Parameter(torch.zeros(4)) for _ in range(3)] + [nn.Parameter(torch.zeros(20))]
    shards = [torch.arange(2.0), torch.arange(2.0) + 2, torch.arange(2.0) + 4, torch.arange(10.0)]
    s = TensorStore(params, ("a", "b", "c", "d"), shards, rank=0, world_size=2, compute_dtype="fp32",
                    device=torch.device("cpu"), separate_shards=True, segment_numel=4)
    assert [seg.params for seg in s.segments] == [(0, 1), (2,), (3,)]
    assert s.shards[0].data_ptr() != s.masters[0].data_ptr() and torch.equal(s.shards[0], s.masters[0].detach())


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_the_plan_peaks_what_is_held_together_not_each_peak_summed():
    # every param gathered from its forward to its backward (the default reuse distance), grads
    # reduced one layer at a time: the gathered params go as the grads' segments come
    cfg = fz3.Config(param_persistence_threshold=0, reduce_bucket_size=70_000)
    plan = fz3.plan(Deep(), cfg, world_size=2, example_inputs=(torch.randn(2, 256),), steps=2,
                    optimizer="sgd")
    step = plan.steps[1]
    assert step["grad_partitions"] == 4 * sum(
        (p.numel() + 1) // 2 for p in Deep().parameters())  # all of them, by the step
    together = step["peak_transient_bytes"]
    assert step["peak_live_bytes"] <= together < step["peak_live_bytes"] + step["grad_partitions"]
    assert step["model_state_peak_bytes"] == (step["param_shards"] + step["optimizer_state_bytes"]
                                              + step["reduce_buffer_bytes"] + step["buffer_bytes"] + together)
