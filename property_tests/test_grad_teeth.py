"""The gradient tests have teeth: each planted bug is caught by the machine and by the properties.

Each bug replaces one function of the core or the data plane (monkeypatch), then the state
machine and the I3 property (with its permanent EDGES examples; run_scenario also checks each
report's route, so a wrong route fails there though the numbers stay right) run with fixed settings
(derandomized, up to 300 examples, no shrinking, no example database) and must fail with the
expected message. The clean code passes the same runs in
test_grad_machine.py and test_grad_properties.py.
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, example, given, settings
from hypothesis.stateful import run_state_machine_as_test

from fz3.core.grad import epilogue, grads
from fz3.core.stage import STAGES
from fz3.core.effects import CopyToBucket, HoldGrad
from fz3.core.spec import ModelSpec, shard_numel
from fz3.data import collectives, layout
from fz3.interpreters import simulated
from fz3.interpreters.simulated import SimulationError
from fz3.testing.grad_machine import GradMachine
from fz3.testing.grad_naive import PATHS
from tests.support.grad_scenarios import EDGES, divisor, run_scenario, scenarios

STRICT = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False)


def add_on_first_write(pg, window):
    """Planted: DeepSpeed's copy_ on the first write of a window becomes add_."""
    return "add"


def rank_slice_off_by_one(flat, rank, world_size):
    """Planted: the padded slice ends one element early (the last owned element is lost)."""
    n = flat.shape[-1]
    s = shard_numel(n, world_size)
    lo, hi = min(rank * s, n), min((rank + 1) * s - 1, n)
    return F.pad(flat[..., lo:hi], (0, s - (hi - lo)))


def pack_param_major(grads, world_size):
    """Planted: the reduce-scatter input is param-major, not interleaved per rank."""
    return torch.cat([layout.pad_flat(g, world_size) for g in grads]) if grads else torch.zeros(0)


def always_copy(state, config):
    """Planted: the route ignores the carrier; a grad is never held (DeepSpeed's rule)."""
    return CopyToBucket if config.contiguous_gradients else None


def hold_on_any_path(state, config):
    """Planted: the route ignores the reduce path; grads are held for an all-reduce too."""
    return HoldGrad if config.contiguous_gradients and state.in_place_reduce_scatter else None


def hold_whatever_the_carrier(state, config):
    """Planted: the route ignores the carrier; grads are held for any reduce-scatter."""
    return HoldGrad if config.contiguous_gradients and config.reduce_scatter else None


BUGS = {  # name: (module, attribute, replacement, error types, message)
    "add instead of copy on the first write": (
        grads, "write_mode", add_on_first_write, AssertionError, "I3"),
    "off-by-one in the padded slice": (
        layout, "rank_slice", rank_slice_off_by_one, AssertionError, "I3"),
    "divide by W, not W * gas": (
        epilogue, "grad_divisor", lambda w, gas, predivide=1.0, **scale: w, AssertionError, "I3"),
    "boundary forgets the pre-division": (
        epilogue, "grad_divisor", lambda w, gas, predivide=1.0, **scale: w * gas, AssertionError, "I3"),
    "reduce forgets to pre-divide": (
        grads, "grad_predivide", lambda w, config: 1.0, AssertionError, "I3"),
    "comm dtype ignored": (
        grads, "bucket_dtype", lambda dtype, config: dtype, SimulationError,
        "communication_data_type"),
    "bucket overflows by one element": (
        grads, "fits", lambda fill, n, cap: fill + n <= cap + 1, (AssertionError, SimulationError),
        "capacity|reduce_bucket_size"),
    "reduce-scatter not interleaved": (
        collectives, "pack_reduce_scatter", pack_param_major, AssertionError, "I3"),
    # the route (fz3.core.grad.grads.grad_route): the numbers stay right, the effects do not
    "grads always copied": (grads, "grad_route", always_copy, AssertionError, "placement"),
    "grads held on the all-reduce path": (
        grads, "grad_route", hold_on_any_path, AssertionError, "placement|HoldGrad"),
    "grads held without an in-place carrier": (
        grads, "grad_route", hold_whatever_the_carrier, AssertionError, "placement"),
    # the hold budget ([Note: hold budget]): held grads wait for the whole reduce_bucket_size
    "hold budget ignored": (
        grads, "capacity", lambda config, **carrier: config.reduce_bucket_size, AssertionError,
        "placement|more than the bucket|capacity"),
}


