"""Cost of the pure core per module visit, as the model grows.

Drives fz3's parameter core through whole forward+backward passes of synthetic models of
10, 100, 1 000 and 10 000 modules (each a Linear: weight + bias, plus a tied embedding / head
pair) and reports microseconds per module visit: one fetch + release, forward or backward,
with the trace COMPLETE (steady state). No tensors, no torch: this is the control plane alone.

    python bench/core_overhead.py            # table to stdout
    python bench/core_overhead.py --json out.json
    python bench/core_overhead.py --events calls   # through fz3/core/calls.py, as the shell drives it
    python bench/core_overhead.py --events lifecycles   # the same pass, straight to the lifecycles
    python bench/core_overhead.py --events steady  # a training pass, step included, through the
                                                   # engine's door: answered from its recording
    python bench/core_overhead.py --events steady-full  # the same, nothing recorded (Options(replay=False))

`--events params` (the default) drives the parameter transitions alone (fetch, release,
pre_backward, post_backward): the cost of the lifecycle itself. `--events calls` drives the
events the shell sends since #12 (enter, leave, pre_backward, post_backward, and grad_ready for
each param, which adds the gradient lifecycle's bucket_add), over the three lifecycles together:
what the core costs a hook, the decisions that used to be the shell's included.
`--events lifecycles` sends the same pass straight to the two lifecycles, as the shell did
before #12: the difference is what the decisions cost in the core.

Target (issue #2): flat (10 000-module cost within 1.5x of 100-module) and < 20 us per visit.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

from fz3.core import calls, replay
from fz3.core import events as ev
from fz3.core.events import BackwardEnded, Enter, GradReady, Leave, PostBackwardRan, PreBackwardRan
from fz3.core.param.backward import fetch_for_backward, release_after_backward
from fz3.config.config import Config
from fz3.core.param.fetch import fetch
from fz3.core.param.release import release
from fz3.core.spec import build_spec
from fz3.core.grad.epilogue import epilogue
from fz3.core.grad.grads import bucket_add, init_grad_state
from fz3.core.param.state import initial_state
from fz3.core.param.step import finish_backward, reset_step

CONFIGS = {
    "defaults": Config(),
    "tight": Config(prefetch_bucket_size=4096, max_live_parameters=16384, max_reuse_distance=0,
                    param_persistence_threshold=0),
}


def synthetic(n_modules: int, world_size: int, config: Config):
    """Root + embedding + (n - 3) linears + head tied to the embedding."""
    params = [("emb.weight", 4096)]
    modules = [("", [], False), ("emb", [0], False)]
    for i in range(n_modules - 3):
        params += [(f"l{i}.weight", 1024), (f"l{i}.bias", 32)]
        modules.append((f"l{i}", [len(params) - 2, len(params) - 1], False))
    modules.append(("head", [0], False))
    return build_spec(params, modules, world_size=world_size,
                      persistence_threshold=config.param_persistence_threshold)


def one_pass(box, order, config):
    """One forward+backward; `box` holds the only reference to the state (see measure)."""
    st, _ = reset_step(box.pop(), config=config)
    st, _ = fetch(st, 0, forward=True, config=config)
    for m in order:
        st, _ = fetch(st, m, forward=True, config=config, grad_inputs=1)
        st, _ = release(st, m, config=config, grad_outputs=True)
    st, _ = release(st, 0, config=config)
    for m in reversed(order):
        st, _ = fetch_for_backward(st, m, config=config)
        st, _ = release_after_backward(st, m, config=config)
    st, _ = finish_backward(st, config=config)
    box.append(st)


def one_pass_calls(box, order, config):
    """The same pass as the shell sends it to fz3/core/calls.py; each module's params report
    their grads before its post-backward, then the end of backward. No optimizer step: the
    accumulation window is made long enough never to close (the param rows stay as they are)."""
    config = config.replace(gradient_accumulation_steps=1 << 40)
    st, _ = calls.enter(box.pop(), Enter(module=0, grad=True, grad_inputs=False), config=config)
    units = st.params.spec.modules
    for m in order:
        st, _ = calls.enter(st, Enter(module=m, grad=True, grad_inputs=True), config=config)
        st, _ = calls.leave(st, Leave(module=m, grad_outputs=True), config=config)
    st, _ = calls.leave(st, Leave(module=0, grad_outputs=True), config=config)
    for m in reversed(order):
        st, _ = calls.pre_backward(st, PreBackwardRan(module=m), config=config)
        for p in units[m].params:
            if st.grads.params[p].reported != st.grads.backward:  # a tied param reports once
                st, _ = calls.grad_ready(st, GradReady(param=p, dtype="float32"), config=config)
        st, _ = calls.post_backward(st, PostBackwardRan(module=m), config=config)
    st, _ = calls.end_of_backward(st, BackwardEnded(), config=config)
    box.append(st)


def one_pass_update(box, order, config):
    """The same pass as `one_pass_calls`, as the engine sends it: event records through
    fz3/core/events.py's `update` (each built, then matched)."""
    config = config.replace(gradient_accumulation_steps=1 << 40)
    update = ev.update
    st, _ = update(box.pop(), ev.Enter(module=0, grad=True, grad_inputs=False), config=config)
    units = st.params.spec.modules
    for m in order:
        st, _ = update(st, ev.Enter(module=m, grad=True, grad_inputs=True), config=config)
        st, _ = update(st, ev.Leave(module=m, grad_outputs=True), config=config)
    st, _ = update(st, ev.Leave(module=0, grad_outputs=True), config=config)
    for m in reversed(order):
        st, _ = update(st, ev.PreBackwardRan(module=m), config=config)
        for p in units[m].params:
            if st.grads.params[p].reported != st.grads.backward:  # a tied param reports once
                st, _ = update(st, ev.GradReady(param=p, dtype="float32"), config=config)
        st, _ = update(st, ev.PostBackwardRan(module=m), config=config)
    st, _ = update(st, ev.BackwardEnded(), config=config)
    box.append(st)


