"""Step 2: what the pure core decides for a small GPT, printed as an effect log.

No tensors and no processes: fz3.core alone drives the parameter lifecycle of a 2-layer GPT
(tied token embedding / lm_head) through three forward+backward passes on 2 ranks, and prints
the effects it asks the data plane to run. Pass 0 records the module order (trace RECORD),
pass 1 prefetches from it (COMPLETE). Watch the tied embedding: gathered once for the embedding,
kept for the lm_head when it is reused within max_reuse_distance.

    python examples/02_effect_log.py
"""
from fz3 import Config
from fz3.core.backward import post_backward, pre_backward
from fz3.core.fetch import fetch
from fz3.core.invariants import check_fetched, check_quiescent, check_state
from fz3.core.release import release
from fz3.core.spec import build_spec
from fz3.core.state import initial_state
from fz3.core.step import end_of_step, finish_backward, reset_step
from fz3.interpreters.recorder import Recorder

D, V, T = 64, 512, 32  # width, vocab, context
params = [("wte.weight", V * D), ("wpe.weight", T * D)]
modules = [("", [], False), ("wte", [0], False), ("wpe", [1], False)]
for i in range(2):
    base = len(params)
    params += [(f"h.{i}.ln.weight", D), (f"h.{i}.attn.weight", 3 * D * D),
               (f"h.{i}.proj.weight", D * D), (f"h.{i}.mlp.weight", 4 * D * D)]
    modules += [(f"h.{i}.ln", [base], False), (f"h.{i}.attn", [base + 1], False),
                (f"h.{i}.proj", [base + 2], False), (f"h.{i}.mlp", [base + 3], False)]
modules.append(("lm_head", [0], False))  # tied to wte

config = Config(prefetch_bucket_size=20_000, max_live_parameters=60_000,
                max_reuse_distance=40_000, param_persistence_threshold=D)
spec = build_spec(params, modules, world_size=2, persistence_threshold=config.param_persistence_threshold)
order = list(range(1, len(modules)))  # every module once, in registration order
st = initial_state(spec)


def step(rec, result):
    global st
    st, effects = result
    rec.run(effects)
    check_state(st)


for pass_no in range(3):
    rec = Recorder(spec)
    step(rec, reset_step(st, config=config))
    print(f"\n== pass {pass_no}: trace {st.trace.mode.name}")
    step(rec, fetch(st, 0, forward=True, config=config))
    for m in order:
        step(rec, fetch(st, m, forward=True, config=config, grad_inputs=int(m > 2)))
        check_fetched(st, m)
        step(rec, release(st, m, config=config, grad_outputs=True))
    step(rec, release(st, 0, config=config))
    for m in reversed(order):
        step(rec, pre_backward(st, m, config=config))
        check_fetched(st, m)
        step(rec, post_backward(st, m, config=config))
    step(rec, finish_backward(st, config=config))
    check_quiescent(st)
    print(rec.format())
    print(f"-- {rec.counts['AllGather']} gathers ({rec.counts['prefetch']} prefetched), "
          f"{rec.counts['gathered_numel']} elements gathered, peak live {st.peak_live_numel} "
          f"(max_live_parameters {config.max_live_parameters})")
st, _ = end_of_step(st, config=config)
print("\nafter the optimizer step only persistent params are live:",
      [spec.params[p].name for p, s in enumerate(st.params) if s.status.name != "NOT_AVAILABLE"])
