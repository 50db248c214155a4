"""The whole-step compile prototype (bench/prototype/whole_step.py, issue #25 point 5) against fz3
eager and fz3 with compiled blocks, on 2 local gloo ranks x 1 intra-op thread.

    python bench/diagnostics/whole_step.py          # small GPT: 3 warm-up + 10 measured steps each
    python bench/diagnostics/whole_step.py --quick  # smoke run: a tiny GPT, 1 warm-up + 3 steps

The systems (same GPT, seed, data and torch AdamW as bench/systems/common.py; fp32; every param
sharded: Config(param_persistence_threshold=0), the layout the prototype gathers):

    fz3 eager              fz3.initialize(model, AdamW, cfg)
    fz3 + compiled blocks  block.compile(backend="inductor") for each block, then fz3.initialize
    whole step             WholeStep(inductor): the Program read off an eager engine's trace after
                           its first step; one graph: gathers, forward, backward, reduce-scatters
    whole step, recompute  the same, each gather recomputed in the backward (SAC)
    whole step, bucketed   the same (no recompute), gathers merged up to prefetch_bucket_size
                           (5e7 elements: here the whole model in one gather, one reduce-scatter)

Timing: one launch holds all four systems (glibc's default malloc); each step, every system
steps once, in reverse order on odd steps; a step's time is the slower rank's (barriers around
it); warm-up steps discarded; the median over the measured steps.

Memory: one launch per system, alone, with MALLOC_MMAP_THRESHOLD_=131072 (as compare.py's
stats launches: a freed big block goes back to the OS, so RSS follows what is live). "peak RSS"
is each rank's ru_maxrss (compilation included, max over ranks); "step peak" the VmHWM over the
measured steps after a reset (/proc/self/clear_refs 5) once warm-up and compiling are done, and
"over resting" that peak minus the RSS just before the measured steps. "compile s" is that
launch's first step minus its median step, cold: a fresh TORCHINDUCTOR_CACHE_DIR per launch and
rank, TORCHINDUCTOR_COMPILE_THREADS=1. "saved MB": the bytes the whole step's forward graph
keeps for its backward, from the same Program compiled with AOT autograd and inductor's
partitioner (CaptureGraphs), split as whole_step.saved_bytes does (the shards it also keeps
are in the JSON). "its collectives alone": in the timing launch, after its steps, the Program's
all-gathers and reduce-scatters run eagerly one after another, each waited at once, as the graph
runs them (the comm floor of a step with no overlap; gloo's own collectives, which fz3's eager
engine replaces with point-to-point ones, fz3/interpreters/p2p.py).

Parity: each system's per-step loss (mean of the ranks) against fz3 eager's in the timing
launch, and its final params against fz3 eager's (shards, max |diff|).

Output: a Markdown table on stdout; everything in bench/out/whole_step.json (ignored by git).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [HERE, BENCH, ROOT, os.path.join(ROOT, "examples")]  # systems, prototype, fz3, gpt (ranks inherit it)

LABELS = ["fz3 eager", "fz3 + compiled blocks", "whole step", "whole step, recompute", "whole step, bucketed"]
QUICK = {"vocab": 64, "d_model": 32, "n_head": 2, "n_layer": 2, "seq": 16, "batch": 4}


# ---- in each rank ------------------------------------------------------------------------------

def _setup(rank: int, cache_root: str, quick: bool) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, f"rank{rank}")  # cold, read at first compile
    if quick:
        from systems import common
        from gpt import GPTConfig
        q = dict(QUICK)
        common.MODELS["quick"] = (GPTConfig(**{k: v for k, v in q.items() if k != "batch"}), q["batch"])


def _engine(model_name: str, *, blocks: bool):
    import fz3
    from systems.common import make_model, make_optimizer
    model = make_model(model_name)
    if blocks:
        for b in model.blocks:
            b.compile(backend="inductor")
    return fz3.initialize(model, make_optimizer(model.parameters()), fz3.Config(param_persistence_threshold=0))


class _Engine:
    def __init__(self, engine) -> None:
        self.engine = engine

    def step(self, x, y) -> float:
        from systems.common import fz3_step
        return fz3_step(self.engine, x, y).item()

    def shards(self) -> list:
        return [m.detach() for m in self.engine.store.masters]


class _Whole:
    def __init__(self, model_name: str, program, *, recompute: bool, backend="inductor") -> None:
        import torch
        import torch.distributed as dist
        from prototype.whole_step import WholeStep, shards_of
        from gpt import GPT
        from systems.common import MODELS, make_model, make_optimizer
        with torch.device("meta"):
            template = GPT(MODELS[model_name][0])
        self.program = program
        self.whole = WholeStep(template, program, shards_of(make_model(model_name), dist.get_rank(), dist.get_world_size()),
                               backend=backend, recompute=recompute, optimizer=make_optimizer)

    def step(self, x, y) -> float:
        return self.whole.step(x, y)

    def shards(self) -> list:
        return [s.detach() for s in self.whole.shards]


def _program(engine, x, y, label: str):
    """`label`'s Program, off `engine`'s trace after one eager step (which it takes if it has none)."""
    from prototype.whole_step import program_from_trace
    from systems.common import fz3_step
    if engine.params_state.trace.plan is None and engine.params_state.trace.step_id == 0:
        fz3_step(engine, x, y)
    bucket = int(engine.config.prefetch_bucket_size) if label.endswith("bucketed") else 0
    return program_from_trace(engine, bucket_numel=bucket)


def _build(label: str, model_name: str, program):
    if label.startswith("fz3"):
        return _Engine(_engine(model_name, blocks=label == "fz3 + compiled blocks"))
    return _Whole(model_name, program, recompute=label.endswith("recompute"))


def timing_rank(rank: int, world: int, spec: dict) -> dict:
    """All systems in one process, stepped in turn."""
    from systems.common import batches, slowest_seconds
    _setup(rank, spec["cache"], spec["quick"])
    name, warmup, steps = spec["model"], spec["warmup"], spec["steps"]
    data = batches(name, rank, world, warmup + steps)
    systems = {"fz3 eager": _build("fz3 eager", name, None)}
    times = {label: [] for label in LABELS}
    losses = {label: [] for label in LABELS}
    for i, (x, y) in enumerate(data):
        for label in (LABELS if i % 2 == 0 else LABELS[::-1]):  # step 0: fz3 eager first
            if label not in systems:
                systems[label] = _build(label, name, _program(systems["fz3 eager"].engine, x, y, label))
            t = slowest_seconds(lambda: losses[label].append(systems[label].step(x, y)))
            times[label].append(t)
    ref = systems["fz3 eager"].shards()
    diff = {label: max(float((a - b).abs().max()) for a, b in zip(systems[label].shards(), ref)) for label in LABELS}
    comm = {label: _collective_ms(systems[label].program) for label in LABELS if label.startswith("whole")}
    return {"times": times, "losses": losses, "param_diff": diff, "collectives_ms": comm}


def _hwm_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024


def memory_rank(rank: int, world: int, spec: dict, label: str) -> dict:
    """One system alone: compile seconds, ru_maxrss, the steady step peak; for a whole step,
    the bytes its forward graph saves."""
    from systems.common import batches, peak_rss_bytes, rss_bytes
    _setup(rank, spec["cache"], spec["quick"])
    name, warmup, steps = spec["model"], spec["warmup"], spec["steps"]
    data = batches(name, rank, world, warmup + steps)
    program = None
    if label.startswith("whole"):
        engine = _engine(name, blocks=False)
        program = _program(engine, *data[0], label)
        del engine
        gc.collect()
    system = _build(label, name, program)
    times = []
    for i, (x, y) in enumerate(data):
        if i == warmup:
            gc.collect()
            compile_peak = peak_rss_bytes()  # before the reset, which resets ru_maxrss too
            _hwm_reset()
            resting = rss_bytes()
        t0 = time.perf_counter()
        system.step(x, y)
        times.append(time.perf_counter() - t0)
    out = {"times": times, "step_peak": _hwm_bytes(), "resting": resting, "warmup_peak": compile_peak,
           "peak_rss": max(compile_peak, peak_rss_bytes())}
    if program is not None:
        out["saved"] = _saved(name, program, label.endswith("recompute"), data[0])
        out["gathers"] = len(program.gathers)
        out["full_param_bytes"] = sum(4 * _numel(s) for g in program.gathers for s in g.shapes)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _saved(name: str, program, recompute: bool, batch) -> dict:
    from prototype.whole_step import CaptureGraphs, counts, saved_bytes
    graphs = CaptureGraphs()
    w = _Whole(name, program, recompute=recompute, backend=graphs)
    w.step(*batch)
    return {"saved_bytes": saved_bytes(graphs.forward[0]), "forward": counts(graphs.forward[0]),
            "backward": counts(graphs.backward[0])}


def _collective_ms(program, reps: int = 5) -> float:
    """The Program's collectives alone, eagerly, as the graph runs them (each waited at once):
    every gather's all-gather and its reduce-scatter; the slower rank's median ms over `reps`."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from systems.common import slowest_seconds
    group, world = dist.group.WORLD.group_name, dist.get_world_size()
    flats = [torch.zeros(sum(g.shard_numels)) for g in program.gathers]

    def run() -> None:
        for flat in flats:
            full = fc.wait_tensor(fc.all_gather_single(flat, 0, group))
            fc.wait_tensor(fc.reduce_scatter_single(full, "sum", 0, group))
    run()
    return 1e3 * statistics.median(slowest_seconds(run) for _ in range(reps))


