"""fz3's log: `logging.getLogger("fz3")` (silent until the application configures logging).

    INFO     at fz3.initialize, rank 0: world size, device, backend and the carriers of the
             gathers and reduces (and whether their large messages go through shared memory:
             fz3/interpreters/shared_memory.py), params sharded and persistent, bytes per rank, whether the
             environment sets glibc's heap policy (fz3/data/heap.py), and the config's differences from
             DeepSpeed's defaults; and what offload does, if the config asks for it
    INFO     at fz3.initialize, rank 0, on an accelerator: when each step's skip of a non-finite
             grad norm is read on the host (one sync a step), why ([Note: the verdict on the
             device], fz3/core/grad/verdict.py)
    INFO     at engine.compile(), rank 0: the backend and the modules compiled
    INFO     at fz3.initialize, rank 0, under a launcher whose world spans several nodes, with one
             flat group: how to shard within each node (Config.shard_group_size)
    DEBUG    after each optimizer step, every rank: gathers (on demand / prefetched), bytes
             gathered and reduced, reduces, the trace's state and invalidations, peak live params,
             and the compiler's graphs, graph breaks and frames compiled (what the step added)
    WARNING  when a recorded module order is dropped twice or more in a row, no pass keeping to a
             plan in between (prefetch never gets going): where the order changed, and what the
             plan expected there; and, every rank, when an optimizer step is skipped because the
             global grad norm is not finite: the step and the first param whose grad is not
             finite (fp16 with a dynamic loss scale: the INFO below instead; with the verdict
             on the device, at the next boundary); and, rank 0, when
             save_16bit_model writes nothing (DeepSpeed: INFO); and, at fz3.initialize, when
             stage3_module_granularity_threshold makes no module a leaf: the smallest granularity
             and its module's class, as DeepSpeed says it (fz3/shell/tables.py granular_leaves)
    INFO     rank 0, fp16 with a dynamic loss scale: each overflow (the step skipped, the scale
             halved or the hysteresis spent) and each growth of the scale, in DeepSpeed's words
             (with the scale on the device, at the next boundary)

The DEBUG line costs nothing unless DEBUG is enabled for "fz3"; the WARNING check is one integer
comparison per pass.
"""
from __future__ import annotations

import logging
import os
import weakref

from fz3.config.config import differences
from fz3.core.ids import TraceMode
from fz3.core.param.trace import UNIT_GREW
from fz3.data import heap
from fz3.interpreters import accounting, groups
from fz3.shell import offload
from fz3.shell.memory import human_bytes

LOG = logging.getLogger("fz3")
STEP_KEYS = ("all_gather", "all_gather_on_demand", "all_gather_prefetch", "gathered_bytes", "reduce",
             "reduced_bytes", "graphs", "graph_breaks", "compiled_frames")


def initialized(engine) -> None:
    """The INFO summary of a new engine (rank 0)."""
    if engine.rank != 0 or not LOG.isEnabledFor(logging.INFO):
        return
    spec, store = engine.spec, engine.store
    persistent = [p for p in spec.params if p.persistent]
    gather_by, reduce_by = accounting.carriers(engine.options, engine.accelerator.backend)
    shards = store.shard_bytes()["param_shards"]
    grads = sum(g.numel() * g.element_size() for g in store.segment_grads())
    changed = ", ".join(f"{k}={v!r}" for k, v in differences(engine.config).items()) or "none"
    if engine.interp.capabilities.shared_memory:  # fz3/interpreters/shared_memory.py
        gather_by, reduce_by = (f"{c} (large messages through shared memory)" if c == "p2p" else c
                                for c in (gather_by, reduce_by))
    hybrid = (f" as {spec.replicas} groups of {spec.world_size} (hybrid sharding: gathers within a group, grads "
              "reduced within it and then across the groups)" if spec.groups > 1 else "")
    if spec.secondary > 1:  # [Note: hpZ], fz3/core/stage.py
        hybrid += (f", hpZ in groups of {spec.secondary} (the backward gathers secondary shards within "
                   "its group)")
    LOG.info("fz3: %d ranks%s on %s, backend %s (all-gather by %s, reduce-scatter by %s); %d params "
             "sharded (%s elements), %d persistent (%s elements); per rank: param shards %s, grad "
             "partitions %s; glibc's heap policy: %s; config differences from the defaults: %s",
             engine.world_size, hybrid, engine.accelerator.torch_device, engine.accelerator.backend, gather_by,
             reduce_by,
             len(spec.params) - len(persistent), f"{sum(p.numel for p in spec.params if not p.persistent):,}",
             len(persistent), f"{sum(p.numel for p in persistent):,}", human_bytes(shards), human_bytes(grads),
             f"{chosen} set" if (chosen := heap.user_choice(os.environ)) else "its own (dynamic)", changed)
    if said := offload.describe(engine.config, engine.store.host,
                                pinned=engine.offload is not None and engine.offload.non_blocking):
        LOG.info("fz3: offload: %s", said)


