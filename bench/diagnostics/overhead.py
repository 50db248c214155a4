"""The deep narrow GPT of issue #27: fz3 against DDP, FSDP2 and DeepSpeed ZeRO-3 where a step is
almost all framework (vocab 128, d 32, 16 layers, seq 8, global batch 2: ~0.2 M params, ~130
modules), with memory and fz3's breakdown. One command:

    python3 bench/diagnostics/overhead.py     # sets up bench/.env if missing; writes its section
                                              # of bench/RESULTS.md and bench/out/overhead.json
    python3 bench/diagnostics/overhead.py --steps 40 --systems ddp,fz3    # a quick A/B

It is bench/compare.py (the same systems, settings, stats launches and report) on the "deep"
model: steps interleaved over persistent ranks (each system one step in turn), a stats launch per
system for memory and peak RSS, and fz3's per-step breakdown (bench/breakdown.py). Targets
(issue #27): fz3 <= 1.5x DDP and <= 0.5x FSDP2, <= 0.75x DeepSpeed; peak RSS per rank not above
what it was before.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
sys.path[:0] = [HERE, BENCH]
BEGIN, END = "<!-- overhead:begin -->", "<!-- overhead:end -->"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="ddp,fsdp2,deepspeed,fz3")
    ap.add_argument("--steps", type=int, default=40, help="measured steps per system (default 40)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--md", default=os.path.join(BENCH, "RESULTS.md"))
    args = ap.parse_args()
    import compare
    import report
    from bench_env import replace_section
    with tempfile.TemporaryDirectory() as tmp:
        md = os.path.join(tmp, "section.md")
        sys.argv = [os.path.join(BENCH, "compare.py"), "--models", "deep", "--systems", args.systems,
                    "--steps", str(args.steps), "--warmup", str(args.warmup), "--skip", "core,copies",
                    "--out", os.path.join(BENCH, "out", "overhead.json"), "--md", md]
        compare.main()
        text = open(md).read()
    body = text[text.index(report.BEGIN) + len(report.BEGIN):text.index(report.END)]
    body = body.replace("## fz3 vs single process, DDP, FSDP2, DeepSpeed ZeRO-3 (issue #5)",
                        "## The deep narrow GPT: fz3 against DDP, FSDP2, DeepSpeed (issue #27, bench/diagnostics/overhead.py)", 1)
    body = body.replace("python3 bench/compare.py --models deep", "python3 bench/diagnostics/overhead.py (compare.py --models deep", 1)
    replace_section(args.md, BEGIN + body + END, BEGIN, END)
    print(f"bench/diagnostics/overhead.py: wrote its section of {args.md}")
    return 0


if __name__ == "__main__":
    from bench_env import ensure_env
    ensure_env(__file__)
    sys.exit(main())