# ---- the driver --------------------------------------------------------------------------------

def _launch(fn, args: tuple, timeout: float) -> list:
    from fz3 import launch
    cache = tempfile.mkdtemp(prefix="fz3_whole_step_inductor_")
    try:
        spec = dict(args[0], cache=cache)
        return launch.run(fn, world_size=2, args=(spec, *args[1:]), timeout=timeout, threads=1)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def summarize(timing: list, memory: dict, warmup: int) -> dict:
    rows = {}
    eager_loss = [statistics.fmean(v) for v in zip(*(r["losses"]["fz3 eager"] for r in timing))]
    for label in LABELS:
        t = timing[0]["times"][label][warmup:]  # slowest_seconds: the same on both ranks
        loss = [statistics.fmean(v) for v in zip(*(r["losses"][label] for r in timing))]
        mem = memory[label]
        mt = [m["times"] for m in mem]
        med_mem = statistics.median([max(ts) for ts in zip(*mt)][warmup:])
        rows[label] = {
            "median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t), "max_ms": 1e3 * max(t),
            "compile_s": max(ts[0] for ts in mt) - med_mem,
            "peak_rss_mb": max(m["peak_rss"] for m in mem) / 2**20,
            "step_peak_mb": max(m["step_peak"] for m in mem) / 2**20,
            "over_resting_mb": max(m["step_peak"] - m["resting"] for m in mem) / 2**20,
            "saved_mb": {k: v / 2**20 for k, v in mem[0]["saved"]["saved_bytes"].items()} if "saved" in mem[0] else None,
            "collectives_ms": timing[0]["collectives_ms"].get(label),
            "graph": {k: mem[0]["saved"][k] for k in ("forward", "backward")} if "saved" in mem[0] else None,
            "loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(loss, eager_loss)),
            "param_diff": max(r["param_diff"][label] for r in timing),
        }
    base = rows["fz3 eager"]["median_ms"]
    for r in rows.values():
        r["speedup"] = base / r["median_ms"]
    return rows


