"""Generation under ZeRO-3 (issue #50 point 3): collectives per generated token, tokens per second
and peak memory per rank, for fz3's engine.generation() against DeepSpeed ZeRO-3's
model.generate and the unsharded model.

    python bench/generation.py [--tokens 32] [--md bench/RESULTS.md]

A tiny Llama (transformers' LlamaForCausalLM: hidden 128, 4 layers, vocab 512; fp32) on 2 gloo
ranks, each rank greedy-decoding its own 16-token prompt for --tokens new tokens with
`model.generate(do_sample=False)`, one process per system (peak RSS is the process's):

    unsharded            the plain model on each rank (no collective)
    fz3, no block        engine.module.generate under fz3 as in training: every forward gathers
    fz3 generation()     `with engine.generation():` the whole model kept (fz3/shell/generation.py)
    fz3 generation(1/2)  a budget of half the model's bytes: the core keeps what fits
    DeepSpeed ZeRO-3     deepspeed.initialize (stage 3, DeepSpeed's defaults but every param
                         partitioned) and engine.module.generate: TRL's generation with
                         gather_deepspeed3_params=False

Collectives: torch.distributed's calls, counted in each rank (bench/systems/comm_count.py; fz3's
point-to-point sends count as sends), over the generate call, divided by the tokens generated.
The tokens of every system are compared with the unsharded model's (greedy: identical).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SYSTEMS = ("unsharded", "fz3, no block", "fz3 generation()", "fz3 generation(1/2)", "DeepSpeed ZeRO-3")
LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=256)


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()


def _rank(rank: int, world: int, system: str, tokens: int) -> dict:
    import torch
    from systems import comm_count
    counter = comm_count.install(rings=system.startswith("fz3"))
    model = _model()
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(rank))
    block, info = None, {}
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # before sharding empties them
    if system.startswith("fz3"):
        import fz3
        engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                fz3.Config(param_persistence_threshold=0))
        engine.eval()
        generate = engine.module.generate
        if "generation" in system:
            block = engine.generation(budget_bytes=None if system.endswith("()") else whole // 2)
    elif system == "DeepSpeed ZeRO-3":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import importlib
        import logging
        import deepspeed
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no JIT build
        from deepspeed.utils import logger
        logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config={
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9})
        engine.eval()
        generate = engine.module.generate
    else:
        generate = model.generate
    with torch.no_grad():
        generate(ids, max_new_tokens=2, do_sample=False)  # warm: the trace recorded, the caches made
        if block is not None:
            info = block.__enter__()
        counter.reset()
        t0 = time.perf_counter()
        out = generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
        seconds = time.perf_counter() - t0
        calls = counter.snapshot()
        if block is not None:
            block.__exit__(None, None, None)
    return {"tokens": out, "seconds": seconds, "calls": calls, "info": info,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    from bench_env import ensure_env, write_section, commit as bench_commit
    ensure_env(__file__)
    import torch
    from fz3 import launch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--md", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args()
    t_start = time.time()
    rows = {}
    for system in SYSTEMS:
        rows[system] = launch.run(_rank, world_size=2, args=(system, args.tokens), timeout=600)
    ref = rows["unsharded"]
    params = sum(p.numel() for p in _model().parameters())
    commit = bench_commit()
    lines = [f"Command: `python bench/generation.py --tokens {args.tokens}` ({datetime.date.today()}, fz3 at {commit}, "
             f"{platform.processor() or 'x86_64'}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{time.time() - t_start:.0f} s). A tiny Llama ({params:,} params, fp32) on 2 gloo ranks, greedy, "
             f"{args.tokens} new tokens from 16 per rank, per rank over the generate call: the collective calls "
             "(DeepSpeed: torch.distributed's all-gathers, bytes = their output) or point-to-point sends (fz3 on "
             "gloo gathers by sends, bytes = what it sends: half of a 2-rank all-gather's output) per token, "
             "tokens/s, peak RSS:", "",
             "| system | collective calls or sends per token | bytes per token | tokens/s | peak RSS per rank | "
             "kept whole | tokens = unsharded |", "|---|---:|---:|---:|---:|---:|---|"]
    for system in SYSTEMS:
        got = rows[system]
        calls = sum(v["calls"] for v in got[0]["calls"].values())
        nbytes = sum(v["bytes"] for v in got[0]["calls"].values())
        tps = args.tokens / max(g["seconds"] for g in got)
        rss = max(g["rss"] for g in got) / 2**20
        same = all(torch.equal(g["tokens"], r["tokens"]) for g, r in zip(got, ref))
        kept = got[0]["info"].get("kept_bytes")
        lines.append(f"| {system} | {calls / args.tokens:.1f} | {nbytes / args.tokens:,.0f} | {tps:.1f} | "
                     f"{rss:.0f} MiB | "
                     f"{'' if kept is None else f'{kept / 2**20:.2f} MiB'} | {'yes' if same else 'NO'} |")
    write_section(args.md, "generation", "Generation under ZeRO-3 (issue #50)", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
