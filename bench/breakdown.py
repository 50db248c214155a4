"""Where an fz3 step's time goes, per rank: instrumenting timers around the shell, the core, the
interpreter and the collectives' waits, plus a cProfile pass for the hottest Python frames.

    worker(rank, world, model, config, warmup, steps) -> dict   # run by fz3.launch.run

Categories (exclusive time: a nested timed call is charged to its own category, not its caller):
    compute          the rest of the step: forward/backward ops, autograd engine, loss, .item()
    gather_wait      Work.wait() of all-gathers            gather_issue  pack + issue all-gathers
                     (fz3's p2p ones too: their receives land straight in the params)
    gather_unpack    _wait after the wait: split, set .data
    reduce_wait      Work.wait() of reduce-scatters / all-reduces
    reduce_issue     pack (rank-interleave) + issue        reduce_finish unpack + partition writes
    bucket_copy      param.grad -> IPG bucket
    optimizer        optimizer.step() on the fp32 shards   step_other    bind_grads, refresh shards
    core             fz3.core's events: the engine's door (fz3/core/replay.py: a steady-state
                     event answered from its schedule) and fz3/core/calls.py's steps under it
                     (enter, leave, grad_ready, ...: every decision and the lifecycle transitions)
    shell            Engine hooks, the event door and effect dispatch, wrap_tensors (autograd
                     Function apply)
Before fz3, the same ranks time the plain model (local batch, AdamW, no communication): the
compute floor that DDP adds one all-reduce to.

Monkeypatches only this process's classes and torch.distributed functions; fz3's source is untouched.

    python bench/breakdown.py --model deep --world 2 [--device cuda]   # one launch, the table
"""
from __future__ import annotations

import cProfile
import functools
import io
import pstats
import time
from collections import defaultdict

import torch.distributed as dist

CATEGORIES = ("compute", "gather_wait", "gather_issue", "gather_unpack", "reduce_wait", "reduce_issue",
              "reduce_finish", "bucket_copy", "optimizer", "step_other", "core", "shell")


class Timers:
    """Exclusive wall time per category; a stack charges nested time to the innermost entry."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list] = []
        self.enabled = False

    def wrap(self, cat: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            frame = [time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                dur = time.perf_counter() - frame[0]
                self.total[cat] += dur - frame[1]
                self.calls[cat] += 1
                if self.stack:
                    self.stack[-1][1] += dur
        return timed

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()


class _TimedWork:
    def __init__(self, work, wait) -> None:
        self._work, self.wait = work, wait

    def __getattr__(self, name):
        return getattr(self._work, name)


def instrument(timers: Timers) -> None:
    """Patch fz3's shell / interpreter classes and the collectives it calls (before initialize:
    the hooks bind the Engine's methods when they are installed)."""
    import fz3.core.calls as calls
    import fz3.shell.engine as eng
    import fz3.shell.hooks as hooks
    from fz3.interpreters.dist import DistInterpreter

    for name in ("enter", "read", "leave", "raised", "pre_backward", "post_backward", "grad_ready",
                 "end_of_backward", "stepped"):  # the core's events: every decision and transition
        setattr(calls, name, timers.wrap("core", getattr(calls, name)))
    import fz3.core.replay as replay  # the engine's door: a replayed event never reaches calls.*
    replay.advance = timers.wrap("core", replay.advance)
    eng.at_boundary = timers.wrap("core", eng.at_boundary)
    for name in ("_pre_forward", "_post_forward", "_pre_backward", "_post_backward", "_on_param_read",
                 "_end_of_backward", "apply", "_run", "_begin_pass"):
        setattr(eng.Engine, name, timers.wrap("shell", getattr(eng.Engine, name)))
    eng.wrap_tensors = timers.wrap("shell", hooks.wrap_tensors)
    eng.Engine.step = timers.wrap("step_other", eng.Engine.step)
    for name, cat in (("run", "shell"), ("_all_gather", "gather_issue"), ("_refresh", "gather_issue"),
                      ("_wait", "gather_unpack"),
                      ("_copy_to_bucket", "bucket_copy"), ("_hold_grad", "bucket_copy"), ("_reduce", "reduce_issue"),
                      ("_complete_oldest", "reduce_finish"), ("_write", "reduce_finish")):
        setattr(DistInterpreter, name, timers.wrap(cat, getattr(DistInterpreter, name)))
    # gloo's own collectives, through the interpreter's transport (fz3/interpreters/transport.py)
    from fz3.interpreters.transport import TorchTransport
    for name, cat in (("all_gather_into", "gather_wait"), ("reduce_scatter_into", "reduce_wait")):
        setattr(TorchTransport, name, _timed_work(getattr(TorchTransport, name), timers.wrap(cat, lambda w: w.wait())))
    # all_reduce carries reduces, and on gloo large all-gathers too: charge it by its issuer
    in_gather = [False]

    def gathering(issue):
        def gather(self, *args, **kwargs):
            in_gather[0] = True
            try:
                return issue(self, *args, **kwargs)
            finally:
                in_gather[0] = False
        return gather
    DistInterpreter._all_gather = gathering(DistInterpreter._all_gather)
    DistInterpreter._refresh = gathering(DistInterpreter._refresh)  # the step's, in place
    as_gather = _timed_work(dist.all_reduce, timers.wrap("gather_wait", lambda w: w.wait()))
    as_reduce = _timed_work(dist.all_reduce, timers.wrap("reduce_wait", lambda w: w.wait()))
    dist.all_reduce = lambda *a, **k: (as_gather if in_gather[0] else as_reduce)(*a, **k)
    # fz3's point-to-point collectives on gloo (fz3/interpreters/p2p.py)
    import fz3.interpreters.p2p as p2p
    p2p.all_gather = _timed_work(p2p.all_gather, timers.wrap("gather_wait", lambda w: w.wait()))
    rs, rs_wait = p2p.reduce_scatter, timers.wrap("reduce_wait", lambda w: w.wait())

    def reduce_scatter(*args, **kwargs):
        work, result = rs(*args, **kwargs)
        return _TimedWork(work, lambda: rs_wait(work)), result
    p2p.reduce_scatter = reduce_scatter