_real_reduce = simulated.SimulatedWorld._reduce


def reduce_across_twice(world, e):
    """Planted (the interpreter's side): a bucket reduced across the groups twice, as a carrier
    whose own reduce already spanned the world and then ran the one across would."""
    _real_reduce(world, e)
    if e.across > 1:
        world.reduced.pop(e.bucket)
        _real_reduce(world, e)


_real_zero_grads = epilogue.zero_grads


def zero_grads_blind_to_older(state, *, config):
    """Planted: zero_grad drops the grads since the last step() even when a step() off the
    boundary summed older ones into the same partitions (they go too)."""
    return _real_zero_grads(state._replace(committed=False), config=config)


# the window's decisions ([Note: the window closes at step()], [Note: zero_grad in a window]):
# only the machine draws step() calls apart from backwards, overrides and zero_grad
WINDOW_BUGS = {
    "the window closes at every step()": (
        epilogue, "is_boundary", lambda state, *, config, override=None: True, AssertionError,
        "closed at another step"),
    "set_gradient_accumulation_boundary ignored": (
        epilogue, "is_boundary",
        lambda state, *, config, override=None: not config.managed_gradient_accumulation or (
            (state.micro_step + 1) % config.gradient_accumulation_steps == 0),
        AssertionError, "closed at another step"),
    "zero_grad drops older grads too": (
        epilogue, "zero_grads", zero_grads_blind_to_older, AssertionError, "older grads share"),
    # [Note: grads at the boundary] (stages 0 and 1)
    "grads reduced each backward at stage 1": (
        grads, "policy", lambda config: STAGES[3], AssertionError, "reduced before the boundary|placement"),
    "the boundary forgets the waiting grads": (
        epilogue, "flush_waiting", lambda state, *, config: (state, ()), AssertionError, "I3|reduced"),
    "zero_grad drops nothing": (
        epilogue, "zero_grads", lambda state, *, config: (state._replace(micro_backwards=0), ()), AssertionError,
        "I3|older grads share"),
}


# hybrid sharding ([Note: hybrid sharding], fz3/core/stage.py): only the machine draws groups
GROUP_BUGS = {
    "no reduce across the groups": (
        grads, "reduce_across", lambda spec: 1, AssertionError, "I3|the groups since the last check"),
    "the mean over one group, not the world": (
        ModelSpec, "ranks", property(lambda spec: spec.world_size), AssertionError, "I3"),
    "each partition reduced across twice": (
        simulated.SimulatedWorld, "_reduce", reduce_across_twice, (AssertionError, SimulationError),
        "I3|the groups since the last check|reduced twice"),
}


@pytest.mark.parametrize("bug", sorted(BUGS) + sorted(WINDOW_BUGS) + sorted(GROUP_BUGS))
def test_machine_catches(bug, monkeypatch):
    module, attr, fn, errors, msg = BUGS.get(bug) or WINDOW_BUGS.get(bug) or GROUP_BUGS[bug]
    monkeypatch.setattr(module, attr, fn)
    with pytest.raises(errors, match=msg):
        run_state_machine_as_test(GradMachine, settings=STRICT)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_properties_catch(bug, monkeypatch):
    module, attr, fn, errors, msg = BUGS[bug]
    monkeypatch.setattr(module, attr, fn)

    def i3_on_every_path(sc):
        for path in PATHS:
            world, _, naive = run_scenario(sc, path)
            naive.check(world, divisor(sc))

    for sc in EDGES:  # the same permanent examples as test_grad_properties.py
        i3_on_every_path = example(sc)(i3_on_every_path)
    i3_on_every_path = STRICT(given(scenarios())(i3_on_every_path))

    with pytest.raises(errors, match=msg):
        i3_on_every_path()