class StepLog:
    """What the per-step DEBUG line and the in-a-row WARNING remember between calls."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.invalidations = 0  # the trace's count at the last pass start
        self.in_a_row = 0  # plans dropped since a pass last kept to one
        self.on_plan = False  # the pass now running started on a recorded plan (COMPLETE)

    def new_pass(self, engine) -> None:
        """After the core's reset_step. The pass that closed departed from its plan (the count
        went up: one more in a row), or ran on a plan and kept to it (the row ends), or recorded
        (no plan to keep to: the row goes on)."""
        trace = engine.params_state.trace
        kept, self.on_plan = self.on_plan, trace.mode is TraceMode.COMPLETE
        if trace.invalidations == self.invalidations:
            if kept:
                self.in_a_row = 0
            return
        self.invalidations = trace.invalidations
        self.in_a_row += 1
        if self.in_a_row >= 2:
            LOG.warning("fz3 rank %d: the module order changed again (%d recorded plans in a row "
                        "dropped): %s. Each change drops the recorded trace, so passes gather on "
                        "demand, without prefetch. Is the control flow data-dependent?", engine.rank,
                        self.in_a_row, departure(engine, trace.departure))

    def step(self, engine) -> None:
        """After an optimizer step."""
        if not LOG.isEnabledFor(logging.DEBUG):
            return
        s = engine.stats()
        d = {k: s[k] - self.counts.get(k, 0) for k in STEP_KEYS}
        self.counts = {k: s[k] for k in STEP_KEYS}
        LOG.debug("fz3 rank %d step %d: %d all-gathers (%d on demand, %d prefetched), %s gathered, %d "
                  "reduces, %s reduced; trace %s, %d invalidations; peak live %s params; compiler: %d "
                  "graphs, %d graph breaks, %d frames (+%d, +%d, +%d this step) over %d compiled units",
                  engine.rank, s["optimizer_steps"], d["all_gather"], d["all_gather_on_demand"],
                  d["all_gather_prefetch"], human_bytes(d["gathered_bytes"]), d["reduce"],
                  human_bytes(d["reduced_bytes"]), s["trace"], s["trace_invalidations"], f"{s['peak_live_numel']:,}",
                  s["graphs"], s["graph_breaks"], s["compiled_frames"], d["graphs"], d["graph_breaks"],
                  d["compiled_frames"], s["compiled_units"])


def compiled(engine, backend, names: list[str]) -> None:
    """engine.compile()'s INFO line (rank 0): what it compiled."""
    if engine.rank != 0:
        return
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    LOG.info("fz3: engine.compile(backend=%r) compiled %d modules, each one fetch unit: %s", backend,
             len(names), shown or "none (no module left to compile)")


def own_buffers(engine) -> None:
    """Once per engine, a WARNING that full_state_dict() returns this rank's own buffers
    (Options(broadcast_buffers=False) on several ranks, a model with buffers): they differ from
    rank to rank."""
    if engine in _OWN_BUFFERS_SAID or engine.world_size < 2 or not any(True for _ in engine.module.buffers()):
        return
    _OWN_BUFFERS_SAID.add(engine)
    LOG.warning("fz3 rank %d: full_state_dict() returns this rank's own buffers: with "
                "Options(broadcast_buffers=False) each rank keeps its own, so they differ from rank to rank "
                "(the default, True, makes them rank 0's on every rank)", engine.rank)


_OWN_BUFFERS_SAID: "weakref.WeakSet" = weakref.WeakSet()


