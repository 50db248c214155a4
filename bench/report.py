"""Render bench/results.json (from compare.py) as the compare section of bench/RESULTS.md.

    python bench/report.py [bench/results.json]    # re-render without re-running

Only the text between <!-- compare:begin --> and <!-- compare:end --> is replaced; the rest of
RESULTS.md (e.g. other benchmarks' sections) is kept. Numbers only: diagnosis lives outside.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"
SUMMARY_BEGIN, SUMMARY_END = "<!-- summary:begin -->", "<!-- summary:end -->"
TARGETS = {"fsdp2": 0.9, "deepspeed": 0.9, "ddp": 1.15}  # fz3 step time / system's, at most
MiB = 2**20


def _ms(x: float) -> str:
    return f"{1e3 * x:.0f}"


def _mib(x) -> str:
    return "–" if x is None else f"{x / MiB:.2f}"


def _times(runs: list[dict]) -> list[float]:
    return [t for r in runs for t in r["times"]]


def step_table(res: dict, model: str) -> list[str]:
    timed = res["timed"].get(model, {})
    if "fz3" not in timed:
        return []
    fz3_med = statistics.median(_times(timed["fz3"]))
    fz3_min = min(_times(timed["fz3"]))
    cpu = lambda runs: [c for r in runs for c in r.get("cpu", [])]  # noqa: E731
    rows = ["| system | median ms | min–max ms | medians per round (launches) or per third of the steps | system ÷ fz3 | **fz3 ÷ system** (median) | "
            "fz3 ÷ system (min) | CPU ms/step (median) | target (fz3 ÷ system) |",
            "|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for label, runs in timed.items():
        ts = _times(runs)
        med = statistics.median(ts)
        if len(runs) > 1:
            rounds = " / ".join(_ms(statistics.median(r["times"])) for r in runs)
        else:  # steps mode: thirds of the measured steps, to show drift
            k = max(1, len(ts) // 3)
            rounds = " / ".join(_ms(statistics.median(ts[i:i + k])) for i in range(0, k * 3, k) if ts[i:i + k])
        tgt = ""
        if label in TARGETS:
            ok = fz3_med / med <= TARGETS[label]
            tgt = f"≤ {TARGETS[label]} {'**met**' if ok else '**missed**'}"
        c = cpu(runs)
        rows.append(f"| {label} | {_ms(med)} | {_ms(min(ts))}–{_ms(max(ts))} | {rounds} | {med / fz3_med:.2f} | "
                    f"**{fz3_med / med:.2f}** | {fz3_min / min(ts):.2f} | "
                    f"{_ms(statistics.median(c)) if c else '–'} | {tgt} |")
    return rows


def memory_table(res: dict, model: str) -> list[str]:
    stats = res["stats"].get(model, {})
    if not stats:
        return []
    rows = ["| system | params MiB | grads MiB | optimizer MiB | **total MiB** | total ÷ fz3 | comm buffers allocated MiB | peak RSS rank 0 / 1 MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---|"]
    tot = lambda m: m["params"] + m["grads"] + m["optimizer"]  # noqa: E731
    ref = tot(stats["fz3"][0]["mem"]) if "fz3" in stats else None
    for label, out in stats.items():
        m = out[0]["mem"]
        rss = " / ".join(f"{o['peak_rss'] / MiB:.0f}" for o in out)
        rows.append(f"| {label} | {_mib(m['params'])} | {_mib(m['grads'])} | {_mib(m['optimizer'])} | "
                    f"**{_mib(tot(m))}** | {tot(m) / ref:.3f} | {_mib(m.get('comm_buffers'))} | {rss} |"
                    if ref else "")
    return rows


def comm_table(res: dict, model: str) -> list[str]:
    stats = res["stats"].get(model, {})
    if not stats:
        return []
    kinds = ["all_gather", "reduce_scatter", "all_reduce", "broadcast", "send"]
    rows = ["| system | " + " | ".join(f"{k} calls / MiB" for k in kinds) + " |",
            "|---|" + "---:|" * len(kinds)]
    for label, out in stats.items():
        c = out[0]["comm"]
        cells = [f"{c[k]['calls']:.0f} / {c[k]['bytes'] / MiB:.2f}" if k in c else "0" for k in kinds]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def loss_table(res: dict, model: str) -> list[str]:
    timed = res["timed"].get(model, {})
    if "single" not in timed:
        return []
    ref = timed["single"][0]["losses"]
    n = len(ref)
    rows = [f"| system | loss step 1 | loss step {n} | max over steps and rounds of \\|loss − single\\| |",
            "|---|---:|---:|---:|"]
    for label, runs in timed.items():
        dev = max(abs(a - b) for r in runs for a, b in zip(r["losses"], ref))
        rows.append(f"| {label} | {runs[0]['losses'][0]:.6f} | {runs[0]['losses'][-1]:.6f} | {dev:.2e} |")
    return rows


def theory_lines(res: dict, model: str) -> list[str]:
    th = res.get("theory", {}).get(model)
    if not th or "fz3_gathered_bytes" not in th:
        return []
    f = 0.5  # (N-1)/N with N = 2
    g, r = th["fz3_gathered_bytes"], th["fz3_reduced_bytes"]
    return [
        "| per step per rank, fz3 with max_reuse_distance=0, param_persistence_threshold=0 | fz3 measured | analytic ZeRO-3 | equal |",
        "|---|---:|---:|---|",
        f"| all-gather, buffer bytes (engine.stats gathered_bytes; W × shard) | {g:,.0f} | {th['gather_buffer_bytes']:,} "
        f"| {'yes' if th['gather_ok'] else '**no**'} |",
        f"| all-gather, bytes received per rank (× (N−1)/N) | {g * f:,.0f} | {th['gather_wire_bytes']:,.0f} | "
        f"{'yes' if th['gather_ok'] else '**no**'} |",
        f"| reduce-scatter, buffer bytes (reduced_bytes) | {r:,.0f} | {th['reduce_buffer_bytes']:,} | "
        f"{'yes' if th['reduce_ok'] else '**no**'} |",
        f"| reduce-scatter, bytes sent per rank (× (N−1)/N) | {r * f:,.0f} | {th['reduce_wire_bytes']:,.0f} | "
        f"{'yes' if th['reduce_ok'] else '**no**'} |",
        f"| cross-check: bytes counted at torch.distributed (gather / reduce) | {th.get('counted_gather_bytes') or 0:,.0f} / "
        f"{th.get('counted_reduce_bytes') or 0:,.0f} | | |",
        "",
        f"Analytic: padded numel Σ⌈n/N⌉N = {th['padded_param_numel']:,} ({th['numel']:,} unpadded); gathers = "
        f"Σ over fetch units (module, own params) of padded numel in forward, {th['padded_unit_numel']:,}, plus "
        f"the same in backward less the embeddings, {th['padded_backward_unit_numel']:,}, × 4 B: the tied "
        f"wte/lm_head weight is its own fetch unit in both `wte` and `lm_head`, gathered by both in forward and, "
        f"with reuse distance 0, by `lm_head` again in backward; the embeddings' backward reads no param, so "
        f"fz3 does not gather them for it (DeepSpeed and FSDP2 do). Counting each parameter exactly twice instead "
        f"gives {th['gather_wire_bytes_untied']:,.0f} B received per rank. fz3 issued "
        f"{th['fz3_all_gather_calls']:.0f} all-gathers and {th['fz3_reduce_calls']:.0f} reduce(s) per step.",
    ]


def breakdown_lines(res: dict, model: str) -> list[str]:
    bd = res.get("breakdown", {}).get(model, {}).get("fz3")
    if not bd:
        return []
    cats = sorted(bd[0]["per_step"], key=lambda k: -bd[0]["per_step"][k])
    step = [statistics.fmean(o["step_times"]) for o in bd]
    floor = [statistics.median(o["floor_times"]) for o in bd]
    rows = ["| category (exclusive time) | rank 0 ms/step | rank 1 ms/step | rank 0 share | calls/step |",
            "|---|---:|---:|---:|---:|"]
    for k in cats:
        rows.append(f"| {k} | {1e3 * bd[0]['per_step'][k]:.1f} | {1e3 * bd[1]['per_step'].get(k, 0):.1f} | "
                    f"{bd[0]['per_step'][k] / step[0]:.0%} | {bd[0]['calls_per_step'].get(k, 0):.0f} |")
    rows.append(f"| **step (mean)** | **{1e3 * step[0]:.1f}** | **{1e3 * step[1]:.1f}** | | |")
    rows.append(f"| plain model, local batch, no comm (median; same ranks, just before) | {1e3 * floor[0]:.1f} | "
                f"{1e3 * floor[1]:.1f} | | |")
    top = [t for t in bd[0]["cprofile_top"]][:12]
    rows += ["", "cProfile, rank 0, timers off (tottime per step; cProfile inflates Python-heavy frames):", "",
             "| function | calls/step | tottime ms/step | cumtime ms/step |", "|---|---:|---:|---:|"]
    rows += [f"| `{t['func']}` | {t['calls_per_step']:.0f} | {t['tottime_ms_per_step']:.1f} | "
             f"{t['cumtime_ms_per_step']:.1f} |" for t in top]
    return rows


def render(res: dict) -> str:
    m, v = res["machine"], res["versions"]
    loads = res.get("loads") or [0]
    out = [BEGIN, "## fz3 vs single process, DDP, FSDP2, DeepSpeed ZeRO-3 (issue #5)", "",
           f"Command: `{res['command'].strip()}` (bench/.env, made by `bench/setup_env.sh`). "
           f"Started {res['started']}, finished {res['finished']} ({res['total_s'] / 60:.1f} min).",
           f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, {m['platform']}. "
           f"Python {v['python']}, torch {v['torch']}, deepspeed {v.get('deepspeed')}, fz3 at {v.get('fz3_git')}"
           f"{' + uncommitted changes in fz3/' if v.get('fz3_dirty') else ''}.",
           f"Load average (1 min): {res['load_start'][0]:.2f} at start, {res['load_end'][0]:.2f} at end, "
           f"{min(loads):.2f}–{max(loads):.2f} (median {statistics.median(loads):.2f}) after the timed launches: "
           "the machine was shared, so absolute times are noisy; ratios come from interleaved launches.",
           "",
           "Setup: 2 gloo ranks on 127.0.0.1, 1 intra-op thread each (single: 1 rank, whole batch); fp32; "
           "torch AdamW(lr 1e-3, wd 0.01) for all; "
           + (f"steps interleaved: every system keeps its own ranks alive and they take turns, one step each, "
              f"rotating the order ({res['settings']['warmup']} warm-up steps discarded, then "
              f"{res['settings']['steps']} measured per system); " if res['settings'].get('interleave') == 'steps' else
              f"{res['settings']['rounds']} interleaved rounds of launches × ({res['settings']['warmup']} warm-up "
              f"discarded + {res['settings']['steps']} measured steps); ")
           + "step time = the slower rank's forward + backward + optimizer step; CPU = process CPU time of a rank "
           "(all its threads, mean of ranks). DeepSpeed stage-3 "
           f"settings: `{json.dumps(res['deepspeed_zero'])}` (its defaults, written out); "
           + ("fz3's `Config.from_deepspeed` of that dict equals `fz3.Config()`, so \"fz3 with the same settings\" "
              "is the `fz3` row. " if res.get("fz3_ds_equals_default") else "`fz3-ds` = Config.from_deepspeed of it. ")
           + "`fz3-vol`: `Config(max_reuse_distance=0, param_persistence_threshold=0)` with gloo's own "
           "collectives (pure ZeRO-3 volume). `fz3-native`: fz3's defaults with gloo's own allgather "
           "and reduce_scatter (`gloo_all_gather=\"native\", gloo_reduce_scatter=\"native\"`) instead of "
           "fz3's point-to-point ones (fz3/interpreters/p2p.py), to show what those buy. "
           "FSDP2: fully_shard per block then root, CPU mesh, `set_force_sum_reduction_for_comms(True)` "
           "(SUM, FSDP divides after). DeepSpeed: model built outside zero.Init, its shm op build skipped "
           "(see bench/systems/deepspeed_z3.py).", ""]
    from systems.common import MODELS
    for model in res["timed"]:
        cfg, gb = MODELS[model]
        th = res.get("theory", {}).get(model, {})
        out += [f"### {model}: GPT(vocab {cfg.vocab}, d_model {cfg.d_model}, heads {cfg.n_head}, layers {cfg.n_layer}, "
                f"seq {cfg.seq}), tied embedding, global batch {gb}, {th.get('numel', 0):,} parameters", "",
                "Step time:", ""] + step_table(res, model)
        out += ["", "Parameter + gradient + optimizer bytes per rank after a step (distinct storages, rank 0; "
                "params include full params kept resident, e.g. persistent ones; comm buffers = IPG/bucket "
                f"buffers, allocated size, not in the total); peak RSS with MALLOC_MMAP_THRESHOLD_=131072, "
                f"{res['settings']['stats_steps']} steps:", ""] + memory_table(res, model)
        out += ["", "Collectives per step per rank (calls / buffer MiB: all-gather output, reduce-scatter input, "
                "all-reduce tensor; send: point-to-point sends, bytes sent, fz3's gloo all-gather and reduce-scatter; "
                "DDP counted through its Python allreduce_hook in the stats launch):", ""] \
            + comm_table(res, model)
        out += ["", "Loss (mean over ranks) against single process, same data and seed:", ""] + loss_table(res, model)
        tl = theory_lines(res, model)
        if tl:
            out += ["", "Communication against theory (stats launch of fz3-vol):", ""] + tl
        bl = breakdown_lines(res, model)
        if bl:
            out += ["", "fz3 (defaults) per-step breakdown, `bench/breakdown.py` (instrumenting timers):", ""] + bl
        out.append("")
    co = res.get("core_overhead")
    if co and co.get("stdout"):
        out += ["### Core overhead (issue #2), inside this run", "",
                f"`{co['command']}` ({co['seconds']:.0f} s, load {co['load']:.2f}):", "", "```",
                co["stdout"].rstrip(), "```", ""]
    cc = res.get("copy_costs") or {}
    if cc:
        out += ["### fz3 data-plane copies, one rank, no communication (diagnosis)", ""]
        for model, c in cc.items():
            out += [f"`{c['command']}` (load {c['load']:.2f}):", "", "```", c["stdout"].rstrip(), "```", ""]
    out.append(END)
    return "\n".join(out)


def summary(res: dict) -> str:
    """The top of RESULTS.md: when, at which commit, the command, and one table (at most 60 lines)."""
    v, m = res["versions"], res["machine"]
    rows = ["| model | system | step ms (median) | **fz3 ÷ system** | model states MiB a rank | peak RSS MiB rank 0 / 1 |",
            "|---|---|---:|---:|---:|---|"]
    for model, timed in res["timed"].items():
        if "fz3" not in timed:
            continue
        fz3_med = statistics.median(_times(timed["fz3"]))
        stats = res["stats"].get(model, {})
        for label, runs in timed.items():
            med = statistics.median(_times(runs))
            out = stats.get(label)
            mem = out[0]["mem"] if out else None
            states = _mib(mem["params"] + mem["grads"] + mem["optimizer"]) if mem else "–"
            rss = " / ".join(f"{o['peak_rss'] / MiB:.0f}" for o in out) if out else "–"
            rows.append(f"| {model} | {label} | {_ms(med)} | **{fz3_med / med:.2f}** | {states} | {rss} |")
    lines = [SUMMARY_BEGIN, "## Now", "",
             f"{res['finished'][:10]}, fz3 at {v.get('fz3_git')}{' + uncommitted changes' if v.get('fz3_dirty') else ''}: "
             f"`{res['command'].strip()}` ({res['total_s'] / 60:.0f} min; {m['cpu']}, {m['cores']} cores; "
             f"torch {v['torch']}, deepspeed {v.get('deepspeed')}). 2 gloo ranks x 1 thread, fp32, AdamW, steps "
             "interleaved; model states = params + grads + optimizer state after a step; peak RSS with "
             "MALLOC_MMAP_THRESHOLD_=131072. fz3 runs with its defaults; the full tables are below "
             "(\"fz3 vs single process, ...\").", ""] + rows + ["", SUMMARY_END]
    assert len(lines) <= 60, f"the summary has {len(lines)} lines; RESULTS.md opens with at most 60"
    return "\n".join(lines)


def write(res: dict, path: str) -> None:
    from bench_env import replace_section
    replace_section(path, render(res), BEGIN, END)
    replace_section(path, summary(res), SUMMARY_BEGIN, SUMMARY_END)


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    p = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "results.json")
    write(json.load(open(p)), os.path.join(here, "RESULTS.md"))
