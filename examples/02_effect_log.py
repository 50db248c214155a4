"""Step 2: what the pure core decides for a small GPT, printed as an effect log.

No tensors and no processes: fz3.core alone takes the events a 2-layer GPT's hooks would send
(fz3/core/events.py: Enter, Leave, PreBackwardRan, GradReady, ...; tied token embedding /
lm_head) through three training steps on 2 ranks, and prints the parameter effects it asks the
data plane to run. The root's Enter at the start of each pass moves the trace
(fz3/core/param/trace.py): pass 0 runs in RECORD, so every gather is on demand and the module
order is logged; pass 1's Enter freezes that log into a plan (COMPLETE), and passes 1 and 2
prefetch from it. Watch the tied weight, wte.weight: pass 0 gathers it four times (the
embedding and the lm_head, in forward and in backward); from pass 1 on it is gathered once a
pass and kept from the embedding to the embedding's backward, because the modules between two
of its uses hold at most 67,712 elements, fewer than max_reuse_distance
(fz3/core/param/release.py). One backward gather is on demand: prefetching it would pass
max_live_parameters. (The events here carry no log of what autograd saved, so the embedding's
backward fetches its weight; the real engine sees that the embedding saves none and frees the
tied weight right after the lm_head's backward: [Note: backward reads no param],
fz3/core/calls.py.)

    python examples/02_effect_log.py
"""
from fz3 import Config
from fz3.core.calls import Lifecycle, initial_calls
from fz3.core.effects import AllGather, Free, Wait
from fz3.core.events import (BackwardEnded, Enter, GradReady, Leave, PostBackwardRan, PreBackwardRan, StepCalled,
                             Stepped, update)
from fz3.core.grad.grads import init_grad_state
from fz3.core.param.invariants import check_fetched, check_quiescent, check_state
from fz3.core.spec import build_spec
from fz3.core.param.state import initial_state
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

# between wte and lm_head in forward lie wpe (2,048) and two blocks (32,832 each): 67,712 elements
config = Config(prefetch_bucket_size=20_000, max_live_parameters=60_000,
                max_reuse_distance=70_000, param_persistence_threshold=D)
spec = build_spec(params, modules, world_size=2, persistence_threshold=config.param_persistence_threshold)
order = list(range(1, len(modules)))  # every module once, in registration order
trainable = (True,) * len(params)
st = Lifecycle(initial_state(spec), init_grad_state(spec), initial_calls(spec, trainable))


def send(rec, event):
    """One event through the core; the parameter effects it returns into the log. (The hook
    effects, WrapInputs and the like, and the gradient effects are the shell's and the grad
    interpreter's: examples/03_grad_buckets.py prints those.)"""
    global st
    st, effects = update(st, event, config=config)
    rec.run(e for e in effects if isinstance(e, (AllGather, Wait, Free)))
    check_state(st.params)


WHAT = {"RECORD": "every gather on demand; the module order is logged",
        "COMPLETE": "the plan of the recorded order drives prefetch and reuse-keeping"}


def wrapped(m):
    """The engine gives a call autograd nodes unless the core says it is inert (its own params
    all persistent: the layer norms here)."""
    return not st.calls.tables.inert[m]


for pass_no in range(3):
    rec = Recorder(spec)
    send(rec, Enter(0, grad=True, grad_inputs=False))  # the root's Enter: reset_step moves the trace
    print(f"\n== pass {pass_no}: trace {st.params.trace.mode.name}: {WHAT[st.params.trace.mode.name]}")
    for m in order:  # the token and position embeddings take ids: no grad inputs
        send(rec, Enter(m, grad=True, grad_inputs=m > 2))
        check_fetched(st.params, m)
        send(rec, Leave(m, grad_outputs=True))
    send(rec, Leave(0, grad_outputs=True))
    for m in reversed(order):  # autograd: each call's backward, the last call first
        if wrapped(m):
            send(rec, PreBackwardRan(m))
            check_fetched(st.params, m)
        for p in spec.modules[m].params:
            if p != 0 or m == 1:  # the tied weight's grad is whole after the embedding's backward
                send(rec, GradReady(p, "float32"))
        if wrapped(m) and m > 2:
            send(rec, PostBackwardRan(m))
    send(rec, BackwardEnded())
    check_quiescent(st.params)
    print(rec.format())
    print(f"-- {rec.counts['AllGather']} gathers ({rec.counts['prefetch']} prefetched), "
          f"{rec.counts['gathered_numel']} elements gathered, peak live {st.params.peak_live_numel} "
          f"(max_live_parameters {config.max_live_parameters})")
    tied = sum(1 for e in rec.log if isinstance(e, AllGather) and 0 in e.params)
    print(f"-- wte.weight (tied to lm_head) gathered {tied} time(s) in this pass")
    send(rec, StepCalled())  # engine.step(): the window closes (gradient_accumulation_steps 1)
    send(rec, Stepped())
print("\nafter the optimizer step only persistent params are live:",
      [spec.params[p].name for p, s in enumerate(st.params.params) if s.status.name != "NOT_AVAILABLE"])