def steady_events(spec, order, config) -> list:
    """A training pass as the engine sends it (the events of `one_pass_update`, then StepCalled and Stepped at
    its boundary: gradient_accumulation_steps 1), the same every step, listed once."""
    st = initial(spec, "calls")
    out = [ev.Enter(module=0, grad=True, grad_inputs=False)]
    for m in order:
        out += [ev.Enter(module=m, grad=True, grad_inputs=True), ev.Leave(module=m, grad_outputs=True)]
    out.append(ev.Leave(module=0, grad_outputs=True))
    reported = set()
    for m in reversed(order):
        out.append(ev.PreBackwardRan(module=m))
        for p in spec.modules[m].params:
            if p not in reported:  # a tied param reports once
                reported.add(p)
                out.append(ev.GradReady(param=p, dtype="float32"))
        out.append(ev.PostBackwardRan(module=m))
    return out + [ev.BackwardEnded(), ev.StepCalled(), ev.Stepped()]


def one_pass_steady(box, order, config):
    """The pass of `steady_events` through the engine's door, fz3/core/replay.py's `update`:
    once a pass is recorded (its trace COMPLETE), each later one is answered from it."""
    cell, events, update = box.pop()
    for e in events:
        cell, _ = update(cell, e, config=config)
    box.append((cell, events, update))


def one_pass_lifecycles(box, order, config):
    """What the shell called before #12 moved its decisions into fz3/core/calls.py: the same
    pass as `one_pass_calls`, straight to the two lifecycles' transitions (box holds a pair)."""
    config = config.replace(gradient_accumulation_steps=1 << 40)
    st, gs = box.pop()
    st, _ = reset_step(st, config=config)
    st, _ = fetch(st, 0, forward=True, config=config)
    units = st.spec.modules
    for m in order:
        st, _ = fetch(st, m, forward=True, config=config, grad_inputs=1)
        st, _ = release(st, m, config=config, grad_outputs=True)
    st, _ = release(st, 0, config=config, grad_outputs=True)
    for m in reversed(order):
        st, _ = fetch_for_backward(st, m, config=config)
        for p in units[m].params:
            if gs.params[p].reported != gs.backward:
                gs, _ = bucket_add(gs, p, config=config, dtype="float32")
        st, _ = release_after_backward(st, m, config=config)
    gs, _ = epilogue(gs, config=config)
    st, _ = finish_backward(st, config=config)
    box.append((st, gs))


