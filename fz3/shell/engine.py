"""The engine: the shell's mutable cells and the hooks that turn torch's events into core events.

    engine(*args)      every registered module: pre-forward -> Enter, post-forward -> Leave
                       (or Raised); a param read off another module -> Read (hooks.py: the
                       autograd nodes; fz3/core/events.py: the events)
    engine.backward(loss) / loss.backward()
                       PreBackward (or its pre-hook) -> PreBackwardRan, PostBackward -> PostBackwardRan, grad
                       hooks -> GradReady, end of backward (queue_callback) -> BackwardEnded
    engine.step()      at the accumulation boundary: the global grad norm, then Stepped:
                       StepOptimizer (clip, optimizer.step() on the fp32 master shards, shards
                       refreshed) or, the norm not finite, SkipStep (a WARNING naming the param)

Every decision is a core transition (`update`, fz3/core/events.py, through the replay of
fz3/core/replay.py, which answers a steady-state pass from its recording); a hook reads what torch
shows it (grad mode, which tensors need grad, which params a module returned) into an event,
hands it to the core, and runs the effects it gets back: the parameter and gradient effects
through the interpreter, the hook effects (fz3/core/hook_effects.py: wrap the call's tensors,
queue the end of backward, the store's grad placeholders) itself, by one `match`, in order.
fz3's features (gathered_parameters, load_weights, load_checkpoint) send their events through
the same door, `engine.apply`.

The engine's mutable cells, all set in __init__ or _take_units:
    cell                 the core's: a Replay (fz3/core/replay.py), the state and the recorded
                         passes; every decision about params and grads is made in it
    loss_scale           fp16's scale (fz3/core/grad/scaler.py decides each change; the cell is
                         kept beside the core's: [Note: the scaler's count])
    grad_norm, norm_reported, overflow, step_applied
                         what the last boundary found, for DeepSpeed's getters
    micro_steps, global_samples, boundary_override, batch, unmanaged_backwards,
    gather_16bit_weights_on_model_save
                         DeepSpeed's counters and switches (surface.py)
    in_step, inside_no_sync, stopped, untouched
                         guards: step() is running, a coalesce_grad_reduction block is open, a
                         DivergenceError stopped the engine, no event has run yet
    ends, graph_tasks    autograd's bookkeeping: ends of backward the core queued and ran, and
                         torch's graph task ids numbered by pass
and the objects with state of their own: the tensor store (fz3/data/store.py), the interpreter,
the saved-tensor hooks of a root forward (saved.py), the buffers' broadcast (buffers.py), the
flat optimizer steps (flat_step.py) and the step log (log.py).

Decisions the shell still makes, not the core: whether a backward that met no fz3 node has
ended (`_end_unreported_backward`: after engine.backward, or at step() or the next forward);
refusing step() inside coalesce_grad_reduction and every call after a DivergenceError; counting
engine.backward calls when managed_gradient_accumulation is off (surface.py); and stepping the
lr scheduler when the core says the step was applied.
"""
from __future__ import annotations

import contextlib

import functools
import operator
import sys
import weakref
from itertools import compress, repeat
from typing import Callable, Optional

import torch
from torch import nn

from fz3.core import calls, replay, stage
from fz3.core.calls import Lifecycle, initial_calls
from fz3.core.events import (BackwardEnded, Enter, GradReady, GradsZeroed, Leave, PostBackwardRan, PreBackwardRan,
                             Raised, Read, StepCalled, Stepped)
from fz3.config.config import Config
from fz3.core.grad.epilogue import at_boundary
from fz3.core.grad import scaler, verdict
from fz3.core.grad.scaler import LossScale
from fz3.core.grad.verdict import Verdict
from fz3.core.grad.grads import init_grad_state
from fz3.core.hook_effects import (HOOK_EFFECTS, BeginPass, ClearGradDue, EndOfBackward, EndPass, GradDue, GradIn,
                                   QueueEndOfBackward, SkipStep, StepOptimizer, WrapInputs, WrapOutputs,
                                   ZeroGrads)
from fz3.core.ids import Status, TraceMode
from fz3.core.param.state import initial_state
from fz3.interpreters.agreement import DivergenceError
from fz3.interpreters.leaf_hint import leaf_hint
from fz3.interpreters.protocol import Interpreter
from fz3.data import shards
from fz3.shell import checks, generation, log, optimizer_names, pytree, state_dict, zero_grad
from fz3.shell.buffers import BufferSync
from fz3.shell.compiled import compile_stats, outside_graph, refuse_compiled_engine
from fz3.shell.log import StepLog
from fz3.shell.hooks import ParamDict, PostBackward, before_backward, flatten, needs_grad, wrap_tensors
from fz3.shell.memory import memory_stats
from fz3.shell.saved import SavedParams
from fz3.shell.flat_step import FlatSteps, group_runs
from fz3.shell.offload import OptimizerOffload, store_layout
from fz3.shell.optim import (bind_optimizer, check_scheduler, clip_grad_norm, first_flagged, first_nonfinite,
                             global_grad_norm)
from fz3.config.options import Options
from fz3.data.store import DTYPES, TensorStore
from fz3.shell.surface import BatchSizes, DeepSpeedSurface
from fz3.shell.tables import read_tables
from fz3.shell.device_scale import DeviceScale
from fz3.shell.verdict import DeviceVerdict, on_device, put_back, step_scheduler