def _timed_work(collective, timed_wait):
    @functools.wraps(collective)
    def issue(*args, **kwargs):
        work = collective(*args, **kwargs)
        return work if work is None else _TimedWork(work, lambda: timed_wait(work))
    return issue


def _plain_floor(model_name: str, data, warmup: int) -> list[float]:
    from systems.common import make_model, make_optimizer, plain_step
    model = make_model(model_name)
    opt = make_optimizer(model.parameters())
    times = []
    for x, y in data:
        t0 = time.perf_counter()
        plain_step(model, opt, x, y).item()
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def worker(rank: int, world: int, model_name: str, config: dict, warmup: int, steps: int,
           profile_steps: int = 3) -> dict:
    import fz3
    from systems.common import batches, fz3_settings, fz3_step, make_model, make_optimizer

    data = batches(model_name, rank, world, warmup + steps + profile_steps)
    floor = _plain_floor(model_name, data[:warmup + steps], warmup)
    dist.barrier()
    timers = Timers()
    instrument(timers)
    model = make_model(model_name)
    cfg, options = fz3_settings(config)
    engine = fz3.initialize(model, make_optimizer(model.parameters()), cfg, options=options)
    engine.optimizer.step = timers.wrap("optimizer", engine.optimizer.step)
    step_times = []
    for i, (x, y) in enumerate(data[:warmup + steps]):
        if i == warmup:
            timers.reset()
            timers.enabled = True
        t0 = time.perf_counter()
        fz3_step(engine, x, y).item()
        step_times.append(time.perf_counter() - t0)
    timers.enabled = False
    measured = step_times[warmup:]
    per_step = {k: v / steps for k, v in timers.total.items()}
    per_step["compute"] = sum(measured) / steps - sum(per_step.values())
    calls = {k: v / steps for k, v in timers.calls.items()}
    # cProfile pass (timers off): the hottest Python frames
    prof = cProfile.Profile()
    prof.enable()
    for x, y in data[warmup + steps:]:
        fz3_step(engine, x, y).item()
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(25)
    top = []
    for (fname, line, func), (cc, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:25]:
        top.append({"func": f"{fname.split('site-packages/')[-1].split('/work/main/')[-1]}:{line}({func})",
                    "calls_per_step": nc / max(profile_steps, 1), "tottime_ms_per_step": 1e3 * tt / max(profile_steps, 1),
                    "cumtime_ms_per_step": 1e3 * ct / max(profile_steps, 1)})
    return {"rank": rank, "step_times": measured, "floor_times": floor, "per_step": per_step,
            "calls_per_step": calls, "cprofile_top": top, "stats": dict(engine.stats())}


def main(argv: list[str] | None = None) -> int:
    """python bench/breakdown.py [--model deep] [--world 2] [--steps 30] [--device cpu|cuda]
    [--config JSON]: one launch, rank 0's table (ms per step by category) and hottest frames."""
    import argparse
    import json
    import os
    import statistics
    import sys
    ap = argparse.ArgumentParser(description="where an fz3 step's time goes, per category")
    ap.add_argument("--model", default="deep")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--config", default="{}", help="fz3 Config / Options fields, as JSON")
    args = ap.parse_args(argv)
    os.environ["FZ3_DEVICE"] = os.environ["FZ3_BENCH_DEVICE"] = args.device  # the ranks inherit them
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fz3.launch
    out = fz3.launch.run(worker, world_size=args.world, args=(args.model, json.loads(args.config), args.warmup,
                                                               args.steps), timeout=600, threads=1)[0]
    print(f"{args.model}, world {args.world}, {args.device}: step median "
          f"{1e3 * statistics.median(out['step_times']):.2f} ms (the plain model alone: "
          f"{1e3 * statistics.median(out['floor_times']):.2f} ms); replayed events {out['stats'].get('replayed_events')}")
    for k, v in sorted(out["per_step"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:14s} {1e3 * v:8.2f} ms   calls {out['calls_per_step'].get(k, 0):.0f}")
    print("hottest frames (ms per step: own, cumulative; calls per step):")
    for t in out["cprofile_top"][:20]:
        print(f"  {t['tottime_ms_per_step']:6.2f} {t['cumtime_ms_per_step']:7.2f} {t['calls_per_step']:6.0f}  {t['func']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