def initial(spec, events: str):
    if events == "params":
        return initial_state(spec)
    if events == "lifecycles":
        return initial_state(spec), init_grad_state(spec)
    trainable = [True] * len(spec.params)
    return calls.Lifecycle(initial_state(spec), init_grad_state(spec), calls.initial_calls(spec, trainable))


PASSES = {"params": one_pass, "lifecycles": one_pass_lifecycles, "calls": one_pass_calls, "update": one_pass_update,
          "steady": one_pass_steady, "steady-full": one_pass_steady}


def measure(sizes: list[int], config: Config, *, world_size: int = 2,
            rounds: int = 15, events: str = "params") -> dict[int, float]:
    """{modules: (median, min) seconds per module visit over the rounds}. The sizes take turns, a few passes each per
    round, so a slow spell of this shared machine hits them all alike; CPU time of this process
    (time.process_time), not wall time, so time stolen by other tenants is not counted."""
    runs = {}
    for n in sizes:
        spec = synthetic(n, world_size, config)
        order = list(range(1, n))
        # Hold only the newest state, as the shell does: an old state keeps every later change
        # alive (fz3/core/pvec.py), and a caller's `st = one_pass(st)` would hold the pass's first.
        if events.startswith("steady"):  # the engine's cell; steady-full: nothing recorded
            keep = events == "steady"
            box = [(replay.start(initial(spec, "calls")), steady_events(spec, order, config),
                    lambda cell, e, config, keep=keep: replay.advance(cell, e, config=config, keep=keep))]
        else:
            box = [initial(spec, events)]
        run = PASSES[events]
        for _ in range(4):  # RECORD, then COMPLETE (steady: recorded, then answered from it)
            run(box, order, config)
        runs[n] = (box, order, [])
    run = PASSES[events]
    for _ in range(rounds):
        for n, (box, order, samples) in runs.items():
            passes = max(1, 4000 // n)
            t0 = time.process_time()
            for _ in range(passes):
                run(box, order, config)
            samples.append((time.process_time() - t0) / passes / (2 * len(order) + 1))
    return {n: (sorted(s)[len(s) // 2], min(s)) for n, (_, _, s) in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000, 10000])
    ap.add_argument("--json", help="also write the table here")
    ap.add_argument("--events", choices=sorted(PASSES), default="params",
                    help="params: the parameter transitions; lifecycles: + the grad lifecycle, as the shell drove them before #12; calls: the shell's events (fz3/core/calls.py); update: as records through events.update; steady: a training pass with its step through fz3/core/replay.py (recorded, then replayed); steady-full: the same with nothing recorded")
    args = ap.parse_args()
    rows = []
    for name, cfg in CONFIGS.items():
        for n, (med, low) in measure(args.sizes, cfg, events=args.events).items():
            rows.append({"config": name, "modules": n, "us_per_visit": med * 1e6, "us_min": low * 1e6})
    print(f"core overhead, {args.events} events ({platform.python_implementation()} {platform.python_version()}, "
          f"{platform.machine()})")
    print(f"{'config':<10} {'modules':>8} {'us/visit':>9} {'vs 100':>7} {'min':>7}")
    for r in rows:
        base = next(x for x in rows if x["config"] == r["config"] and x["modules"] == 100)["us_per_visit"] \
            if 100 in args.sizes else r["us_per_visit"]
        r["ratio_vs_100"] = r["us_per_visit"] / base
        print(f"{r['config']:<10} {r['modules']:>8} {r['us_per_visit']:>9.2f} {r['ratio_vs_100']:>7.2f} "
              f"{r['us_min']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
