"""The optimizer steps each param group as a few flat tensors, not one shard at a time.

[Note: flat steps] A rank's masters are many small shards (197 on the deep benchmark GPT), and
torch's optimizers step them one at a time on CPU: ~9 small ops each, 3.4 ms of Python a step
there against 0.13 ms for one flat tensor of the same elements. Adam, AdamW and SGD are
elementwise: each element's new value depends only on that element, the group's settings and
the step count. So a group whose params step together can step as flat tensors over its
masters, and every element comes out bit-identical to the per-shard step (tests/test_flat_step.py
checks it). DeepSpeed does the same: its optimizer only ever sees one flat fp32 partition per
group (fp32_partitioned_groups_flat).

    layout     the store cuts each group's trainable params into segments, whose masters are
               one tensor each and whose grad partitions are one tensor each: a chunk is a
               segment's masters with its grads, no copy
    chunks     whole shards, up to the group's largest shard (or MIN_SEGMENT, 256 KiB, if larger)
               in elements (fz3/data/store.py `_cut`): the step's temporaries (Adam's two of its
               denominator) stay the size they were stepping shard by shard, give or take
               512 KiB: no speed bought with memory
    the step   the user's optimizer.step() runs, its hooks, scheduler wrapper and settings as
               they are: for the step, each flat group's "params" are its chunks and its state
               the chunks' state; then the masters are put back
    pieces     on CPU, once a chunk's state exists (after its first step), the step takes it in
               pieces of CPU_PIECE elements, over views of its state: each of the optimizer's
               passes then stays in the cache ([Note: pieces on CPU])
    state      per master, as torch keeps it: its elementwise tensors are views of the chunks'
               (in place, so they are current after every step), its "step" a 0-dim view of
               one tensor per group, filled after each flat step. optimizer.state_dict(),
               checkpoints and a later per-shard step read and write them as torch's own

A group steps shard by shard, as torch would, when any of these holds: its optimizer is not
exactly torch.optim.Adam, AdamW or SGD, or it has step hooks (they would see the chunks); the
group is fused, capturable or differentiable; a param of it got no grad this window ([Note: no
grad, no step]: it must not step) or its shards' step counts differ since; its state is not one
fz3 can lay flat (a state loaded or set by hand is taken in when it can be: same keys, one
step count; otherwise the group steps by shard).
"""
from __future__ import annotations

import operator

import torch
from torch import nn

from fz3.data.store import TensorStore

FLAT_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)  # elementwise, exactly these
CPU_PIECE = 1 << 18  # on CPU, elements a step call takes at most once the state exists (1 MiB fp32)


