"""fz3 beside DeepSpeed 0.19.8 on examples/deepspeed_stages.py: the tables bench/RESULTS.md keeps.

    python bench/deepspeed_records/deepspeed_stage_tables.py [--out fz3.json]    # ~4 min on 2 cores

Runs the script under fz3 (its import line swapped, as tests/test_deepspeed_stages.py does) on 2
gloo ranks, and prints, beside DeepSpeed's record (tests/data/deepspeed_stages_0.19.8.json,
bench/deepspeed_records/deepspeed_stages.sh): the loss and loss-scale sequence of each fp16 case at
stage 3 (a dynamic scale whose first steps overflow, a static one, hysteresis), the largest loss
difference at every stage in fp32, bf16 and fp16, and which plain-PyTorch outcome two backwards
before one step() give. The CI test holds the same numbers to their tolerances; this prints them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from fz3.launch import free_port  # noqa: E402

SCRIPT = os.path.join(ROOT, "examples", "deepspeed_stages.py")
RECORD = os.path.join(ROOT, "tests", "data", "deepspeed_stages_0.19.8.json")
SCALED = ("fp16_dynamic_overflow_stage3", "fp16_static_stage3", "fp16_hysteresis_stage3")
SCALE = "optimizer.cur_scale"  # read after each micro-step, where DeepSpeed's scripts read it


def run_fz3(cases: list[str], out: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        text = open(SCRIPT).read().replace("\nimport deepspeed\n", "\nimport fz3.deepspeed as deepspeed\n")
        script = os.path.join(tmp, "fz3_stages.py")
        with open(script, "w") as f:
            f.write(text)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FZ3_DEVICE": "cpu", "PYTHONPATH": ROOT}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), script, "--out", out, "--two-backwards"]
                       + [a for c in cases for a in ("--case", c)], env=env, cwd=tmp, check=True, timeout=1200,
                       stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def scale_table(name: str, ds: dict, fz: dict) -> str:
    lines = [f"**{name}** (`{json.dumps(ds['config']['fp16'])}`)", "",
             "| micro-step | loss DeepSpeed | loss fz3 | rel. diff | scale DeepSpeed | scale fz3 | applied DS / fz3 "
             "| skipped DS / fz3 |", "|---:|---:|---:|---:|---:|---:|---|---|"]
    for a, b in zip(ds["rows"], fz["rows"]):
        diff = abs(b["loss"] - a["loss"]) / a["loss"]
        lines.append(f"| {a['micro_step']} | {a['loss']:.6f} | {b['loss']:.6f} | {diff:.1e} "
                     f"| {a['scale_after'][SCALE]:g} | {b['scale_after'][SCALE]:g} "
                     f"| {a['was_step_applied']} / {b['was_step_applied']} "
                     f"| {a['skipped_steps']} / {b['skipped_steps']} |")
    return "\n".join(lines)


def stage_table(record: dict, fz: dict) -> str:
    """At stage 0 in fp16 and bf16 against DeepSpeed's stage 1 (see main)."""
    lines = ["| case | max \\|loss fz3 - loss DS\\| / loss DS | max rel. diff of the final weights' norms "
             "| applied / skipped identical |", "|---|---:|---:|---|"]
    kinds = ("fp32_stage", "bf16_stage", "fp16_static_stage", "fp16_dynamic_overflow_stage")
    for name in sorted(n for n in fz if n.startswith(kinds)):
        ds, got = record[name.replace("stage0", "stage1") if name.startswith(("fp16", "bf16")) else name], fz[name]
        loss = max(abs(b["loss"] - a["loss"]) / abs(a["loss"]) for a, b in zip(ds["rows"], got["rows"]))
        final = got["params_final"]
        norms = max(abs(final[k][1] - v[1]) / abs(v[1]) for k, v in ds["params_final"].items() if v[1])
        same = all((a["was_step_applied"], a["skipped_steps"]) == (b["was_step_applied"], b["skipped_steps"])
                   for a, b in zip(ds["rows"], got["rows"]))
        lines.append(f"| {name} | {loss:.1e} | {norms:.1e} | {same} |")
    return "\n".join(lines)


def backwards_table(ds: dict, fz: dict) -> str:
    lines = ["| run | DeepSpeed 0.19.8 | fz3 |", "|---|---|---|"]
    def outcome(run: dict) -> str:
        return ", ".join(run["matches"]) if run.get("matches") else run.get("error", {}).get("type", "none")

    for name, a in ds["runs"].items():
        lines.append(f"| {name} | {outcome(a)} | {outcome(fz['runs'][name])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "fz3_deepspeed_stages.json"))
    args = ap.parse_args()
    record = json.load(open(RECORD))
    cases = sorted(n for n, c in record["cases"].items() if "error" not in c and "hysteresis0" not in n)
    fz = run_fz3(cases, args.out)
    for name in SCALED:
        print(scale_table(name, record["cases"][name], fz["cases"][name]), end="\n\n")
    print("**every stage** (DeepSpeed's stage-0 fp16/bf16 runs FP16_UnfusedOptimizer, which divides the grads by a "
          "scale it never applied: fz3's stage 0 is compared with DeepSpeed's stage 1 there, "
          "tests/test_deepspeed_stages.py REFERENCE)\n")
    print(stage_table(record["cases"], fz["cases"]), end="\n\n")
    print("**two backwards before one step()** (the plain-PyTorch outcomes the weights equal, max abs diff < 1e-5)\n")
    print(backwards_table(record["two_backwards"], fz["two_backwards"]))


if __name__ == "__main__":
    main()
