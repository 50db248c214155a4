"""fz3 eager vs fz3 compiled (inductor, per block), beside FSDP2 and DDP eager and compiled, on 2
local gloo ranks (issue #25).

    python bench/diagnostics/compile.py            # small and wide, 3 rounds x (3 warm-up + 8 measured steps)
    python bench/diagnostics/compile.py --quick    # smoke run: small only, 1 round, 3 measured steps
    python bench/diagnostics/compile.py --fz3-compile blocks   # fz3 compiled by block.compile() before fz3.initialize

Runs in the current interpreter (the project's .venv does: FSDP2 and DDP are plain torch; no
DeepSpeed needed). Every system trains the same GPT from the same seed on the same data with
torch AdamW, fp32, 2 ranks x 1 intra-op thread, as bench/compare.py. The systems:

    fz3             fz3 eager (bench/systems/fz3_z3.py, fz3's defaults)
    fz3-blocks      (--systems only) fz3 eager with a block per fetch unit (set_leaf_modules):
                    the units fz3-compiled has, without the compiler (systems/fz3_blocks.py)
    fz3-compiled    fz3 with each transformer block compiled by inductor (systems/fz3_compiled.py):
                    --fz3-compile engine (default): fz3.initialize, then engine.compile(backend=
                    "inductor"), falling back to "blocks" when the engine has no compile();
                    blocks: block.compile(backend="inductor") for each block, then fz3.initialize
    fsdp2           FSDP2 eager (systems/fsdp2.py)
    fsdp2-compiled  torchtitan's per-block recipe: torch.compile(block, fullgraph=True) before
                    fully_shard(block), then fully_shard(model) (systems/fsdp2_compiled.py)
    ddp             DDP eager (systems/ddp.py)
    ddp-compiled    torch.compile(DDP(model)), optimize_ddp at its default (systems/ddp_compiled.py)
    local, local-blocks, local-model
                    (--systems only) no data parallelism: each rank steps its own copy of the model
                    on its local batch, no communication, eager / blocks compiled / the whole model
                    compiled (systems/local.py): what the compiler buys the compute alone here,
                    the ceiling of any system's speed-up at those units

Launches are interleaved: round r runs every system once per model, in reverse order on odd
rounds, each a fresh 2-rank launch (fz3.launch.run); warm-up steps are discarded. Step time = the
slower rank's forward + backward + optimizer step; per system and model the median over all
measured steps of all rounds. "step 0 s" is the first step's wall time on the slower rank: for a
compiled system it holds the compilation (dynamo + AOTAutograd + inductor + the C++ compiler),
forward and backward. It is cold: round 0's launches each get a fresh, empty
TORCHINDUCTOR_CACHE_DIR per rank, so no FX-graph / AOTAutograd / C++ cache is reused between
systems or between the two ranks, and the table's step 0 is round 0's; later rounds reuse their
own system's caches (--cache cold: every launch cold, ~2 min each); TORCHINDUCTOR_COMPILE_THREADS=1 (unless set) so each rank compiles in its
own process on its one core. Peak RSS = ru_maxrss of each rank at the end of its launch
(common.peak_rss_bytes: compilation included), max over ranks, glibc's default malloc (not
compare.py's MALLOC_MMAP_THRESHOLD_ stats launches). The eager rows load the compiler first
(one 1-op inductor compile; --no-compiler-in-eager: not), so the columns compare what training
holds and not the compiler's own code, whose size the JSON gives (compiler_loaded_mib). Losses: each compiled system's per-step
loss (mean of the ranks) against its eager twin's in the same round; the max relative
difference over the measured steps is printed, so a broken compile is not mistaken for a fast
one. Dynamo's counters (graphs, graph breaks, graphs new after step 0: recompiles) are in the JSON.

Output: a Markdown table on stdout (with the date and commit), everything in
bench/out/compile.json (ignored by git); --md bench/RESULTS.md also puts the table there, in its
own section (bench_env.replace_section). Progress lines go to stderr.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [HERE, BENCH]  # systems.* (spawned ranks inherit sys.path)

import compare  # noqa: E402  (machine_info)

LABELS = ["fz3", "fz3-compiled", "fsdp2", "fsdp2-compiled", "ddp", "ddp-compiled", "fz3-blocks",
          "local", "local-blocks", "local-model"]
EAGER_OF = {"fz3-compiled": "fz3", "fsdp2-compiled": "fsdp2", "ddp-compiled": "ddp",
            "local-blocks": "local", "local-model": "local"}
MD_BEGIN, MD_END = "<!-- compile:begin -->", "<!-- compile:end -->"
LOSS_RTOL = 1e-4  # compiled vs eager loss, relative: fp32 reordering stays far below it over a few steps
TARGETS = {"speedup": 1.1, "vs_fsdp2": 0.8}  # fz3 eager / fz3 compiled >=; fz3 compiled / fsdp2 compiled <=


def systems_table(fz3_compile: str) -> dict[str, dict]:
    return {
        "fz3": {"module": "fz3_z3", "options": {"config": {}}},
        "fz3-compiled": {"module": "fz3_compiled", "options": {"config": {}, "compile": fz3_compile}},
        "fsdp2": {"module": "fsdp2", "options": {}},
        "fsdp2-compiled": {"module": "fsdp2_compiled", "options": {}},
        "ddp": {"module": "ddp", "options": {}},
        "ddp-compiled": {"module": "ddp_compiled", "options": {}},
        "fz3-blocks": {"module": "fz3_blocks", "options": {"config": {}}},  # eager, fz3-compiled's units
        "local": {"module": "local", "options": {"compile": None}},  # no communication: the compute alone
        "local-blocks": {"module": "local", "options": {"compile": "blocks"}},
        "local-model": {"module": "local", "options": {"compile": "model"}},
    }


# ---- in each rank ------------------------------------------------------------------------------

def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters
    return {"unique_graphs": counters["stats"].get("unique_graphs", 0),
            "calls_captured": counters["stats"].get("calls_captured", 0),
            "frames_ok": counters["frames"].get("ok", 0), "frames_total": counters["frames"].get("total", 0),
            "graph_breaks": sum(counters["graph_break"].values()),  # distinct breaks met while tracing
            "graph_break_reasons": {k.splitlines()[0] + (" | " + k.splitlines()[1].strip() if "\n" in k else ""): v
                                    for k, v in counters["graph_break"].items()}}


def worker(rank: int, world: int, module: str, spec: dict, cache_root: str) -> dict:
    """One rank: its own fresh inductor cache, build the system, warm-up + measured steps
    (common.worker's loop, time mode), then peak RSS and dynamo's counters."""
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, f"rank{rank}")  # read at first compile
    cache_cold = not os.path.isdir(cache) or not os.listdir(cache)
    import importlib
    import warnings

    import torch
    # the graph break at fz3's / FSDP2's disabled hooks: counted in dynamo's counters (the JSON)
    warnings.filterwarnings("ignore", message="Dynamo does not know how to trace the builtin")
    from systems.common import batches, peak_rss_bytes, rss_bytes
    mod = importlib.import_module(f"systems.{module}")
    compiler_bytes = 0
    if spec.get("load_compiler"):  # an eager row with the compiler's own code in memory too
        before = rss_bytes()
        torch.compile(lambda t: t * 2 + 1, backend="inductor")(torch.ones(4))
        compiler_bytes = rss_bytes() - before
    t0 = time.perf_counter()
    sysobj = mod.build(rank, world, spec)
    build_s = time.perf_counter() - t0
    data = batches(spec["model"], rank, world, spec["warmup"] + spec["steps"])
    times, losses, after_step0 = [], [], None
    for i, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        losses.append(sysobj.step(x, y))
        times.append(time.perf_counter() - t0)
        if i == 0:
            after_step0 = _dynamo_counts()
            rss_step0 = peak_rss_bytes()
    end = _dynamo_counts()
    return {"rank": rank, "step0_s": times[0], "warmup_times": times[:spec["warmup"]],
            "times": times[spec["warmup"]:], "losses": losses, "build_s": build_s,
            "peak_rss": peak_rss_bytes(), "peak_rss_after_step0": rss_step0, "rss_end": rss_bytes(),
            "dynamo_after_step0": after_step0, "dynamo_end": end, "compiler_loaded_bytes": compiler_bytes,
            "describe": sysobj.describe() if hasattr(sysobj, "describe") else None,
            "torch_threads": torch.get_num_threads(),
            "inductor_cache_cold": cache_cold,  # empty before the build
            "inductor_cache_written": os.path.isdir(cache) and bool(os.listdir(cache))}  # compiled into it


# ---- the orchestrator ----------------------------------------------------------------------------

def launch(system: dict, spec: dict, timeout: float, root: str) -> list[dict]:
    """One fresh 2-rank launch, inductor's cache per rank under `root`."""
    import fz3.launch
    return fz3.launch.run(worker, world_size=2, args=(system["module"], spec, root), timeout=timeout, threads=1)


def merge(results: list[dict]) -> dict:
    """Per step the slower rank's time, the mean of the ranks' losses; peak RSS max over ranks."""
    n = len(results[0]["times"])
    return {"times": [max(r["times"][i] for r in results) for i in range(n)],
            "warmup_times": [max(r["warmup_times"][i] for r in results) for i in range(len(results[0]["warmup_times"]))],
            "losses": [statistics.fmean(r["losses"][i] for r in results) for i in range(len(results[0]["losses"]))],
            "step0_s": max(r["step0_s"] for r in results), "build_s": max(r["build_s"] for r in results),
            "peak_rss_mib": max(r["peak_rss"] for r in results) / 2**20,
            "peak_rss_mib_per_rank": [r["peak_rss"] / 2**20 for r in results],
            "peak_rss_after_step0_mib": max(r["peak_rss_after_step0"] for r in results) / 2**20,
            "rss_end_mib": max(r["rss_end"] for r in results) / 2**20,
            "compiler_loaded_mib": max(r["compiler_loaded_bytes"] for r in results) / 2**20,
            "dynamo": [{"after_step0": r["dynamo_after_step0"], "end": r["dynamo_end"]} for r in results],
            "describe": results[0]["describe"],
            "cache_cold": all(r["inductor_cache_cold"] for r in results),
            "cache_written": [r["inductor_cache_written"] for r in results]}


def versions() -> dict:
    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__}
    git = lambda *a: subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    try:
        out["fz3_git"] = git("rev-parse", "--short", "HEAD")
        out["fz3_dirty"] = bool(git("status", "--porcelain", "fz3"))
        out["bench_dirty"] = bool(git("status", "--porcelain", "bench"))
    except OSError:
        pass
    return out


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {msg}", file=sys.stderr, flush=True)


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def summarize(res: dict, models: list[str]) -> dict:
    out = {}
    for model in models:
        runs = res["timed"][model]
        per = {}
        for label, rs in runs.items():
            ts = [t for r in rs for t in r["times"]]
            per[label] = {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
                          "round_medians_ms": [1e3 * statistics.median(r["times"]) for r in rs],
                          "step0_s": [r["step0_s"] for r in rs], "step0_s_median": rs[0]["step0_s"] if res["settings"]["cache"] == "first-cold"
                          else statistics.median(r["step0_s"] for r in rs),
                          "build_s_median": statistics.median(r["build_s"] for r in rs),
                          "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
                          "rss_end_mib": max(r["rss_end_mib"] for r in rs),
                          "graphs": max(d["end"]["unique_graphs"] for r in rs for d in r["dynamo"]),
                          "graph_breaks": max(d["end"]["graph_breaks"] for r in rs for d in r["dynamo"]),
                          "graphs_after_step0": max(d["end"]["unique_graphs"] - d["after_step0"]["unique_graphs"]
                                                    for r in rs for d in r["dynamo"])}
            eager = EAGER_OF.get(label)
            if eager in runs:  # round by round: same seed, same data
                w = res["settings"]["warmup"]
                per[label]["loss_max_rel_diff"] = max(max_rel_diff(c["losses"][w:], e["losses"][w:])
                                                      for c, e in zip(rs, runs[eager]))
                per[label]["loss_max_rel_diff_all_steps"] = max(max_rel_diff(c["losses"], e["losses"])
                                                                for c, e in zip(rs, runs[eager]))
        med = lambda k: per[k]["median_ms"] if k in per else None  # noqa: E731
        ratios = {}
        if med("fz3") and med("fz3-compiled"):
            ratios["fz3_speedup"] = med("fz3") / med("fz3-compiled")
            ratios["fz3c_over_fz3"] = med("fz3-compiled") / med("fz3")
        if med("fz3-compiled") and med("fsdp2-compiled"):
            ratios["fz3c_over_fsdp2c"] = med("fz3-compiled") / med("fsdp2-compiled")
        if med("fz3-compiled") and med("ddp-compiled"):
            ratios["fz3c_over_ddpc"] = med("fz3-compiled") / med("ddp-compiled")
        if med("fsdp2") and med("fsdp2-compiled"):
            ratios["fsdp2_speedup"] = med("fsdp2") / med("fsdp2-compiled")
        if med("ddp") and med("ddp-compiled"):
            ratios["ddp_speedup"] = med("ddp") / med("ddp-compiled")
        if med("fz3-blocks") and med("fz3-compiled"):  # the compiler alone, at the same units
            ratios["blocks_speedup"] = med("fz3-blocks") / med("fz3-compiled")
            if med("fz3"):
                ratios["units_speedup"] = med("fz3") / med("fz3-blocks")
        for k in ("blocks", "model"):  # the compiler on the compute alone, no communication
            if med("local") and med(f"local-{k}"):
                ratios[f"local_{k}_speedup"] = med("local") / med(f"local-{k}")
        if "fz3" in per and "fz3-compiled" in per:
            ratios["fz3c_rss_over_fz3"] = per["fz3-compiled"]["peak_rss_mib"] / per["fz3"]["peak_rss_mib"]
        out[model] = {"systems": per, "ratios": ratios}
    return out


