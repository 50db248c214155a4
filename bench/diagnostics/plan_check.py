"""fz3.plan beside real runs and beside DeepSpeed's estimator, on the benchmark GPTs.

    python3 bench/diagnostics/plan_check.py    # sets up bench/.env if missing; prints the tables
                                               # and writes its section of bench/RESULTS.md;
                                               # exit 1 on a mismatch
    python bench/diagnostics/plan_check.py --llama-7b [--steps K] [--seq T]
                                               # Llama-7B's shape planned at 64 ranks in this process
                                               # (needs transformers, not bench/.env): time and memory

--llama-7b: LlamaForCausalLM(hidden 4096, 32 layers, 32 heads, MLP 11008, vocab 32000: 6.74 B
params, 25 GiB in fp32) built on the meta device, its default attention, input_ids and labels of
one sequence of T tokens (512), planned for K steps (2) at world size 64: the wall and CPU time of
fz3.plan alone, and the process's peak RSS (ru_maxrss) before and after it.

1. For each case (model, world size, config): fz3.plan(model, cfg, world_size=W,
   example_inputs=(x,), steps=2) in this process, and the same 2 steps of fz3 on W real gloo
   ranks (bench/systems/common.py's model, batches and AdamW). Every engine.stats() key the plan
   reports must be equal on every rank.
2. The plan's per-rank figures beside DeepSpeed's `estimate_zero3_model_states_mem_needs`
   (deepspeed/runtime/zero/stage3.py, the function behind estimate_zero3_model_states_mem_needs_
   all_live; no offload, zero_init): per GPU 4 x the largest layer's params + 18 B x params / W.
   DeepSpeed's 18 B/param assume fp16 params and grads with fp32 master and Adam moments; fz3's
   model states are 4 (fp32 master) + 4 (fp32 grad partition) + 8 (AdamW) = 16 B/param / W in
   fp32, plus 2 for the bf16 compute shards in bf16, plus what the config lets be gathered at
   once (the plan's peak live params), which the estimator does not model.
"""
from __future__ import annotations

import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # bench/: the harness (bench_env, compare, systems) and RESULTS.md, out/
sys.path[:0] = [HERE, BENCH]
if __name__ == "__main__" and "--llama-7b" not in sys.argv:
    from bench_env import ensure_env
    ensure_env(__file__)

STEPS = 2
MEMORY = {"reduce_bucket_size": 50_000_000, "prefetch_bucket_size": 50_000_000,
          "max_live_parameters": 50_000_000, "max_reuse_distance": 50_000_000}  # bench/diagnostics/memory.py's
CASES = [("small", 2, {}), ("wide", 2, {}), ("small", 3, {"reduce_bucket_size": 1_000_000, "max_reuse_distance": 0}),
         ("wide", 2, {"compute_dtype": "bf16", "max_live_parameters": 10_000_000}), ("m100", 2, MEMORY)]
PLAN_ONLY = [("small", 64, {}), ("m300", 2, MEMORY), ("b1", 2, MEMORY), ("b1", 64, MEMORY),
             ("b1", 2, {})]  # the last: issue #27 point 5, the default Config


def real_run(rank: int, world: int, name: str, options: dict) -> dict:
    import fz3
    from systems.common import batches, fz3_settings, loss_fn, make_model, make_optimizer
    model = make_model(name)
    config, own = fz3_settings(options)
    engine = fz3.initialize(model, make_optimizer(model.parameters()), config, options=own)
    for x, y in batches(name, rank, world, STEPS):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return dict(engine.stats())


def plan_of(name: str, world: int, options: dict):
    import fz3
    from systems.common import batches, fz3_settings, make_model
    x, _ = batches(name, 0, world if world <= 4 else 1, 1)[0]
    config, own = fz3_settings(options)
    return fz3.plan(make_model(name), config, world_size=world, example_inputs=(x,),
                    steps=STEPS, optimizer="adamw", backend="gloo", options=own)


