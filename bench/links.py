"""Bytes and messages on each link per rank per step: flat ZeRO-3, hybrid sharding and hpZ (issue #49
point 4).

    python bench/links.py [--md bench/RESULTS.md]

Planned: a 7 B Llama (transformers' LlamaForCausalLM, built on the meta device: 6.74 B params),
bf16, DeepSpeed's defaults, at W = 64 as 8 nodes of 8 ranks, one micro-batch a step: fz3.plan of
flat ZeRO-3 (ranks_per_node=8), of Config(shard_group_size=8) and of flat ZeRO-3 with hpZ's
secondary shards in groups of 8 (zero_hpz_partition_size=8), with what hpZ's shards cost in
memory. Measured: the GPT of examples/gpt.py on 4 gloo ranks, flat over 2 "nodes" of 2
(LOCAL_WORLD_SIZE=2), as 2 groups of 2, and flat with hpZ groups of 2 (small budgets: SMALL),
engine.stats() after 3 steps against fz3.plan of the same. The bytes and messages are what a rank sends ([Note: bytes
on each link], fz3/interpreters/accounting.py): the planner and the interpreter count them by
one function, so measured equals planned wherever the run's effects are the plan's.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)

KEYS = ("bytes_intra_group", "bytes_inter_group", "messages_intra_group", "messages_inter_group", "gathered_bytes",
        "reduced_bytes", "across_bytes", "all_gather_hpz")
LAYOUTS = (("flat ZeRO-3", dict(), 8), ("hybrid 8 x 8", dict(shard_group_size=8), None),
           ("hpZ, groups of 8", dict(zero_hpz_partition_size=8), 8))
# the measured runs: DeepSpeed's defaults would keep every param of this small GPT whole (each is below
# param_persistence_threshold, 1e5) and the whole model live (max_live_parameters, 1e9), so nothing would be
# gathered per step; these gather every matrix, and the forward frees what the backward gathers again
SMALL = dict(param_persistence_threshold=64, max_live_parameters=50_000)
MEASURED = (("flat, 2 nodes of 2", dict(SMALL), 2),
            ("hybrid 2 x 2", dict(SMALL, shard_group_size=2), None),
            ("hpZ groups of 2, 2 nodes of 2", dict(SMALL, zero_hpz_partition_size=2), 2))
GPT = dict(vocab=256, d_model=64, n_head=4, n_layer=2, seq=32)
STEPS, BATCH = 3, 8


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def llama_plans() -> dict[str, dict]:
    import torch
    import fz3
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(1, 128, dtype=torch.long, device="meta")
    out = {"params": sum(p.numel() for p in model.parameters())}
    for name, fields, node in LAYOUTS:
        p = fz3.plan(model, fz3.Config(compute_dtype="bf16", **fields), world_size=64, example_inputs=(ids,),
                     backend="nccl", ranks_per_node=node)
        out[name] = {**{k: p.stats[k] for k in KEYS}, "secondary": max(s["peak_secondary_bytes"] for s in p.steps),
                     "peak": max(s["model_state_peak_bytes"] for s in p.steps)}
    return out


def _rank(rank: int, world: int, fields: dict) -> dict:
    import torch
    import fz3
    from gpt import GPT as Model, GPTConfig, loss_fn, markov_batch
    torch.manual_seed(0)
    model = Model(GPTConfig(**GPT))
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), fz3.Config(**fields))
    per = BATCH // world
    for i in range(STEPS):
        x, y = markov_batch(i, batch=BATCH, seq=GPT["seq"], vocab=GPT["vocab"])
        engine.backward(loss_fn(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]))
        engine.step()
    return {k: engine.stats()[k] for k in KEYS}


def gpt_measured() -> dict[str, tuple[dict, dict]]:
    import torch
    import fz3
    from fz3 import launch
    from gpt import GPT as Model, GPTConfig, markov_batch
    out = {}
    for name, fields, node in MEASURED:
        if node:
            os.environ["LOCAL_WORLD_SIZE"] = str(node)
        try:
            got = launch.run(_rank, world_size=4, args=(fields,), timeout=300)
        finally:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        x, _ = markov_batch(0, batch=BATCH, seq=GPT["seq"], vocab=GPT["vocab"])
        torch.manual_seed(0)
        planned = fz3.plan(Model(GPTConfig(**GPT)), fz3.Config(**fields), world_size=4,
                           example_inputs=(x[:BATCH // 4],), steps=STEPS, backend="gloo", ranks_per_node=node).stats
        assert all(g == got[0] for g in got), got  # every rank alike
        out[name] = (got[0], {k: planned[k] for k in KEYS})
    return out


def main() -> None:
    from bench_env import ensure_env, write_section, commit as bench_commit
    ensure_env(__file__)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--md", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args()
    t0 = time.time()
    plans, measured = llama_plans(), gpt_measured()
    commit = bench_commit()
    lines = [f"Command: `python bench/links.py` ({datetime.date.today()}, fz3 at {commit}, "
             f"{platform.processor() or 'x86_64'}, "
             f"{time.time() - t0:.0f} s). Bytes a rank sends per step on each link ([Note: bytes on each link], "
             "fz3/interpreters/accounting.py): within its group (a node; for flat ZeRO-3 the launcher's node) and "
             "across groups.", "",
             f"Planned, 7 B Llama ({plans['params'] / 1e9:.2f} B params), bf16, DeepSpeed's defaults, W = 64 as 8 x 8, "
             "one micro-batch a step (GiB per rank per step):", "",
             "| layout | intra-group | **inter-group** | messages intra / inter | gathered | reduced | "
             "all-reduced across | hpZ shards (peak) | model states (peak) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, _, _ in LAYOUTS:
        s = plans[name]
        lines.append(f"| {name} | {gib(s['bytes_intra_group'])} | **{gib(s['bytes_inter_group'])}** | "
                     f"{s['messages_intra_group']:,} / {s['messages_inter_group']:,} | "
                     f"{gib(s['gathered_bytes'])} | {gib(s['reduced_bytes'])} | {gib(s['across_bytes'])} | "
                     f"{gib(s['secondary'])} | {gib(s['peak'])} |")
    flat, hybrid, hpz = (plans[n]["bytes_inter_group"] for n, _, _ in LAYOUTS)
    lines += ["", f"Hybrid sharding sends {flat / hybrid:.1f}x fewer bytes across nodes than flat ZeRO-3 "
              f"(no gather leaves the node; each grad element crosses once per reduce); hpZ {flat / hpz:.1f}x fewer "
              "(the backward's gathers stay on the node, the forward's and the reduces cross as in flat ZeRO-3), "
              "for the secondary shards' memory beside the model states.", "",
              f"Measured: examples/gpt.py GPT({', '.join(f'{k}={v}' for k, v in GPT.items())}), fp32, 4 gloo ranks, "
              f"{STEPS} steps, DeepSpeed's defaults but {', '.join(f'{k}={v:,}' for k, v in SMALL.items())} "
              "(every matrix gathered, and the forward frees what the backward gathers again); engine.stats() "
              "(every rank alike, totals over the steps) against fz3.plan:", "",
              "| layout | intra-group bytes measured / planned | inter-group bytes measured / planned | "
              "messages intra / inter, measured | gathers of hpZ shards | every key matches |",
              "|---|---:|---:|---:|---:|---|"]
    for name, (got, want) in measured.items():
        lines.append(f"| {name} | {got['bytes_intra_group']:,} / {want['bytes_intra_group']:,} | "
                     f"{got['bytes_inter_group']:,} / {want['bytes_inter_group']:,} | "
                     f"{got['messages_intra_group']:,} / {got['messages_inter_group']:,} | {got['all_gather_hpz']} | "
                     f"{'yes' if got == want else 'NO'} |")
    write_section(args.md, "links", "Bytes on each link: flat ZeRO-3, hybrid sharding and hpZ (issue #49)",
                  "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