def group_runs(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[tuple[int, ...]]:
    """The trainable ParamIds of each param group, in the group's order (a param listed twice
    steps once, in the first group that lists it, as bind_optimizer binds it): the store lays
    each out flat."""
    pid = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    runs = []
    for group in getattr(optimizer, "param_groups", ()):  # not an optimizer: bind_optimizer says so
        run = []
        for p in group["params"]:
            i = pid.get(id(p))
            if i is not None and i not in seen and p.requires_grad:
                seen.add(i)
                run.append(i)
        runs.append(tuple(run))
    return runs


class _Group:
    """One param group's flat view: its chunks, their state, and the state torch keeps per
    master (views of the chunks')."""

    def __init__(self, group: dict, pids: tuple[int, ...], store: TensorStore, run: int) -> None:
        self.index, self.pids = run, pids  # the group is looked up by index at each step: a
        # load_state_dict puts new group dicts in (over the same params lists)
        self.bound = group["params"]  # the list bind_optimizer made: put back after each flat step
        self.bound_len = len(self.bound)
        self.masters = [store.masters[p] for p in pids]  # the trainable ones, in the run's order
        index = {p: i for i, p in enumerate(pids)}
        self.segments: list[int] = []  # by chunk: its store segment
        self.chunks: list[nn.Parameter] = []  # by segment of the run: its masters, one tensor
        self.grads: list[torch.Tensor] = []  # by chunk: the segment's grad partitions
        self.spans: list[list[tuple[int, int, int]]] = []  # by chunk: (master index, start, end)
        for k, seg in enumerate(store.segments):
            if seg.run == run:
                self.segments.append(k)
                span, offset = [], 0
                for p in seg.params:
                    span.append((index[p], offset, offset + store.masters[p].numel()))
                    offset += store.masters[p].numel()
                self.chunks.append(nn.Parameter(seg.masters))
                self.grads.append(seg.grads)
                self.spans.append(span)
        # [Note: pieces on CPU] each chunk in pieces of at most CPU_PIECE elements (one piece
        # elsewhere): once a chunk's state exists, the step runs on the pieces, over views of
        # it, so each of the optimizer's ~10 passes stays in the cache (AdamW over 14.7 M
        # elements: 73 ms as one tensor, 19 ms in 256K-element pieces, bench/RESULTS.md)
        self.pieces: list[list[tuple[nn.Parameter, int, int]]] = []  # by chunk: (piece, start, end)
        for chunk in self.chunks:
            n = chunk.numel()
            size = CPU_PIECE if chunk.device.type == "cpu" else max(n, 1)
            self.pieces.append([(nn.Parameter(chunk.detach()[a:a + size]), a, min(a + size, n))
                                for a in range(0, n, size)] or [(chunk, 0, 0)])
        self.piece_state: list[list[dict]] = []  # by chunk, by piece: views of its chunk's state
        self.piece_seen: list[list[dict]] = []  # copies of piece_state's dicts when made
        self.chunk_state: list[dict] = []  # by chunk: the state it steps with
        self.chunk_seen: list[dict] = []  # copies of chunk_state's dicts when exposed
        self.exposed: list[dict] = []  # by master: the state dict put in optimizer.state
        self.exposed_seen = _Seen([])  # what they held: a value set by hand shows
        self.steps: torch.Tensor | None = None  # by master: its "step" (a 0-dim view each)
        self.stepped_by_shard = False  # since the last flat step: step counts may differ


class FlatSteps:
    """Steps `optimizer` (its groups already bound to the store's masters) flat where it can."""

    def __init__(self, optimizer: torch.optim.Optimizer, store: TensorStore, runs: list[tuple[int, ...]], *,
                 flat: bool = True) -> None:
        """`flat` False: every group steps by shard (optimizer offload: fz3/shell/offload.py)."""
        self.optimizer = optimizer
        self.master_segment = [(store.masters[p], store.segment_of[p]) for p in range(len(store.masters))
                               if store.segment_of[p] >= 0]  # the trainable masters and their segments
        self.segment_of = {id(m): seg for m, seg in self.master_segment}
        flat_type = flat and type(optimizer) in FLAT_TYPES
        self.groups = [_Group(g, run, store, i) if flat_type and run else None
                       for i, (g, run) in enumerate(zip(optimizer.param_groups, runs))]

    def step(self, no_grad: frozenset[int] | set[int] | tuple[int, ...]) -> None:
        """optimizer.step(): each group that can steps flat (the masters' grads already bound)."""
        flat = self.begin(no_grad)
        self.part(flat, None)
        self.end(flat)

    # [Note: a step in parts] Under offload the optimizer steps one sub-group at a time
    # (fz3/core/offload.py), no group flat: `begin` decides once which groups step flat, `part`
    # runs the optimizer's own step() over the masters of some segments (the other masters'
    # grads are held back for the call, so the optimizer skips them as it skips a param without
    # a grad), and `end` shows the flat groups' state per master once every part has stepped.
    # The optimizer's step() and its hooks run once per part; its numbers are the same, each
    # param's step depending on its own grad and state alone.

    def begin(self, no_grad: frozenset[int] | set[int] | tuple[int, ...]) -> list[_Group]:
        """The groups that step flat this optimizer step."""
        hooks = _has_step_hooks(self.optimizer)
        flat = [g for g in self.groups if g is not None and not hooks and self._ready(g, no_grad)]
        for g in self.groups:
            if g is not None and g not in flat:
                g.stepped_by_shard = True
        return flat

    def part(self, flat: list[_Group], segments: set[int] | frozenset[int] | None) -> None:
        """optimizer.step() over the masters of `segments` (store segment indices; None: all).
        A part of the masters is stepped only with no group flat (FlatSteps(flat=False), as
        optimizer offload builds it): each master's state is its own tensor then."""
        if segments is not None and flat:
            raise RuntimeError("fz3 flat step: a part of the masters stepped while groups step flat")
        opt = self.optimizer
        groups = opt.param_groups
        units = {}  # by group: what its "params" are for this step, with their state
        for g in flat:
            if g.piece_state and all(g.chunk_state):  # [Note: pieces on CPU]
                units[g.index] = [(piece, grad[a:b], state)  # the grads' memory exists now: views
                                  for pieces, states, grad in zip(g.pieces, g.piece_state, g.grads)
                                  for (piece, a, b), state in zip(pieces, states)]
            else:  # the first step makes the chunks' state (or there is none to make)
                units[g.index] = list(zip(g.chunks, g.grads, g.chunk_state))
            groups[g.index]["params"] = [u for u, _, _ in units[g.index]]
            for unit, grad, state in units[g.index]:
                unit.grad = grad
                opt.state[unit] = state
        # the masters outside `segments`: their grads held back for the call
        held = [] if segments is None else [(m, m.grad) for group in groups for m in group["params"]
                                            if m.grad is not None and self.segment_of.get(id(m), -1) not in segments]
        for m, _ in held:
            m.grad = None
        try:
            opt.step()
        finally:
            for m, grad in held:
                m.grad = grad
            for g in flat:
                groups[g.index]["params"] = g.bound
                stepped = [opt.state.pop(unit) for unit, _, _ in units[g.index]]
                for unit, _, _ in units[g.index]:
                    unit.grad = None
                if not g.piece_state or not all(g.chunk_state):
                    g.chunk_state = stepped

    def end(self, flat: list[_Group]) -> None:
        """After the last part: each master's state as torch keeps it."""
        for g in flat:
            if g.piece_state and all(g.chunk_state) and not self._pieces_kept(g):
                raise RuntimeError(f"fz3 flat step: {type(self.optimizer).__name__} replaced a state tensor of a "
                                   "piece instead of stepping it in place; the chunks' state would not hold the step")
            self._expose(g)

    def state_tensors(self, segments: set[int] | frozenset[int]) -> list[torch.Tensor]:
        """The optimizer's elementwise state of the masters of `segments`, each master's own
        tensors (no group flat: `part`): what offload moves with them."""
        return [v for m, seg in self.master_segment if seg in segments
                for k, v in self.optimizer.state.get(m, {}).items()
                if k != "step" and isinstance(v, torch.Tensor) and v.shape == m.shape and v.ndim == 1]

    # ---- whether a group steps flat ------------------------------------------------------------

    def _ready(self, g: _Group, no_grad) -> bool:
        groups = self.optimizer.param_groups
        if len(groups) != len(self.groups):
            return False
        group = groups[g.index]
        if group.get("fused") or group.get("capturable") or group.get("differentiable") \
                or group["params"] is not g.bound or len(g.bound) != g.bound_len \
                or (no_grad and any(p in no_grad for p in g.pids)):
            return False
        state = self.optimizer.state
        if not (g.exposed and all(map(operator.is_, map(state.get, g.masters), g.exposed))
                and g.exposed_seen.holds()):
            return self._take_in(g)
        if g.stepped_by_shard:  # some shards may have stepped without the others
            if g.steps is not None:
                if not bool((g.steps == g.steps[0]).all()):
                    return False
                for states in g.piece_state:
                    for s in states:
                        s["step"].copy_(g.steps[0])
            g.stepped_by_shard = False
        return True

    def _take_in(self, g: _Group) -> bool:
        """Chunk state from the masters' state as torch keeps it: none yet (the first step makes
        it), or one a checkpoint or the user set, taken in when every master has the same keys,
        elementwise tensors and one step count. False: the group steps by shard."""
        per = [self.optimizer.state.get(m) for m in g.masters]
        if not any(per):
            g.chunk_state, g.exposed, g.piece_state = [{} for _ in g.chunks], [], []
            return True
        if not all(per) or len({frozenset(d) for d in per}) != 1:
            return False
        scalars: dict[str, set] = {}
        for m, d in zip(g.masters, per):
            for k, v in d.items():
                if not isinstance(v, torch.Tensor) or v.ndim not in (0, 1) or (v.ndim == 1 and v.shape != m.shape):
                    return False
                if v.ndim == 0:
                    scalars.setdefault(k, set()).add(float(v))
        if any(len(values) > 1 for values in scalars.values()) or set(scalars) - {"step"}:
            return False  # shards stepped apart (no grad, no step), or a scalar fz3 does not know
        g.chunk_state = [{k: (per[span[0][0]][k].detach().clone() if k in scalars else
                              torch.cat([per[i][k].detach() for i, _, _ in span]))
                          for k in per[0]} for span in g.spans]
        g.exposed, g.piece_state = [], []  # _expose puts views of the new chunk state in after the step
        return True

    # ---- the state torch keeps per master ----------------------------------------------------------

    def _expose(self, g: _Group) -> None:
        """Each master's state over the chunks' (views: current after every flat step); once the
        chunks' tensors stay the same, a step only writes the step counts."""
        if g.exposed and g.piece_state and all(_same(s, seen) for s, seen in zip(g.chunk_state, g.chunk_seen)):
            if g.steps is not None:  # the pieces stepped: their count is the masters'
                g.steps.copy_(g.piece_state[0][0]["step"])
            return
        for s, chunk in zip(g.chunk_state, g.chunks):
            for k, v in s.items():
                if not (isinstance(v, torch.Tensor) and (v.shape == chunk.shape or (k == "step" and v.ndim == 0))):
                    raise RuntimeError(f"fz3 flat step: {type(self.optimizer).__name__}'s state {k!r} is "
                                       "neither elementwise nor the step count: it cannot step flat")
        first = g.chunk_state[0]
        if not any(g.chunk_state):  # a stateless optimizer (SGD without momentum): none to show,
            g.exposed = []  # as torch shows none
            return
        g.steps = None if "step" not in first else torch.empty(len(g.masters), dtype=first["step"].dtype,
                                                                  device=first["step"].device)
        if g.steps is not None:
            g.steps.copy_(first["step"])
        g.exposed = [{}] * len(g.masters)
        for s, span in zip(g.chunk_state, g.spans):
            for i, a, b in span:
                g.exposed[i] = {k: (g.steps[i] if k == "step" else v[a:b]) for k, v in s.items()}
        state = self.optimizer.state
        for m, d in zip(g.masters, g.exposed):
            state[m] = d
        g.exposed_seen = _Seen(g.exposed)
        g.chunk_seen = [dict(s) for s in g.chunk_state]
        g.piece_state = [[{k: (v.detach().clone() if k == "step" else v[a:b]) for k, v in s.items()}
                          for _, a, b in pieces] for s, pieces in zip(g.chunk_state, g.pieces)]
        g.piece_seen = [[dict(p) for p in states] for states in g.piece_state]

    def _pieces_kept(self, g: _Group) -> bool:
        """The optimizer stepped the pieces' state in place (torch's Adam, AdamW and SGD do once
        it exists, and the pieces' steps count for the chunks'), so the chunks' state holds the
        step."""
        return all(_same(p, seen) for states, seens in zip(g.piece_state, g.piece_seen)
                   for p, seen in zip(states, seens))


class _Seen:
    """What some dicts held when recorded, checked at every step in C (`map`), not a Python
    loop a master (196 masters, ~600 values on the deep narrow GPT, issue #27): each dict still
    has as many keys, each holding the very value it held (`_same` of each)."""

    __slots__ = ("dicts", "lens", "owners", "keys", "values")

    def __init__(self, dicts: list[dict]) -> None:
        self.dicts, self.lens = list(dicts), [len(d) for d in dicts]
        items = [(d, k, v) for d in dicts for k, v in d.items()]
        self.owners = [d for d, _, _ in items]
        self.keys = [k for _, k, _ in items]
        self.values = [v for _, _, v in items]

    def holds(self) -> bool:
        return list(map(len, self.dicts)) == self.lens and all(
            map(operator.is_, map(dict.get, self.owners, self.keys), self.values))


def _same(d: dict, seen: dict) -> bool:
    """`d` holds the very values `seen` recorded (identity: tensors compare elementwise)."""
    return len(d) == len(seen) and all(d.get(k) is v for k, v in seen.items())


def _has_step_hooks(opt: torch.optim.Optimizer) -> bool:
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or _global_optimizer_pre_hooks or _global_optimizer_post_hooks)
