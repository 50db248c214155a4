"""[Note: flat steps] (fz3/shell/flat_step.py) against torch stepping each shard on its own.

A state machine over drawn shard sizes, param groups (some params frozen, some in no group),
segment and piece sizes ([Note: pieces on CPU]) and optimizers (AdamW, Adam with amsgrad, SGD with and without momentum): each
step writes drawn grads into the store's partitions, leaves a drawn set without a grad ([Note:
no grad, no step]) and steps through FlatSteps (now and then with a step hook, which sends every
group shard by shard for that step), while a reference optimizer of the same kind
steps plain copies of the masters; between steps the user replaces a state tensor, changes a
learning rate, or round-trips the optimizer through state_dict / load_state_dict. After every
rule the masters, every per-master state and the state_dict's keys equal the reference's, bit
for bit.
"""
from __future__ import annotations

import io

import torch
from hypothesis import assume, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch import nn

from fz3.data import store as tensor_store
from fz3.data.store import TensorStore
from fz3.shell import flat_step
from fz3.shell.flat_step import FlatSteps, group_runs
from fz3.shell.optim import bind_optimizer

OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1),
    "adam-amsgrad": lambda groups: torch.optim.Adam(groups, lr=0.05, amsgrad=True, weight_decay=0.01),
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1),
}


class FlatStepMachine(RuleBasedStateMachine):
    @initialize(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=7), data=st.data(),
                kind=st.sampled_from(sorted(OPTIMIZERS)), segment=st.integers(1, 64), piece=st.integers(1, 16))
    def build(self, sizes, data, kind, segment, piece):
        n = len(sizes)
        frozen = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="frozen")
        group_of = data.draw(st.lists(st.integers(-1, 2), min_size=n, max_size=n), label="group (-1: none)")
        self.gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        params = [nn.Parameter(torch.randn(k, generator=self.gen), requires_grad=not f) for k, f in zip(sizes, frozen)]
        groups = [{"params": [p for p, g in zip(params, group_of) if g == i], "lr": 0.05 * (i + 1)} for i in range(3)]
        groups = [g for g in groups if g["params"]]
        assume(groups)
        shards = [p.detach()[: (p.numel() + 1) // 2].clone() for p in params]  # rank 0 of 2
        self.opt = OPTIMIZERS[kind](groups)
        runs = group_runs(self.opt, params)
        old = tensor_store.MIN_SEGMENT
        tensor_store.MIN_SEGMENT = segment
        try:
            self.store = TensorStore(params, tuple(f"p{i}" for i in range(n)), shards, rank=0, world_size=2,
                                     compute_dtype="fp32", device=torch.device("cpu"), runs=runs)
        finally:
            tensor_store.MIN_SEGMENT = old
        # the reference: plain fp32 copies of the masters, in the same groups, stepped by torch
        self.ref = [nn.Parameter(m.detach().clone(), requires_grad=m.requires_grad) for m in self.store.masters]
        ref_of = {id(p): r for p, r in zip(params, self.ref)}
        self.ref_opt = OPTIMIZERS[kind]([{**{k: v for k, v in g.items() if k != "params"},
                                          "params": [ref_of[id(p)] for p in g["params"]]} for g in groups])
        bind_optimizer(self.opt, params, self.store.masters)
        old = flat_step.CPU_PIECE
        flat_step.CPU_PIECE = piece  # [Note: pieces on CPU], read when FlatSteps cuts them
        try:
            self.flat = FlatSteps(self.opt, self.store, runs)
        finally:
            flat_step.CPU_PIECE = old
        self.trainable = [p for p, t in enumerate(self.store.trainable) if t]

    @rule(data=st.data(), hooked=st.booleans())
    def step(self, data, hooked):
        """`hooked`: a step pre-hook on the optimizer for this step only (hooks would see the
        chunks, so every group steps by shard), after which the groups step flat again."""
        no_grad = set(data.draw(st.lists(st.sampled_from(self.trainable), unique=True), label="no grad")
                      if self.trainable else [])
        self.store.ensure_partitions()
        for p in self.trainable:
            g = torch.randn(self.store.masters[p].shape, generator=self.gen)
            self.store.partitions[p].copy_(g)
            self.ref[p].grad = None if p in no_grad else g.clone()
        self.store.bind_grads(tuple(sorted(no_grad)))
        handle = self.opt.register_step_pre_hook(lambda *_: None) if hooked else None
        self.flat.step(no_grad)
        if handle is not None:
            handle.remove()
        self.ref_opt.step()
        self.store.free_partitions()

    @rule(data=st.data())
    def replace_a_state_tensor(self, data):
        have = [p for p in self.trainable if self.opt.state.get(self.store.masters[p])]
        if not have:
            return
        p = data.draw(st.sampled_from(have), label="param")
        key = data.draw(st.sampled_from(sorted(k for k, v in self.opt.state[self.store.masters[p]].items()
                                               if v is not None and v.ndim == 1)), label="key")
        value = torch.randn(self.store.masters[p].shape, generator=self.gen).abs()
        self.opt.state[self.store.masters[p]][key] = value.clone()
        self.ref_opt.state[self.ref[p]][key] = value.clone()

    @rule(i=st.integers(0, 2), lr=st.sampled_from([0.01, 0.2]))
    def set_lr(self, i, lr):
        if i < len(self.opt.param_groups):
            self.opt.param_groups[i]["lr"] = lr
            self.ref_opt.param_groups[i]["lr"] = lr

    @rule()
    def round_trip_the_state_dict(self):
        buf = io.BytesIO()
        torch.save(self.opt.state_dict(), buf)
        buf.seek(0)
        self.opt.load_state_dict(torch.load(buf))

    @invariant()
    def equals_stepping_each_shard(self):
        if not hasattr(self, "store"):
            return
        for p, (m, r) in enumerate(zip(self.store.masters, self.ref)):
            assert torch.equal(m.detach(), r.detach()), p
            mine, theirs = self.opt.state.get(m, {}), self.ref_opt.state.get(r, {})
            assert mine.keys() == theirs.keys(), (p, mine.keys(), theirs.keys())
            for k, v in theirs.items():
                assert torch.equal(torch.as_tensor(mine[k]), torch.as_tensor(v)), (p, k)
        assert sorted(self.opt.state_dict()["state"]) == sorted(self.ref_opt.state_dict()["state"])


TestFlatSteps = FlatStepMachine.TestCase
