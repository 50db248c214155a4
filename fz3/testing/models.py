"""Hypothesis strategies for the parameter lifecycle: small models, call programs, configs.

    Model     params (name, numel) and modules (name, params, is_leaf), as build_spec takes them,
              plus which modules a program may call
    Call      one forward call of a module: does it feed grads (outputs / inputs), and its body:
              child calls and external reads, in order
    Case      a model, a config, and a few program variants; a pass runs one of them, so the
              trace sees repeats (-> COMPLETE, prefetch) and departures (-> invalidation)

What the strategies reach on purpose: nesting; tied params (one id in several modules); a module
called several times per forward, from one parent or from several; conditional modules (a
variant drops, swaps or repeats a call, or is drawn afresh); leaf modules (a whole subtree's
params in one unit, the subtree's modules never called); numel 0..10, often below the world
size; calls without grad-requiring inputs or outputs; external params (a child's param returned
to its caller, or any param read by a module that does not own it); hpZ's secondary shards (a
group of 2 of 4 ranks); and configs at the edges:
prefetch off and tiny, live budget 0 / tiny / huge, reuse distance 0 / small / huge,
persistence off (threshold 0: only empty params) and on.

Usage:
    from fz3.testing.models import cases, forward_events, backward_events
    @given(cases())
    def test(case): ...
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

import fz3.testing.extra  # noqa: F401 - Hypothesis, or an ImportError naming the test extra
from hypothesis import strategies as st

from fz3.testing.param_events import (BackwardFetch, BackwardRelease, Compute, Fetch, Register,
                                       Release)
from fz3.config.config import Config
from fz3.core import stage
from fz3.core.spec import ModelSpec, build_spec

HUGE = 10**9


@dataclass(frozen=True)
class External:
    """The calling module reads `params`, which it does not own: register_external."""

    params: tuple[int, ...]


@dataclass(frozen=True)
class Call:
    """One forward call of `module`."""

    module: int
    outputs_grad: bool  # outputs require grad: PreBackwardFunction -> one pre_backward
    grad_inputs: int  # 1: its grad-requiring inputs are wrapped (one node): one post_backward;
    # 0: none (always 0 if not outputs_grad)
    body: tuple[Union["Call", External], ...] = ()
    returns: tuple[int, ...] = ()  # own params in its outputs: external on the caller
    saves: bool = True  # its forward saves some of its unit's params for backward (an embedding
    # on ids saves none); read by the calls machine only (fz3/testing/autograd_sim.py)
    skips: tuple[int, ...] = ()  # own params a leaf's call does not compute with (experts no
    # token was routed to: no grad for them); read by the calls machine only


@dataclass(frozen=True)
class Model:
    world_size: int
    params: tuple[tuple[str, int], ...]
    modules: tuple[tuple[str, tuple[int, ...], bool], ...]  # module 0 is the root
    callable: tuple[int, ...]  # modules a program may call below the root (not inside a leaf)
    trainable: tuple[bool, ...] = ()  # by param (requires_grad); () = all trainable. Read by
    # the calls machine only (fz3/testing/calls_machine.py)

    def spec(self, config: Config) -> ModelSpec:
        """The spec the engine builds for this model under `config`: its stage's persistence
        and layout (fz3/core/stage.py; every param persistent at stages 0-2)."""
        threshold, model_threshold = stage.persistence(config)
        shard_world = stage.layout_world(config, self.world_size)
        return build_spec(self.params, self.modules, world_size=shard_world, persistence_threshold=threshold,
                          model_persistence_threshold=model_threshold, replicas=self.world_size // shard_world,
                          max_inflight=config.max_ongoing_fetch_events,
                          secondary=stage.secondary_world(config, self.world_size))


@dataclass(frozen=True)
class Case:
    model: Model
    config: Config
    programs: tuple[Call, ...]  # programs[0] is the usual pass; the rest are conditional variants


# ---- models and configs ----------------------------------------------------------------------

@st.composite
def models(draw, max_params: int = 8, max_modules: int = 7) -> Model:
    numels = draw(st.lists(st.integers(0, 10), min_size=1, max_size=max_params))
    n, n_mod = len(numels), draw(st.integers(3, max_modules))
    owned: list[set[int]] = [set() for _ in range(n_mod)]
    for p in range(n):  # every param has an owner (the root may own some: a top-level bias)
        owned[0 if draw(st.integers(0, 7)) == 7 else draw(st.integers(1, n_mod - 1))].add(p)
    ties = st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n_mod - 1)), max_size=3)
    for p, m in draw(ties):  # the same param id in further modules (embedding / lm_head)
        owned[m].add(p)
    leaf = [m > 0 and draw(st.integers(0, 3)) == 3 for m in range(n_mod)]
    inner: set[int] = set()  # modules inside a leaf: in the spec, never called
    for m in range(1, n_mod):
        if leaf[m] and m not in inner:
            for c in range(m + 1, n_mod):
                if not leaf[c] and c not in inner and draw(st.booleans()):
                    inner.add(c)
                    owned[m] |= owned[c]
                    owned[c] = set()  # the leaf's now: a real spec has no module inside a leaf
    modules = tuple((f"m{m}" + ("[leaf]" if leaf[m] else ""), tuple(sorted(owned[m])), leaf[m])
                    for m in range(n_mod))
    return Model(draw(st.integers(1, 4)), tuple((f"p{p}", k) for p, k in enumerate(numels)),
                 modules, tuple(m for m in range(1, n_mod) if m not in inner))


def configs() -> st.SearchStrategy[Config]:
    return st.builds(
        Config,
        prefetch_bucket_size=st.sampled_from([HUGE, 6, 1, 0]),  # generous first: shrinks there
        max_live_parameters=st.sampled_from([HUGE, 24, 6, 0]),
        max_reuse_distance=st.sampled_from([HUGE, 8, 0]),
        param_persistence_threshold=st.sampled_from([0, 2]),
    )


def generous_configs() -> st.SearchStrategy[Config]:
    """Prefetch as much as the plan offers: for tests that prefetch is not vacuously absent."""
    return st.builds(Config, prefetch_bucket_size=st.just(HUGE), max_live_parameters=st.just(HUGE),
                     max_reuse_distance=st.sampled_from([0, HUGE]), param_persistence_threshold=st.just(0))


# ---- programs ----------------------------------------------------------------------------------

@st.composite
def programs(draw, model: Model, max_calls: int = 10) -> Call:
    """A root call whose body nests calls of `model.callable` (a module is never re-entered)."""
    budget = [max_calls]
    return _call(draw, model, 0, (0,), budget, root=True)


def _call(draw, model: Model, module: int, stack: tuple[int, ...], budget: list[int], *,
          root: bool = False) -> Call:
    # Hypothesis starts from (and shrinks to) the smallest draws: let those be the common case
    outputs_grad = root or draw(st.integers(0, 4)) < 4
    grad_inputs = (1, 0)[draw(st.integers(0, 1))] if outputs_grad else 0
    body: list[Union[Call, External]] = []
    is_leaf = model.modules[module][2]
    for _ in range(draw(st.integers(1, 4) if root else st.integers(0, 2))):
        free = [m for m in model.callable if m not in stack]
        if model.params and draw(st.integers(0, 5)) == 5:
            body.append(External(tuple(sorted(draw(st.sets(
                st.integers(0, len(model.params) - 1), min_size=1, max_size=2))))))
        elif free and not is_leaf and budget[0] > 0 and len(stack) < 4:
            budget[0] -= 1
            child = draw(st.sampled_from(free))
            body.append(_call(draw, model, child, stack + (child,), budget))
    own = model.modules[module][1]
    returns = (draw(st.sampled_from(own)),) if own and not root and draw(st.integers(0, 7)) == 7 else ()
    return Call(module, outputs_grad, grad_inputs, tuple(body), returns)


@st.composite
def variants(draw, model: Model, base: Call) -> Call:
    """A conditional pass: drop, swap or repeat one call of `base`, or a fresh program."""
    paths = [path for path, _ in _walk(base) if path]
    how = draw(st.sampled_from(["drop", "swap", "repeat", "fresh"]))
    if how == "fresh" or not paths:
        return draw(programs(model))
    path = draw(st.sampled_from(paths))
    return _edit(base, path, how)


def _walk(call: Call, path: tuple[int, ...] = ()):
    """(path, call) in pre-order; path = indices into the bodies from the root."""
    yield path, call
    for i, item in enumerate(call.body):
        if isinstance(item, Call):
            yield from _walk(item, path + (i,))


def _edit(call: Call, path: tuple[int, ...], how: str) -> Call:
    body = list(call.body)
    i = path[0]
    if len(path) > 1:
        body[i] = _edit(body[i], path[1:], how)
    elif how == "drop":
        del body[i]
    elif how == "repeat":
        body.insert(i, body[i])
    elif i + 1 < len(body):  # swap with the next item
        body[i], body[i + 1] = body[i + 1], body[i]
    else:
        body.insert(0, body.pop(i))
    return replace(call, body=tuple(body))


@st.composite
def cases(draw, config: st.SearchStrategy[Config] | None = None, max_variants: int = 2) -> Case:
    model = draw(models())
    base = draw(programs(model))
    extra = draw(st.lists(variants(model, base), max_size=max_variants))
    cfg = draw(config if config is not None else configs())
    hpz = [h for h in range(2, model.world_size) if model.world_size % h == 0]  # [Note: hpZ]: 2 of 4
    if hpz and cfg.stage == 3 and cfg.zero_hpz_partition_size == 1 and draw(st.booleans()):
        cfg = cfg.replace(zero_hpz_partition_size=draw(st.sampled_from(hpz)))
    return Case(model, cfg, (base, *extra))


# ---- events ------------------------------------------------------------------------------------
# An event is a record of fz3/testing/param_events.py: Fetch(m, grad_inputs), Compute(m),
# Register(m, pids), Release(m, grad_outputs), BackwardFetch(m), BackwardRelease(m), Reset(),
# Finish(), EndOfStep(). Compute is not a core transition: the module computes with its params.

def forward_events(call: Call, *, grad: bool = True, caller: int | None = None) -> list[tuple]:
    """The shell's events for one forward of `call`; grad=False: under no_grad (no wrapping).
    The grad wrapping goes with the transitions, as fz3's shell reports it: fetch(grad_inputs=k)
    in pre-forward, release(grad_outputs=...) in post-forward. A call's `returns` are
    registered on its caller in its post-forward, before its own release."""
    m = call.module
    inputs, outputs = (call.grad_inputs, call.outputs_grad) if grad else (0, False)
    out: list = [Fetch(m, inputs), Compute(m)]
    for item in call.body:
        if isinstance(item, Call):
            out += forward_events(item, grad=grad, caller=m)
        else:
            out.append(Register(m, item.params))
        out.append(Compute(m))
    if call.returns and caller is not None:
        out.append(Register(caller, call.returns))
    out.append(Release(m, outputs))
    return out


def count_calls(call: Call) -> int:
    return sum(1 for _ in _walk(call))


def backward_events(call: Call, reached: frozenset[int] | None = None) -> list[tuple]:
    """Autograd's events: the forward calls in reverse, nested (a parent's pre_backward comes
    before its children's, its post_backward after). `reached`: pre-order indices of the calls
    whose outputs get a grad (None: all, a complete backward)."""
    out: list[tuple] = []
    _backward(call, reached, [0], out)
    return out


def _backward(call: Call, reached: frozenset[int] | None, counter: list[int], out: list[tuple]) -> None:
    index = counter[0]
    counter[0] += 1
    hit = call.outputs_grad and (reached is None or index in reached)
    m = call.module
    if hit:
        out += [BackwardFetch(m), Compute(m)]
    children: list[tuple] = []
    for item in call.body:
        if isinstance(item, Call):
            sub: list[tuple] = []
            _backward(item, reached, counter, sub)
            children.append(sub)
    for sub in reversed(children):
        out += sub
        if hit:
            out.append(Compute(m))
    if hit:
        out += [BackwardRelease(m)] * call.grad_inputs