def skipped_step(engine, step: int, first: str | None, norm) -> None:
    """The WARNING of a step skipped for a non-finite grad norm ([Note: a step skipped]); `norm`:
    that step's, as reported (with the verdict on the device this comes a step late: [Note: the
    verdict on the device])."""
    where = f"param {first!r} is the first (in model order) whose gradient is not finite" if first \
        else "no single param's averaged gradient is, their squares overflowed"
    LOG.warning("fz3 rank %d: optimizer step %d skipped: the global gradient norm is %s; %s. The "
                "weights, the optimizer state and the lr scheduler did not change (skipped steps: %d). "
                "A NaN or inf loss on any rank reaches every rank through the reduce.", engine.rank,
                step, float(norm), where, engine.skipped)


def flat_across_nodes(rank: int, world_size: int, config) -> None:
    """Rank 0's INFO, once, under a launcher that says the world spans several nodes
    (LOCAL_WORLD_SIZE < WORLD_SIZE) while every gather spans the world: how to keep them within
    a node ([Note: hybrid sharding], fz3/core/stage.py)."""
    local = groups.launcher_nodes(world_size)
    if rank != 0 or local is None or config.stage == 0:
        return
    LOG.info("fz3: the %d ranks span %d nodes of %s (LOCAL_WORLD_SIZE) and every gather and reduce spans all of "
             "them (flat ZeRO-3); fz3.Config(shard_group_size=%s) shards within each node and replicates across "
             "nodes (hybrid sharding: gathers stay on the node, one all-reduce of the grad shards crosses nodes); "
             "zero_hpz_partition_size=%s keeps the backward's gathers on the node (hpZ)",
             world_size, world_size // local, local, local, local)


def verdict_on_host(engine, why: str | None) -> None:
    """Rank 0's INFO, once, on an accelerator: each step's skip of a non-finite grad norm is read
    on the host there, one host-device sync a step ([Note: the verdict on the device])."""
    if why is None or engine.rank != 0 or engine.accelerator.type == "cpu":
        return
    LOG.info("fz3: each optimizer step reads its grad norm's finiteness on the host (one host-device sync a "
             "step, so the host cannot run ahead of the %s): %s", engine.accelerator.type, why)


def loss_scale(engine, old, new, *, overflow: bool, step: int | None = None) -> None:
    """Rank 0's INFO when fp16's loss scale moves (fz3/core/grad/scaler.py), in DeepSpeed's
    words (it logs them at INFO too: an overflow is the dynamic scaler at work, not an error).
    `step`: the optimizer step it moved at (with the scale on the device this comes a step late:
    [Note: the verdict on the device]); the engine's last one if None."""
    if engine.rank != 0:
        return
    step = engine.optimizer_steps if step is None else step
    if not overflow:
        LOG.info("fz3: no overflow in %d steps: loss scale %s -> %s", engine.config.loss_scale_window,
                 _scale(old.scale), _scale(new.scale))
    elif new.scale != old.scale:
        LOG.info("fz3: OVERFLOW! optimizer step %d skipped. Attempted loss scale: %s, reducing to %s",
                 step, _scale(old.scale), _scale(new.scale))
    else:
        LOG.info("fz3: OVERFLOW! optimizer step %d skipped. Attempted loss scale: %s, but hysteresis is %d. "
                 "Reducing hysteresis to %d", step, _scale(old.scale), old.hysteresis,
                 new.hysteresis)


def _scale(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def not_saved_16bit(engine, path: str) -> None:
    """Rank 0's WARNING that save_16bit_model wrote nothing (DeepSpeed logs it at INFO; a file
    a user asked for and did not get should not be silent)."""
    if engine.rank == 0:
        LOG.warning("fz3: did not save the model %s because zero_optimization."
                    "stage3_gather_16bit_weights_on_model_save is false (DeepSpeed's default; an engine "
                    "from fz3.initialize always has it off): set it true in the config given to "
                    "fz3.deepspeed.initialize, or write engine.full_state_dict() yourself", path)


def departure(engine, where: tuple[int, int, int]) -> str:
    """(fetch index, module fetched or -1, module the plan expected or -1) in words."""
    if not where:
        return "where is not known"
    step, got, expected = where
    name = lambda m: repr(engine.tables.module_names[m] or "<root>")  # noqa: E731
    if expected == UNIT_GREW:
        return f"{name(got)} took params it does not own (external params), so the plan's fetch units changed"
    if got < 0:
        return f"the pass ended after {step} fetches, where the plan expected {name(expected)} next"
    if expected < 0:
        return f"fetch {step} was {name(got)}, past the end of the plan"
    return f"fetch {step} was {name(got)} where the plan expected {name(expected)}"