def table(rows: dict, meta: dict) -> str:
    lines = [f"Whole-step compile prototype, {meta['model']} GPT, 2 gloo ranks x 1 thread, "
             f"{meta['warmup']} warm-up + {meta['steps']} measured steps, {meta['date']} ({meta['commit']}); "
             f"full params {meta['full_param_mb']:.1f} MB fp32, {meta['gathers']} gathers a step (per fetch unit).", "",
             "| system | median step ms (min-max) | vs eager | compile s | peak RSS MB | step peak MB "
             "| over resting MB | saved for bwd MB: gathered / activations | its collectives alone ms "
             "| loss rel diff | max param diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        saved = "-" if r["saved_mb"] is None else f"{r['saved_mb']['gathered']:.1f} / {r['saved_mb']['activations']:.1f}"
        comm = "-" if r["collectives_ms"] is None else f"{r['collectives_ms']:.1f}"
        lines.append(f"| {label} | {r['median_ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f}) | {r['speedup']:.2f}x "
                     f"| {r['compile_s']:.1f} | {r['peak_rss_mb']:.0f} | {r['step_peak_mb']:.0f} "
                     f"| {r['over_resting_mb']:.1f} | {saved} | {comm} | {r['loss_rel_diff']:.1e} "
                     f"| {r['param_diff']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny GPT, 1 warm-up + 3 steps")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=os.path.join(BENCH, "out", "whole_step.json"))
    args = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # the ranks inherit it
    os.environ.setdefault("FZ3_DEVICE", "cpu")
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    steps = args.steps if args.steps is not None else (3 if args.quick else 10)
    spec = {"model": "quick" if args.quick else "small", "warmup": warmup, "steps": steps, "quick": args.quick}
    _log(f"timing launch: {LABELS}")
    timing = _launch(timing_rank, (spec,), args.timeout)
    memory = {}
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # big blocks mmap'd: freed = returned
    for label in LABELS:
        _log(f"memory launch: {label}")
        memory[label] = _launch(memory_rank, (spec, label), args.timeout)
    rows = summarize(timing, memory, warmup)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    whole = memory["whole step"][0]
    meta = {**spec, "date": datetime.date.today().isoformat(), "commit": commit + " + working tree",
            "python": platform.python_version(), "torch": __import__("torch").__version__,
            "compile_threads": os.environ["TORCHINDUCTOR_COMPILE_THREADS"], "cpus": os.cpu_count(),
            "full_param_mb": whole["full_param_bytes"] / 2**20, "gathers": whole["gathers"]}
    print(table(rows, meta))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "timing": timing, "memory": memory}, f, indent=1)
    _log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