_HOOK_TYPES = frozenset(HOOK_EFFECTS)
_GRAD = operator.attrgetter("grad")  # a param's .grad, read by map in C

COUNTERS = ("all_gather", "all_gather_on_demand", "all_gather_prefetch", "all_gather_via_all_reduce",
            "all_gather_via_native", "all_gather_via_p2p", "gathered_bytes", "reduce",
            "reduce_all_reduce", "reduce_p2p", "reduce_reduce_scatter", "reduced_bytes", "p2p_sends",
            "reduce_across", "across_bytes", "bytes_intra_group", "bytes_inter_group", "messages_intra_group",
            "messages_inter_group", "all_gather_hpz")
"""The interpreter's counters stats() reports; every key is present, 0 until it first counts."""


class Engine(DeepSpeedSurface):
    """What `fz3.initialize` returns. Call it like the model. DeepSpeed's engine methods and
    counters are fz3/shell/surface.py's."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: Config, *,
                 device, rank: int, world_size: int, interpreter: Callable[[TensorStore], Interpreter],
                 transport=None, lr_scheduler=None, options: Options = Options()) -> None:
        """`interpreter(store)` builds what runs the core's effects on this rank's tensor store
        (fz3/interpreters/protocol.py): DistInterpreter under fz3.initialize, PlanInterpreter under
        fz3.plan. `transport` moves the bytes of the real run's other collectives (consolidation,
        checkpoints' agreement; fz3/interpreters/transport.py); None under fz3.plan. `options`:
        fz3's own switches (fz3/config/options.py; the interpreter takes the same)."""
        self.module, self.optimizer, self.config, self.accelerator = model, optimizer, config, device
        self.lr_scheduler = check_scheduler(lr_scheduler, optimizer)
        self.transport, self.options = transport, options
        self.rank, self.world_size = rank, world_size
        self.tables = read_tables(model, world_size=self.world_size, config=config)
        self.spec = self.tables.spec
        # the layout: the ranks each param is split over and this rank's place among them (the
        # whole group at stages 1-3; at stage 0 one rank, whole params: fz3/core/stage.py)
        self.shard_world = self.spec.world_size
        self.shard_rank = rank % self.shard_world
        runs = group_runs(optimizer, self.tables.params)  # each group's masters flat: [Note: flat steps]
        layout = store_layout(config, device.torch_device, options)  # for the offload asked (offload.py)
        self.store = TensorStore(self.tables.params, tuple(self.tables.names),
                                 shards.initial_shards(self.tables.params, self.tables.names, rank=self.shard_rank,
                                                     world_size=self.shard_world, device=device.torch_device),
                                 rank=self.shard_rank, world_size=self.shard_world,
                                 compute_dtype=config.compute_dtype, device=device.torch_device, runs=runs,
                                 huge_pages=options.huge_pages,
                                 separate_shards=layout.separate_shards, segment_numel=layout.segment_numel,
                                 host=layout.host, pin=layout.pin, params_on_host=layout.params_on_host)
        self.param_ids = {id(p): i for i, p in enumerate(self.tables.params)}
        self.make_interpreter = interpreter
        self.hook_handles: list = []
        self._take_units()
        self.grad_norm: torch.Tensor | None = None  # at the last boundary, before clipping
        self.norm_reported: torch.Tensor | None = None  # ... as get_global_grad_norm says it (scaler.py)
        self.step_log = StepLog()
        # DeepSpeed's counters and batch sizes ([Note: DeepSpeed's counters], surface.py);
        # fz3.deepspeed.initialize sets the batch sizes and the 16-bit save switch
        self.micro_steps, self.global_samples, self.step_applied = 0, 0, False
        self.boundary_override: bool | None = None
        self.in_step = self.inside_no_sync = False  # step() runs; a coalesce_grad_reduction block is open
        self.unmanaged_backwards = 0  # engine.backward calls since the last step() (managed_gradient_accumulation off)
        self.batch = BatchSizes(None, None)
        self.gather_16bit_weights_on_model_save = False
        self.saved = SavedParams(self.store, self.tables.names, self.param_ids, watch=calls.saves_matter(self.spec))
        # the core's one door (fz3.timeline times what goes through it); debug_checks also holds
        # every event a schedule answers against `events.update`
        self.update = functools.partial(replay.advance, check=options.debug_checks, keep=options.replay)
        if config.compute_dtype != "fp32":
            _cast_buffers(model, DTYPES[config.compute_dtype])
        self.generating = False  # inside engine.generation() (fz3/shell/generation.py)
        self.buffers = BufferSync(model, lambda t: self.interp.broadcast(t), enabled=options.broadcast_buffers,
                                  world_size=world_size)  # the interpreter of the units of the time
        bind_optimizer(optimizer, self.tables.params, self.store.masters)
        self.flat_steps = FlatSteps(optimizer, self.store, runs, flat=not layout.in_parts)
        self.offload = OptimizerOffload.build(self)  # None without "nvme" or a host step (fz3/shell/offload.py)
        self.zero_grad_undo = zero_grad.install(self, (model, optimizer))  # [Note: zero_grad in a window]
        # fp16's loss scale (fz3/core/grad/scaler.py): a cell of its own, beside the core's
        # ([Note: the scaler's count]); DeepSpeed's names for it on the optimizer
        self._loss_scale = scaler.initial_scale(config)
        self._overflow = False  # the last boundary's grads were not finite (DeepSpeed's optimizer.overflow)
        # [Note: the verdict on the device] (fz3/core/grad/verdict.py): None where the optimizer
        # takes the norm's flag, else why the boundary reads it (said once on an accelerator)
        self.verdict_on_host = on_device(optimizer, config, host_step=self.offload is not None)
        self.verdict, self.verdict_call, self.scheduler_kept = Verdict(), -1, None
        self.device_verdict = DeviceVerdict(device)
        log.verdict_on_host(self, self.verdict_on_host)
        # fp16's dynamic scale with the verdict: on the device too, read when asked (device_scale.py)
        self.device_scale = DeviceScale.of(self._loss_scale, device.torch_device) \
            if scaler.dynamic(config) and self.verdict_on_host is None else None
        # this step's found_inf and, in fp16, its (old, new, at_min) DeviceScales: for the guard
        self.step_flag: tuple | None = None
        self.scale_error: scaler.LossScaleError | None = None  # read a step late, raised at the boundary
        optimizer_names.add_names(optimizer, self)
    def _take_units(self) -> None:
        """What follows from the fetch units (the tables' modules): the interpreter, the core
        state, the hooks. Run at initialize, and again by engine.compile() before the first
        forward, when compiled blocks become units (fz3/shell/compiled.py)."""
        self.spec = self.tables.spec
        self.store.take_units(self.spec, self.tables.module_names)
        self.interp = self.make_interpreter(self.store)
        self.stopped: DivergenceError | None = None  # [Note: an engine stops at a DivergenceError]
        self._watch_divergence()
        self.module_ids = {id(m): i for i, m in enumerate(self.tables.modules)}
        can = self.interp.capabilities
        # the core's cell: its state and recorded passes
        grads = init_grad_state(self.spec, in_place_reduce_scatter=can.in_place_reduce_scatter,
                                hold_budget=can.hold_budget)
        self.cell = replay.start(Lifecycle(initial_state(self.spec), grads,
                                           initial_calls(self.spec, self.store.trainable, self.config)))
        self.call_tables = replay.view(self.cell).calls.tables  # static: read by hooks
        # the module whose call is innermost open (calls.running), as the ParamDicts see it: they
        # report no read of its module's own params. None after an event that opens or closes a
        # call: the first read that needs it asks the core (`_running`), so a call event pays one
        # store, not a lookup (on the deep narrow GPT 232 call events a step, and a lookup only in
        # the calls that read a param through a ParamDict, once each)
        self.running: list[int | None] = [-1]
        # [Note: inert modules] (fz3/core/calls.py): a call of a quiet one inside another call (some
        # call open: `running`) takes no event, but under fz3.check (`every_call`). By open call
        # of a quiet module, innermost last: whether its pre-forward sent none
        self.quiet_ids = frozenset(id(mod) for mod, quiet in zip(self.tables.modules, self.call_tables.quiet)
                                   if quiet)
        self.quiet_calls: list[bool] = []
        self.every_call = False
        # the trainable params without a grad hook, whose grads the engine reports itself
        # ([Note: persistent grads at the end of backward]): ids, and the params to look at
        self.unhooked = self.call_tables.leaf_own + self.call_tables.at_end
        self.unhooked_params = [self.tables.params[p] for p in self.unhooked]
        # of them, those whose .grad left set after a backward's end means another backward ran
        # unseen (a grad waiting for the boundary at stages 0 and 1 means nothing of the kind)
        self.at_end = self.unhooked if not stage.policy(self.config).grads_at_boundary else self.call_tables.at_end
        self.at_end_params = [self.tables.params[p] for p in self.at_end]
        self.ends = 0  # ends of backward queued by the core that ran
        # no event has run yet (engine.compile() checks it). A flag, not the first state kept for
        # an identity check: an old state keeps every later version's diffs alive (pvec.py), so
        # holding the first one grew the heap by every change ever made (~0.5 MiB a step, deep GPT)
        self.untouched = True
        self.graph_tasks: dict[int, int] = {}  # torch's graph task id -> this pass's number
        self._install()

    def units_changed(self) -> None:
        """Modules of the model became compiled regions (engine.compile()): read the units
        again and build what follows from them. Before the first forward only."""
        self._uninstall()
        names = self.tables.names
        self.tables = read_tables(self.module, world_size=self.world_size, config=self.config,
                                  numels=[s.numel() for s in self.store.shapes])
        assert self.tables.names == names, "compiling in place renames no param"
        self._take_units()

    @property
    def state(self) -> Lifecycle:
        """The core's state, exact (built from a schedule while one plays: O(params))."""
        return replay.current(self.cell)

    @property
    def params_state(self):
        return replay.view(self.cell).params  # no counter in it: exact, O(1)

    @property
    def grads_state(self):
        return self.state.grads

    @property
    def skipped(self) -> int:
        """Steps skipped for a non-finite grad norm (no counter a replay shifts: O(1)): the core's,
        and those the device decided, read ([Note: the verdict on the device])."""
        self.read_verdict(every_rank=False)
        return replay.view(self.cell).grads.skipped + self.verdict.skipped

    @property
    def optimizer_steps(self) -> int:
        """The accumulation windows closed, skipped steps included (DeepSpeed's global_steps
        counts those too; stats()["skipped_steps"] says how many)."""
        return replay.view(self.cell).grads.window + replay.shift_of(self.cell).window

    # ---- running events ---------------------------------------------------------------------

    def apply(self, event, tree=None, flat=None):
        """Run one core event (fz3/core/events.py) on the current state, then its effects, in
        order: the interpreter's, and the hook effects here (they may rewrap `tree`, the call's
        inputs or outputs, which is returned; `flat`: `flatten(tree)` if the hook made it, so the
        call's tensors are walked once). Every event goes through this door: the hooks', and
        fz3's features' (Hold, Unhold, ShardsReplaced, Resumed)."""
        if self.stopped is not None:  # the one check a hook pays for it
            self._refuse_if_stopped()
        self.cell, effects = self.update(self.cell, event, config=self.config)
        self.untouched = False
        if effects:  # most replayed events have none (a call of a module with nothing to fetch)
            tree = self._run(effects, tree, flat)
        if self.options.debug_checks:
            checks.after_event(self.state, effects, self.config)
        return tree

    def _watch_divergence(self) -> None:
        """[Note: an engine stops at a DivergenceError] After one, the ranks are out of step for
        good: descriptors pair k-th with k-th and a rank may have sent some the others will never
        take, and the core's state has moved past effects that never ran (a gather not waited, a
        reduce not written). Nothing a next batch could do re-pairs the messages or unwinds the
        state, so the engine stops: every later call (a forward through it or engine.module, a
        backward, step, full_state_dict, save_checkpoint, load_checkpoint, gathered_parameters)
        raises a DivergenceError that names the first and says what to do, where it once raised
        an internal KeyError from a state that no longer matched the tensors. The interpreter's
        check tells the engine (`on_failure`); an event pays one attribute check. The check also
        names a leaf module to mark when the ranks ran different submodules of one parent."""
        agreement = self.interp.agreement
        if agreement is not None:
            agreement.on_failure = self._stop
            agreement.hint = leaf_hint(self.tables.names, [(name, type(m)) for name, m in
                                                           zip(self.tables.module_names, self.tables.modules)])

    def _stop(self, e: DivergenceError) -> None:
        self.stopped = e

    def _refuse_if_stopped(self) -> None:
        """Raise what every call after a DivergenceError gets ([Note: an engine stops at a
        DivergenceError]); nothing before one."""
        if self.stopped is None:
            return
        first = "\n".join(f"  {line}" for line in str(self.stopped).splitlines())
        raise DivergenceError(
            f"fz3: this engine (rank {self.rank}) stopped at a DivergenceError and runs nothing more: its "
            "ranks are out of step for good. Restart every rank's process, build the model and call "
            "fz3.initialize again, then resume from your last checkpoint with engine.load_checkpoint(save_dir) "
            f"(or train from the start). The DivergenceError was:\n{first}") from self.stopped

    def _run(self, effects, tree, flat=None):
        batch = []
        for e in effects:
            if type(e) not in _HOOK_TYPES:  # a set lookup: most effects are the interpreter's
                batch.append(e)
                continue
            if batch:
                self.interp.run(batch)
                batch = []
            new = self._hook_effect(e, tree, flat)
            if new is not tree:  # rewrapped or cast: its leaves are not `flat`'s any more
                tree, flat = new, None
        if batch:
            self.interp.run(batch)
        return tree

    # ---- hooks: torch's events in ---------------------------------------------------------------

    def _install(self) -> None:
        # [Note: hooks outside the graph] (compiled.py): the compiler never traces into fz3
        pre_forward, post_forward = outside_graph(self._pre_forward), outside_graph(self._post_forward)
        on_param_read, resolve_running = outside_graph(self._on_param_read), outside_graph(self._running)
        handles = self.hook_handles
        for m, module in enumerate(self.tables.modules):
            handles.append(module.register_forward_pre_hook(pre_forward, with_kwargs=True, prepend=True))
            handles.append(module.register_forward_hook(post_forward, with_kwargs=True, always_call=True))
            # a quiet module's params are persistent, none freed: a read needs nothing ([Note: inert modules])
            if not self.spec.modules[m].is_leaf and not self.call_tables.quiet[m]:
                module._parameters = ParamDict(module._parameters, m, on_param_read, self.running, resolve_running)
        for p, hooked in enumerate(self.call_tables.hooked):  # [Note: leaf modules]
            if hooked:
                handles.append(self.tables.params[p].register_post_accumulate_grad_hook(
                    outside_graph(self._make_grad_hook(p))))
        handles.extend(state_dict.install(self))

    def _uninstall(self) -> None:
        """Take every hook `_install` put in (engine.compile(), before the units change)."""
        for h in self.hook_handles:
            h.remove()
        self.hook_handles.clear()
        for module in self.tables.modules:
            if isinstance(module._parameters, ParamDict):
                module._parameters = dict(module._parameters)

    def _pre_forward(self, module, args, kwargs):
        if id(module) in self.quiet_ids:  # quiet: inside another call no event ([Note: inert modules])
            running = self.running[0]
            if running is None:
                running = self._running()
            nested = running >= 0 and not self.every_call
            self.quiet_calls.append(nested)
            if nested:
                return None
        m, grad, tree, flat = self.module_ids[id(module)], torch.is_grad_enabled(), (args, kwargs), None
        recomputing = torch._C._current_graph_task_id() != -1
        if self.at_end and not recomputing and self._running() < 0:  # outermost: a backward before is over
            self._end_unreported_backward()
        # an inert call's inputs matter to nobody: the core wraps them only for calls that are not
        # ([Note: inert modules], fz3/core/calls.py), so they are not walked
        if grad and not self.call_tables.inert[m]:
            flat = flatten(tree)
        out = self.apply(Enter(module=m, grad=grad, grad_inputs=flat is not None and needs_grad(flat[0]),
                               recomputing=recomputing, training=module.training, saved=self.saved.position()),
                         tree, flat)
        self.running[0] = m  # the call just opened is the innermost (calls.running), no lookup needed
        return out

    def _post_forward(self, module, args, kwargs, output):
        if id(module) in self.quiet_ids and self.quiet_calls.pop():
            return None  # its pre-forward sent no event
        if output is None and sys.exc_info()[1] is not None:  # raised: [Note: a forward that raised]
            if self.stopped is not None:
                return None  # the DivergenceError goes on out; refusing here would only be silenced
            return self._call_event(Raised(module=self.module_ids[id(module)],
                                           recomputing=torch._C._current_graph_task_id() != -1))
        flat = flatten(output)
        leaves = flat[0]
        return self._call_event(Leave(module=self.module_ids[id(module)],
                                      grad_outputs=torch.is_grad_enabled() and needs_grad(leaves),
                                      returned=tuple(self.param_ids[id(t)] for t in leaves if id(t) in self.param_ids),
                                      saved=self.saved.log, recomputing=torch._C._current_graph_task_id() != -1),
                                output, flat)

    def _call_event(self, event, tree=None, flat=None):
        """`apply` for an event that opens or closes a call; the running module its ParamDicts
        compare with is then looked up again when one needs it (`_running`)."""
        out = self.apply(event, tree, flat)
        self.running[0] = None
        return out

    def _running(self) -> int:
        """The module whose call is innermost open (calls.running), kept until the next call event."""
        r = self.running[0] = calls.running(replay.view(self.cell))
        return r

    def _on_param_read(self, owner: int, param: nn.Parameter) -> None:
        self.apply(Read(owner=owner, param=self.param_ids[id(param)], grad=torch.is_grad_enabled()))

    def _pre_backward(self, m: int) -> None:
        self.apply(PreBackwardRan(module=m))

    def _post_backward(self, m: int) -> None:
        own = self.call_tables.leaf_own_of[m]  # () unless m is a leaf
        self.apply(PostBackwardRan(module=m, with_grad=self._with_grad(own) if own else frozenset()))

    def _make_grad_hook(self, p: int):
        engine = weakref.ref(self)

        def hook(param: nn.Parameter) -> None:
            e = engine()
            dtype = param.grad.dtype
            name = _DTYPE_NAMES.get(dtype)
            if name is None:
                name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
            e.apply(GradReady(param=p, dtype=name, graph_task=e._graph_task()))
        return hook

    def _graph_task(self) -> int:
        """The running graph task, numbered from 0 in the order this pass met it: what the core
        needs (whether two reports share a task) without torch's process-wide ids, which differ
        every backward and would make each pass's events new ([Note: a pass forgets],
        fz3/core/replay.py). Renumbered at each pass's start."""
        tasks, t = self.graph_tasks, torch._C._current_graph_task_id()
        local = tasks.get(t)
        if local is None:
            local = tasks[t] = len(tasks)
        return local

    def _end_of_backward(self) -> None:
        self.ends += 1
        self.apply(BackwardEnded(with_grad=self._unhooked_with_grad()))

    def _end_unreported_backward(self) -> None:
        """A backward that met no fz3 node and no hooked param (one from the output of an inert
        call inside another) queued no end: the grads it left in unhooked params' .grad are
        reported now, as its BackwardEnded ([Note: persistent grads at the end of backward],
        fz3/core/calls.py). Called where the core would next see it: after engine.backward (if
        no end ran in it), at step() and at an outermost call's pre-forward. After an end they
        are all taken (None), but at stages 0 and 1, where grads wait in .grad for the boundary:
        there only those reported at the end of backward are looked at (none: every param is
        hooked, calls.call_tables hook_all)."""
        pending = frozenset(compress(self.at_end, map(operator.is_not, map(_GRAD, self.at_end_params), repeat(None))))
        if pending:
            self.apply(BackwardEnded(with_grad=pending))

    def _unhooked_with_grad(self) -> frozenset[int]:
        """`_with_grad` of every unhooked param, looked at in C (`map`, `compress`): up to three
        times a step (196 params on the deep narrow GPT). By identity: `list.count(None)` would
        compare each grad with None by Tensor.__eq__, ~13 us a grad."""
        return frozenset(compress(self.unhooked, map(operator.is_not, map(_GRAD, self.unhooked_params),
                                                     repeat(None))))

    def _with_grad(self, ps) -> frozenset[int]:
        """Of the params `ps` without a grad hook, those autograd gave a grad (what the core
        cannot see; [Note: leaf modules], [Note: persistent grads at the end of backward],
        fz3/core/calls.py)."""
        return frozenset(p for p in ps if self.tables.params[p].grad is not None)

    # ---- hook effects: what the core asks of torch ------------------------------------------------

    def _hook_effect(self, e, tree, flat=None):
        """Run one hook effect (fz3/core/hook_effects.py); -> the call's tensors, rewrapped if
        it wraps them (`flat`: their flattening, if made already)."""
        match e:
            case GradIn(p):
                self.store.grad_in(p)
            case WrapInputs(m):
                return wrap_tensors(tree, PostBackward, lambda: self._post_backward(m), flat)[0]
            case WrapOutputs(m):
                return before_backward(tree, lambda: self._pre_backward(m), flat)
            case GradDue(params):
                self.store.grad_due.update(params)
            case ClearGradDue():
                self.store.clear_grad_due()
            case ZeroGrads(params):
                for p in params:
                    self.store.zero_grad(p)  # by its shape: it may be freed ([Note: leaf modules])
            case QueueEndOfBackward():
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            case EndOfBackward():
                self.interp.end_of_backward()
                if self.options.debug_checks:
                    checks.quiescent(self.state.params)
            case BeginPass():
                return self._begin_pass(tree)
            case EndPass():
                self.saved.end()
            case StepOptimizer(no_grad, guarded):
                self._step_optimizer(no_grad, guarded)
            case SkipStep(step):
                if scaler.dynamic(self.config):
                    return tree  # fp16's overflow: the scaler's business, logged as it moves (log.loss_scale)
                # [Note: a step skipped] (fz3/core/grad/epilogue.py): say which param, on every rank alike
                first = first_nonfinite(self.store, self.interp.any_rank)
                log.skipped_step(self, step, None if first is None else self.tables.names[first], self.norm_reported)
        return tree

    def _begin_pass(self, tree):
        """[Note: saved views of gathered params] (saved.py) watch this pass's saves; rank 0's
        buffers are every rank's (buffers.py)."""
        if not self.generating:  # engine.generation() broadcast them once, at its entry
            self.buffers.sync()
        self.graph_tasks.clear()
        self.saved.begin()
        self.store.clear_grad_due()
        checks.requires_grad_unchanged(self.tables, self.store.trainable)
        self.step_log.new_pass(self)
        return _cast_floating(tree, self.store.dtype)

    def _step_optimizer(self, no_grad: tuple[int, ...], guarded: bool = False) -> None:
        """The optimizer steps on the fp32 master shards: each one's grad its averaged
        partition, clipped, or None where no grad reached it ([Note: no grad, no step]).
        `guarded`: it takes the norm's flag and skips on the device where the norm is not finite
        ([Note: the verdict on the device], fz3/core/grad/verdict.py)."""
        self.store.bind_grads(no_grad)
        if self.config.gradient_clipping > 0:
            clip_grad_norm(self.store, self.config.gradient_clipping, self.grad_norm)
        if self.offload is not None:  # a sub-group at a time, the offloaded ones from disk and back
            self.offload.step(no_grad)
            return
        flag, self.step_flag = self.step_flag, None
        with (self.device_verdict.guard(self.optimizer, *flag, self.norm_reported, self.store.partitions)
              if guarded else contextlib.nullcontext()):
            self.flat_steps.step(no_grad)  # the optimizer's own step(), its groups flat ([Note: flat steps])
        self.store.refresh_shards()

    # ---- public API -------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # torch.compile(engine): [Note: compiled regions]
            refuse_compiled_engine()
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, **kwargs) -> torch.Tensor:
        """loss.backward(); the grads are summed over ranks and micro-steps and divided once at
        the boundary, by world_size * gradient_accumulation_steps over what each was divided by
        before its reduce (fz3/core/grad/epilogue.py); in fp16 the loss is scaled first (`scale`).
        -> loss divided by gradient_accumulation_steps, detached: what DeepSpeed's backward
        returns (its scaled loss)."""
        self._refuse_if_stopped()
        ends = self.ends
        self.unmanaged_backwards += 1
        self.scale(loss).backward(**kwargs)
        if self.ends == ends:  # an end that ran took every grad of this backward
            self._end_unreported_backward()
        return loss.detach() / self.config.gradient_accumulation_steps

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss engine.backward backwards: in fp16 divided by gradient_accumulation_steps
        and multiplied by the loss scale, in the loss's own dtype, as DeepSpeed's (so a scaled
        fp16 loss overflows where DeepSpeed's does: fz3/core/grad/scaler.py); else the loss as it
        is. For a backward of your own: `engine.scale(loss).backward()`. DeepSpeed: engine.scale
        and engine.backward (scale_wrt_gas)."""
        if self.device_scale is not None:  # the same bits, the scale never read
            return self.device_scale.loss(loss, self.config.gradient_accumulation_steps)
        factor = scaler.loss_factor(self.loss_scale, config=self.config)
        if factor is None:
            return loss
        return loss / self.config.gradient_accumulation_steps * factor

    def step(self, lr_kwargs: dict | None = None) -> None:
        """At the accumulation boundary: the global grad norm, then clipping, the optimizer step
        on the fp32 master shards and the lr scheduler (`lr_scheduler.step(**lr_kwargs)`); or,
        the norm not finite, none of them (a WARNING names the step and the first param whose
        grad is not finite; was_step_applied() is False). Between boundaries the micro-step's
        grads join the window. The boundary is DeepSpeed's: every gradient_accumulation_steps-th
        step() call ([Note: the window closes at step()], fz3/core/grad/epilogue.py), and every
        backward before it adds ([Note: DeepSpeed's counters], surface.py)."""
        self._refuse_if_stopped()
        if self.inside_no_sync:
            raise AssertionError("It is illegal to call Engine.step() inside no_sync context manager")
        self._end_unreported_backward()  # a bare loss.backward() of that kind counts before the boundary
        self.step_applied, self.in_step = False, True
        try:
            # the scale on the device: the core divides by W alone, _step_at_boundary by the scale
            unscale = 1.0 if self.device_scale is not None else scaler.unscale_by(self.loss_scale, config=self.config)
            self.apply(StepCalled(boundary=self.boundary_override, loss_scale=unscale))
            boundary = at_boundary(replay.view(self.cell).grads, config=self.config)  # a flag: no shift
            if boundary:
                self._step_at_boundary(lr_kwargs)
            self._count_step(boundary)
        finally:
            self.in_step = False

    def _step_at_boundary(self, lr_kwargs: dict | None) -> None:
        self.read_verdict(every_rank=True)  # the last step's, if left to the device
        ds = self.device_scale
        if ds is not None:  # unscaled by the scale this step leaves if it applies, as the core would
            # (a power of two: dividing by W, then by it, is dividing by W x it; device_scale.py)
            unscale = ds.unscale_by(self.config)
            torch._foreach_div_(self.store.segment_grads(), unscale)
        # the first shard_world ranks hold one copy of every partition (stage 0: rank 0's whole grads)
        self.grad_norm = norm = global_grad_norm(self.store, self.interp.all_reduce_sum,
                                                 counted=self.rank < self.shard_world)
        self.norm_reported = norm * (scaler.reported_norm_factor(self.loss_scale, config=self.config) if ds is None
                                     else 1.0 if self.config.stage == 3 else unscale / ds.scale)
        # [Note: the verdict on the device]: None, the optimizer takes the flag; else one sync
        finite = None if self.verdict_on_host is None else self.interp.finite(norm)
        self._overflow = finite is False
        if finite is None:  # the flag the optimizer takes (and, in fp16, the scale's move on it)
            found_inf = torch.isfinite(norm).logical_not().to(torch.float32)
            moved = None
            if ds is not None:
                self.device_scale, at_min = ds.update(found_inf, self.config)
                moved = (ds, self.device_scale, at_min)
            self.step_flag = (found_inf, moved)
        leaf_own = self.call_tables.leaf_own
        # got == window, micro_step, applied: relations and flags, exact in the view
        got = self.interp.any_rank(calls.leaf_grads_seen(replay.view(self.cell)))  # () without leaves
        try:  # (the scale on the device moved above; it raises here what the last step's read found)
            if ds is not None and self.scale_error is not None:
                error, self.scale_error = self.scale_error, None
                raise error
            scale = None if ds is not None else \
                scaler.update_scale(self.loss_scale, finite is False, config=self.config)
        except scaler.LossScaleError:
            # skipped, as DeepSpeed; the scale as it was
            if ds is not None:
                self.device_scale, self.step_flag = ds, None
            self.apply(Stepped(finite=False, leaf_grads=frozenset(p for p, g in zip(leaf_own, got) if g)))
            raise
        self.apply(Stepped(finite=finite, leaf_grads=frozenset(p for p, g in zip(leaf_own, got) if g)))
        if ds is None:
            if scaler.dynamic(self.config) and (not finite or scale.scale != self.loss_scale.scale):
                log.loss_scale(self, self.loss_scale, scale, overflow=not finite)
            self.loss_scale = scale
        self.step_applied = replay.view(self.cell).grads.applied
        self.verdict, effects = verdict.taken(self.verdict, step=self.optimizer_steps, finite=finite,
                                              scheduler=self.lr_scheduler is not None)
        self.verdict_call = self.micro_steps
        self._verdict_effects(effects, lr_kwargs or {})
        self.step_log.step(self)

    def read_verdict(self, *, every_rank: bool) -> None:
        """The pending step's flag read, if any, and what hangs on it ([Note: the verdict on the
        device]): the lr scheduler put back, the counts; `every_rank` (the boundary): the WARNING
        of a skipped step given. A user's read (was_step_applied, the skipped count) is this
        rank's alone."""
        if not (self.verdict.pending or (every_rank and self.verdict.owed)):
            return
        step = self.verdict.pending
        finite = self.device_verdict.read() if step else None
        if finite is False and self.verdict_call == self.micro_steps - 1:  # no step() since: its counts
            self.step_applied, self._overflow = False, True
        self.verdict, effects = verdict.read(self.verdict, finite, every_rank=every_rank)
        self._verdict_effects(effects, {})
        if step and self.device_scale is not None:  # fp16's scale of that step, read with its flag
            at_min, (s0, h0), (s1, h1) = self.device_verdict.scale_read()
            if at_min:  # raised by the next boundary's step(), as the host's at its own
                self.scale_error = scaler.at_minimum(self.config)
            elif not finite or s1 != s0:
                log.loss_scale(self, LossScale(s0, 0, h0), LossScale(s1, 0, h1), overflow=not finite, step=step)

    def _verdict_effects(self, effects, lr_kwargs: dict) -> None:
        for e in effects:
            match e:
                case verdict.StepScheduler(undoable):
                    self.scheduler_kept = step_scheduler(self.lr_scheduler, self.optimizer, lr_kwargs,
                                                         undoable=undoable)
                case verdict.PutBackScheduler():
                    put_back(self.lr_scheduler, self.optimizer, self.scheduler_kept)
                case verdict.NameSkipped() if scaler.dynamic(self.config):
                    pass  # fp16's overflow: the scaler's business, logged as it moves (log.loss_scale)
                case verdict.NameSkipped(step):
                    first = first_flagged(self.device_verdict.nonfinite(), self.interp.any_rank)
                    log.skipped_step(self, step, None if first is None else self.tables.names[first],
                                     self.device_verdict.norm)

    def grads_zeroed(self) -> None:
        """The user's zero_grad() (the engine's, the model's or the optimizer's): the core drops
        the grads of the backwards since the last step() ([Note: zero_grad in a window],
        fz3/core/grad/epilogue.py)."""
        self._refuse_if_stopped()
        self._end_unreported_backward()
        self.apply(GradsZeroed())

    def was_step_applied(self) -> bool:
        """Whether the last step() stepped the optimizer: False before the first, after a step()
        between boundaries, and after a step skipped for a non-finite grad norm (with the verdict
        on the device, reading it: [Note: the verdict on the device]).
        DeepSpeed: was_step_applied."""
        self.read_verdict(every_rank=False)
        return self.step_applied

    @property
    def loss_scale(self) -> LossScale:
        """fp16's scale record (fz3/core/grad/scaler.py); read off the device where it lives there."""
        if self.device_scale is None:
            return self._loss_scale
        self.read_verdict(every_rank=False)
        return self.device_scale.read()

    @loss_scale.setter
    def loss_scale(self, state: LossScale) -> None:
        self._loss_scale = state
        if self.device_scale is not None:
            self.device_scale = DeviceScale.of(state, self.store.device)

    @property
    def overflow(self) -> bool:
        """The last boundary's grads were not finite (DeepSpeed's optimizer.overflow), read from
        the device if it decided."""
        self.read_verdict(every_rank=False)
        return self._overflow

    @overflow.setter
    def overflow(self, value: bool) -> None:
        self._overflow = value

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the averaged gradient at the last accumulation boundary, before
        clipping; None before the first optimizer step. DeepSpeed: get_global_grad_norm."""
        return None if self.grad_norm is None else float(self.norm_reported)

    def get_lr(self) -> list[float]:
        """Each param group's current learning rate. DeepSpeed: get_lr."""
        self.read_verdict(every_rank=False)  # a skipped step's scheduler put back
        return [group["lr"] for group in self.optimizer.param_groups]

    def generation(self, budget_bytes: Optional[int] = None):
        """A block whose forwards (a decode loop) read the units kept whole within `budget_bytes`
        (None: all) without gathering them: fz3/shell/generation.py."""
        return generation.generation(self, budget_bytes)

    def resident(self):
        """A block with every offloaded optimizer sub-group in memory, written back after it
        (fz3/shell/offload.py): what reads or writes the masters or the optimizer state outside
        a step runs in it."""
        return self.offload.resident() if self.offload is not None else contextlib.nullcontext()

    def stats(self) -> dict[str, object]:
        st = self.params_state
        out: dict[str, object] = {k: self.interp.counts[k] for k in COUNTERS}  # 0 if none yet
        view = replay.view(self.cell)
        out.update(live_numel=st.live_numel, peak_live_numel=st.peak_live_numel,
                   trace=TraceMode(st.trace.mode).name, trace_invalidations=st.trace.invalidations,
                   micro_step=view.grads.micro_step, optimizer_steps=self.optimizer_steps,
                   skipped_steps=self.skipped, loss_scale=self.loss_scale.scale, replayed_events=self.cell.replayed,
                   replay_schedules=len(self.cell.schedules),
                   replay_events_kept=sum(len(s.events) for s in self.cell.schedules),
                   **memory_stats(self), **compile_stats(self),
                   **(self.offload.stats() if self.offload is not None else {}))
        return out

    def param_status(self, param: nn.Parameter) -> str:
        return Status(self.params_state.status(self.param_ids[id(param)])).name


_DTYPE_NAMES: dict[torch.dtype, str] = {}  # a grad's dtype -> its name in GradReady ("float32")


def _cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point():
                module._buffers[name] = b.to(dtype)


def _cast_floating(tree, dtype: torch.dtype):
    if dtype == torch.float32:
        return tree
    leaves, spec = flatten(tree)
    return pytree.unflatten(spec, [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                                   else x for x in leaves])