def deepspeed_estimate(name: str, world: int) -> int:
    """DeepSpeed's per-GPU bytes for ZeRO-3 without offload (its model_to_params on the same model)."""
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from systems.common import MODELS
    from gpt import GPT
    with torch.device("meta"):
        model = GPT(MODELS[name][0])
    total = sum({id(p): p.numel() for p in model.parameters()}.values())  # meta: no data_ptr to dedupe by
    _, largest = model_to_params(model)
    _, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=world, cpu_offload=False,
                                                      zero_init=True)
    return gpu


def main() -> int:
    import fz3.launch
    GiB = 2**30
    rows, bad = [], []
    for name, world, options in CASES:
        planned = plan_of(name, world, options)
        before = len(bad)
        for rank, real in enumerate(fz3.launch.run(real_run, world_size=world, args=(name, options),
                                                    timeout=900, threads=1)):
            diff = {k: (v, real[k]) for k, v in planned.stats.items() if real[k] != v}
            if diff:
                bad.append(f"{name} W={world} {options} rank {rank}: plan != real {diff}")
        verdict = "equal" if len(bad) == before else "MISMATCH"
        rows.append((name, world, options, planned, verdict, len(planned.stats)))
        print(f"{name} W={world} {options}: {len(planned.stats)} keys, {verdict}", flush=True)
    for name, world, options in PLAN_ONLY:
        rows.append((name, world, options, plan_of(name, world, options), "(plan only)", 0))
    lines = [f"`python3 bench/diagnostics/plan_check.py`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{STEPS} steps, AdamW fp32 masters, backend gloo.", "",
             "| model | W | config | params | vs a real run | all-gathers (steps 1, 2) | gathered MiB (1, 2) "
             "| reduced MiB / step | peak live params | model states at the peak, GiB/rank | DeepSpeed estimate, GiB/GPU |",
             "|---|---:|---|---:|---|---|---|---:|---:|---:|---:|"]
    for name, world, options, p, verdict, keys in rows:
        s1, s2 = p.steps
        cfg = ", ".join(f"{k}={v:,}" if isinstance(v, int) else f"{k}={v}" for k, v in options.items()) or "defaults"
        lines.append(f"| {name} | {world} | {cfg} | {p.params:,} | {verdict}{f' ({keys} keys)' if keys else ''} "
                     f"| {s1['all_gather']}, {s2['all_gather']} | {s1['gathered_bytes'] / 2**20:.1f}, "
                     f"{s2['gathered_bytes'] / 2**20:.1f} | {s2['reduced_bytes'] / 2**20:.1f} | "
                     f"{s2['peak_live_numel']:,} | {s2['model_state_peak_bytes'] / GiB:.3f} | "
                     f"{deepspeed_estimate(name, world) / GiB:.3f} |")
    text = "\n".join(lines)
    print(text)
    from bench_env import replace_section
    begin, end = "<!-- plan_check:begin -->", "<!-- plan_check:end -->"
    replace_section(os.path.join(BENCH, "RESULTS.md"), f"{begin}\n## fz3.plan against real runs and DeepSpeed's estimator\n\n{text}\n{end}", begin, end)
    for b in bad:
        print(b, file=sys.stderr)
    return 1 if bad else 0


def llama_7b(steps: int, seq: int) -> int:
    import resource
    import time
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import fz3
    cfg = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss: KiB)
    before, wall, cpu = rss(), time.perf_counter(), time.process_time()
    p = fz3.plan(model, fz3.Config(), world_size=64, example_inputs={"input_ids": ids, "labels": ids}, steps=steps,
                 backend="nccl")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(p)
    print(f"Llama-7B shape, {p.params:,} params ({cfg._attn_implementation}), world size 64, {steps} step(s), "
          f"{seq} tokens: fz3.plan {wall:.1f} s wall, {cpu:.1f} s CPU; peak RSS {before:.2f} GiB before, "
          f"{rss():.2f} GiB after; {len(p.guesses)} guesses")
    return 0


if __name__ == "__main__":
    if "--llama-7b" in sys.argv:
        import argparse
        ap = argparse.ArgumentParser()
        ap.add_argument("--llama-7b", action="store_true")
        ap.add_argument("--steps", type=int, default=2)
        ap.add_argument("--seq", type=int, default=512)
        args = ap.parse_args()
        sys.exit(llama_7b(args.steps, args.seq))
    sys.exit(main())