def _met(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def markdown(res: dict) -> str:
    from systems.common import MODELS, make_model
    s = res["settings"]
    lines = ["## fz3 compiled vs eager, FSDP2 and DDP compiled (issue #25)", "",
             f"Command: `{res['command']}`. Started {res['started']}, finished {res['finished']} "
             f"({res['total_s'] / 60:.1f} min). fz3 at {res['versions'].get('fz3_git')}"
             f"{' (fz3/ modified)' if res['versions'].get('fz3_dirty') else ''}, torch {res['versions']['torch']}, "
             f"Python {res['versions']['python']}. Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores. "
             f"Load average (1 min) {res['load_start'][0]:.2f} at start, {res['load_end'][0]:.2f} at end.", "",
             f"Setup: 2 gloo ranks x 1 thread, fp32, AdamW; {s['rounds']} round(s) of fresh launches, interleaved "
             f"(reversed on odd rounds), {s['warmup']} warm-up steps discarded + {s['steps']} measured per launch; "
             f"step = the slower rank's step. Eager rows loaded the compiler first: {res['compiler_in_eager']} "
             f"(+{max((r['compiler_loaded_mib'] for m in res['timed'].values() for rs in m.values() for r in rs), default=0):.0f} MiB RSS). "
             f"Compile: inductor; fz3 `{res['fz3_compile_used']}` "
             f"(asked `{s['fz3_compile']}`); FSDP2 torch.compile(block, fullgraph=True) before fully_shard(block); "
             f"DDP torch.compile(DDP(model)), optimize_ddp={res['optimize_ddp']}. "
             f"Inductor cache: {res['inductor_cache']}; step 0 = round 0's, cold"
             f"{' (all were empty at launch)' if res['all_caches_cold'] else ' (SOME WERE NOT EMPTY)'}; "
             f"TORCHINDUCTOR_COMPILE_THREADS={res['compile_threads']}. "
             f"Peak RSS: ru_maxrss at the end of the launch (compilation included), max over ranks, default malloc.", ""]
    for model, sm in res["summary"].items():
        cfg, gb = MODELS[model]
        n = sum(p.numel() for p in {id(p): p for p in make_model(model).parameters()}.values())
        lines += [f"### {model}: GPT(vocab {cfg.vocab}, d_model {cfg.d_model}, heads {cfg.n_head}, layers "
                  f"{cfg.n_layer}, seq {cfg.seq}), global batch {gb}, {n:,} parameters", "",
                  "| system | median ms | min–max ms | medians per round | step 0 s (compile, cold) | build s | "
                  "peak RSS MiB (max rank) | RSS at end MiB | graphs / breaks / new after step 0 | "
                  "loss max rel diff vs eager |",
                  "|---|---:|---:|---|---|---:|---:|---:|---|---:|"]
        for label in LABELS:
            p = sm["systems"].get(label)
            if p is None:
                continue
            gr = f"{p['graphs']} / {p['graph_breaks']} / {p['graphs_after_step0']}" if p["graphs"] else "–"
            lrd = "–" if "loss_max_rel_diff" not in p else f"{p['loss_max_rel_diff']:.1e}" + (
                f" **above {LOSS_RTOL:g}: compile broken?**" if p["loss_max_rel_diff"] > LOSS_RTOL else "")
            lines.append(f"| {label} | {p['median_ms']:.0f} | {p['min_ms']:.0f}–{p['max_ms']:.0f} | "
                         f"{' / '.join(f'{m:.0f}' for m in p['round_medians_ms'])} | "
                         f"{' / '.join(f'{t:.1f}' for t in p['step0_s'])} | {p['build_s_median']:.1f} | "
                         f"{p['peak_rss_mib']:.0f} | {p['rss_end_mib']:.0f} | {gr} | {lrd} |")
        r = sm["ratios"]
        lines.append("")
        parts = []
        if "fz3_speedup" in r:
            parts.append(f"fz3 compiled ÷ eager **{r['fz3c_over_fz3']:.2f}** (speed-up {r['fz3_speedup']:.2f}×, "
                         f"target ≥ {TARGETS['speedup']}× {_met(r['fz3_speedup'] >= TARGETS['speedup'])})")
        if "fz3c_over_fsdp2c" in r:
            parts.append(f"fz3 compiled ÷ FSDP2 compiled **{r['fz3c_over_fsdp2c']:.2f}** "
                         f"(target ≤ {TARGETS['vs_fsdp2']} {_met(r['fz3c_over_fsdp2c'] <= TARGETS['vs_fsdp2'])})")
        if "fz3c_over_ddpc" in r:
            parts.append(f"fz3 compiled ÷ DDP compiled **{r['fz3c_over_ddpc']:.2f}**")
        if "fz3c_rss_over_fz3" in r:
            parts.append(f"fz3 compiled peak RSS ÷ eager {r['fz3c_rss_over_fz3']:.2f} "
                         f"(target ≤ 1 {_met(r['fz3c_rss_over_fz3'] <= 1.0)})")
        if "blocks_speedup" in r:
            parts.append(f"of fz3's speed-up, the block units alone (fz3-blocks, eager) give "
                         f"{r.get('units_speedup', float('nan')):.2f}× and the compiler at those units "
                         f"{r['blocks_speedup']:.2f}×")
        for k, name in (("fsdp2_speedup", "FSDP2"), ("ddp_speedup", "DDP")):
            if k in r:
                parts.append(f"{name} speed-up from compile {r[k]:.2f}×")
        for k, name in (("local_blocks_speedup", "blocks compiled"), ("local_model_speedup", "the whole model compiled")):
            if k in r:
                parts.append(f"the compute alone (local, no communication) with {name} {r[k]:.2f}×")
        lines += ["Ratios (medians): " + "; ".join(parts) + ".", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,wide")
    ap.add_argument("--systems", default=",".join(LABELS[:6]), help="comma list of: " + ", ".join(LABELS)
                    + " (fz3-blocks: fz3 eager with a block per fetch unit, the units fz3-compiled has)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per launch")
    ap.add_argument("--warmup", type=int, default=3, help="discarded steps per launch (>= 1: step 0 is the compile)")
    ap.add_argument("--fz3-compile", choices=("engine", "blocks"), default="engine",
                    help="engine: engine.compile(backend='inductor') after fz3.initialize (falls back to blocks "
                         "when the engine has no compile()); blocks: block.compile() before fz3.initialize")
    ap.add_argument("--compiler-in-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="eager rows first load the compiler (one 1-op inductor compile), so peak RSS compares "
                         "what training holds, not the compiler's own code (which the JSON gives per rank)")
    ap.add_argument("--cache", choices=("first-cold", "cold"), default="first-cold",
                    help="first-cold: round 0 compiles into empty inductor caches (its step 0 is the cold compile "
                         "time), later rounds reuse them; cold: every launch compiles cold (slow)")
    ap.add_argument("--quick", action="store_true", help="smoke run: small only, 1 round, 3 measured steps")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per launch")
    ap.add_argument("--out", default=os.path.join(BENCH, "out", "compile.json"))
    ap.add_argument("--md", default=None, help="also put the table in this Markdown file (e.g. bench/RESULTS.md), "
                                               "between compile:begin / compile:end markers; default: stdout only")
    args = ap.parse_args()
    if args.quick:
        args.models, args.rounds, args.steps = "small", 1, 3
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (step 0 holds the compile)")
    labels = args.systems.split(",")
    unknown = set(labels) - set(LABELS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}")
    models = args.models.split(",")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # the ranks inherit it
    import torch
    torch.set_num_threads(1)
    from fz3.shell.engine import Engine
    table = systems_table(args.fz3_compile)
    t_start = time.time()
    res: dict = {"started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "command": "python bench/diagnostics/compile.py " + " ".join(sys.argv[1:]),
                 "machine": compare.machine_info(), "versions": versions(), "load_start": os.getloadavg(),
                 "settings": {"rounds": args.rounds, "warmup": args.warmup, "steps": args.steps, "world": 2,
                              "threads_per_rank": 1, "fz3_compile": args.fz3_compile, "cache": args.cache, "models": models,
                              "systems": labels, "backend": "inductor"},
                 "fz3_compile_used": "engine" if args.fz3_compile == "engine" and hasattr(Engine, "compile") else "blocks",
                 "optimize_ddp": torch._dynamo.config.optimize_ddp,
                 "compile_threads": os.environ["TORCHINDUCTOR_COMPILE_THREADS"],
                 "compiler_in_eager": args.compiler_in_eager,
                 "inductor_cache": ("cold: fresh empty TORCHINDUCTOR_CACHE_DIR per launch and rank" if args.cache == "cold"
                                    else "first-cold: round 0 fresh and empty per rank; later rounds reuse it"),
                 "systems": {k: table[k] for k in labels}, "timed": {}, "loads": []}
    if res["fz3_compile_used"] != args.fz3_compile:
        log("fz3: the engine has no compile(); fz3-compiled uses --fz3-compile blocks")
    cold_all = True
    roots: dict[tuple[str, str], str] = {}
    for r in range(args.rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        for model in models:
            for label in order:
                spec = {"model": model, "warmup": args.warmup, "steps": args.steps, "mode": "time",
                        "options": table[label]["options"],
                        "load_compiler": args.compiler_in_eager and not label.endswith("-compiled")}
                t0 = time.time()
                # round 0 compiles cold (a fresh, empty cache per rank: its step 0 is the compile
                # time); later rounds reuse that system's cache, so they cost a launch, not a compile
                if r == 0 or args.cache == "cold":
                    shutil.rmtree(roots.get((model, label), ""), ignore_errors=True)
                    roots[(model, label)] = tempfile.mkdtemp(prefix="fz3-compile-bench-")
                merged = merge(launch(table[label], spec, args.timeout, roots[(model, label)]))
                if r == 0 or args.cache == "cold":
                    cold_all &= merged["cache_cold"]
                if label.endswith("-compiled") and not all(merged["cache_written"]):
                    log(f"{label}: a rank wrote nothing to its fresh TORCHINDUCTOR_CACHE_DIR: compiled elsewhere?")
                merged.update(launch_s=time.time() - t0, load=os.getloadavg()[0], round=r)
                res["timed"].setdefault(model, {}).setdefault(label, []).append(merged)
                res["loads"].append(merged["load"])
                log(f"round {r} {model:5s} {label:14s} median {1e3 * statistics.median(merged['times']):7.1f} ms, "
                    f"step 0 {merged['step0_s']:6.1f} s, peak RSS {merged['peak_rss_mib']:.0f} MiB "
                    f"(launch {merged['launch_s']:.0f} s)")
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
    res["all_caches_cold"] = cold_all
    res["summary"] = summarize(res, models)
    res.update(load_end=os.getloadavg(), total_s=time.time() - t_start,
               finished=datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    md = res["markdown"] = markdown(res)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(md)
    if args.md:
        from bench_env import replace_section
        replace_section(args.md, MD_BEGIN + "\n" + md.rstrip("\n") + "\n" + MD_END, MD_BEGIN, MD_END)
    log(f"wrote {args.out}{' and ' + args.md if args.md else ''} in {res['total_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
