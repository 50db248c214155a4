"""Module calls and autograd: the step of each of torch's events, and every decision it takes.

The shell reports torch's events as records (events.py: Enter, Read, Leave, ...), and `update`
runs the step of this file that each names. The param lifecycle (fetch, release, backward.py)
and the grad lifecycle (grads.py, epilogue.py) each take transitions a step below what torch
shows the shell; these steps decide everything between: which calls get autograd nodes, when
a call without grad inputs is over, when a leaf module's grads are reduced, which params a
caller borrows, when the end of backward is queued. Each returns the parameter and gradient
effects for the interpreter and the hook effects (hook_effects.py) for the hook itself.

    enter(m)           Enter: pre-forward        [new pass at the root] wrap inputs? fetch
    read(owner, p)     Read: a call reads p off another module's _parameters   external?
    leave(m)           Leave: post-forward       returned params external on the caller;
                                                 reads none? wrap outputs? release
    raised(m)          Raised: the forward       close the call, release; the pass is cut short
                       raised
    pre_backward(m)    PreBackwardRan            queue end of backward; fetch_for_backward
    post_backward(m)   PostBackwardRan           a leaf's last call: reduce it;
                                                 release_after_backward
    grad_ready(p)      GradReady: p's grad       bucket_add; calls waiting on p's grad: release
                       accumulated
    end_of_backward    BackwardEnded             leaves left, epilogue, finish_backward
    step_called        StepCalled: the user's  off the boundary the micro-step joins the window;
                       step()                    at it ZeroPartitions, AverageGrads
    zero_grad          GradsZeroed: the user's   the grads since the last step() dropped
                       zero_grad()
    stepped            Stepped: at the boundary, finite: StepOptimizer (unused params without a
                       the grad norm known       grad), optimizer_step, end_of_step;
                                                 else SkipStep, the window closed, nothing stale
    hold_ended(pids)   Unhold: the exit of       hold.unhold; stale inside a call: the persistent
                       gathered_parameters       params gathered again

The state is the three lifecycles together (`Lifecycle`); each step is a pure function
`f(state, ..., *, config) -> (state, effects)` as below it (`update` looks them up here when it
runs, so a test may replace one).

The Notes this file cites are at its end.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

from fz3.core.param import backward as core_bwd
from fz3.config.config import COMM_DTYPES, Config
from fz3.core.grad.epilogue import epilogue, micro_step_end, optimizer_step, without_grad, zero_grads
from fz3.core.param.fetch import fetch
from fz3.core.param import hold
from fz3.core.grad.grads import GradError, GradState, bucket_add, new_pass
from fz3.core.hook_effects import (BeginPass, ClearGradDue, EndOfBackward, EndPass, GradDue, GradIn,
                                   QueueEndOfBackward, SkipStep, StepOptimizer, WrapInputs, WrapOutputs,
                                   ZeroGrads)
from fz3.core.ids import ModuleId, ParamId
from fz3.core.pvec import Log
from fz3.core.param.release import release
from fz3.core.spec import ModelSpec, ModuleSpec
from fz3.core.stage import policy
from fz3.core.param.state import ParamState
from fz3.core.param.step import before_step, end_of_step, finish_backward, reset_step

if TYPE_CHECKING:  # each step takes its event's record (events.py imports this file)
    from fz3.core.events import (BackwardEnded, Enter, GradReady, GradsZeroed, Leave, PostBackwardRan, PreBackwardRan,
                                 Raised, Read, StepCalled, Stepped, Unhold)


class CallTables(NamedTuple):
    """What the spec and the trainable flags say about calls, once per model."""

    inert: tuple[bool, ...]  # by module: its calls get no autograd nodes ([Note: inert modules])
    quiet: tuple[bool, ...]  # by module: inert, and no param of the model is ever freed: a call
    # of it inside another call takes no event ([Note: inert modules])
    grad_params: tuple[tuple[ParamId, ...], ...]  # by module: params whose grads end a call
    # without grad inputs (trainable, own; () for leaves and inert modules)
    waiters: dict[ParamId, tuple[ModuleId, ...]]  # param -> modules with it in grad_params
    trainable: tuple[bool, ...]  # by param
    hooked: tuple[bool, ...]  # by param: its grad is reported by a post-accumulate-grad hook
    # (grad_ready); the others trainable are a leaf's own, reduced with it ([Note: leaf modules]),
    # or at_end's
    leaf_own: tuple[ParamId, ...]  # a leaf's own, in id order: trainable, no hook
    leaf_own_of: tuple[tuple[ParamId, ...], ...]  # by module: its leaf_own params (() unless a leaf)
    at_end: tuple[ParamId, ...]  # trainable, of one inert module alone, in id order: no hook,
    # reported at the end of backward ([Note: persistent grads at the end of backward])
    by_grads: tuple[bool, ...]  # by module: its calls wait for its own params' grads, its inputs
    # get no PostBackward node, unless another module borrows one ([Note: released by its grads])


class Frame(NamedTuple):
    """One open forward call."""

    module: ModuleId
    saved_at: int  # length of the saved-param log at its start; -1: its reads are not watched
    # (a call with grad inputs, or no graph recorded)


class Waiting(NamedTuple):
    """A module with calls released by their params' grads ([Note: modules without grad inputs])."""

    module: ModuleId
    calls: int  # calls still open in backward
    due: frozenset[ParamId]  # of its grad params, those whose grads have not come in


class CallState(NamedTuple):
    tables: CallTables  # static
    stack: tuple[Frame, ...]  # forward calls open, innermost last
    aborted: bool  # a forward of this pass raised outside backward: the next pass says so
    waiting: tuple[Waiting, ...]  # by module
    leaves: frozenset[ModuleId]  # leaf modules run with grad in this pass, not yet reduced
    backward: bool  # a backward is running: end_of_backward is queued
    entered: frozenset[ModuleId] = frozenset()  # modules released by their grads (by_grads) called
    # with grad since the pass began or the last backward ended ([Note: released by its grads])


class Lifecycle(NamedTuple):
    """The whole state a rank's engine holds: the three lifecycles."""

    params: ParamState
    grads: GradState
    calls: CallState


def call_tables(spec: ModelSpec, trainable: Sequence[bool], *, hook_all: bool = False) -> CallTables:
    """`hook_all`: every trainable param (but a leaf's own) keeps its grad hook, none is
    reported at the end of backward: where grads wait in param.grad for the boundary ([Note:
    grads at the boundary], fz3/core/grad/grads.py), a .grad left set says nothing about the
    backward that just ran, so only a hook can report it."""
    inert = tuple(m > 0 and not ms.is_leaf and all(spec.params[p].persistent for p in ms.params)
                  for m, ms in enumerate(spec.modules))
    homes: list[list[ModuleSpec]] = [[] for _ in spec.params]
    for ms in spec.modules:
        for p in ms.params:
            homes[p].append(ms)
    alone = [len(h) == 1 for h in homes]
    at_end = () if hook_all else tuple(ParamId(p) for p in range(len(spec.params))
                                       if trainable[p] and alone[p] and inert[homes[p][0].id])
    unhooked = set(at_end)
    hooked = tuple(bool(t) and not (a and h[0].is_leaf) and p not in unhooked
                   for p, (t, a, h) in enumerate(zip(trainable, alone, homes)))
    grad_params = tuple(() if ms.is_leaf or inert[m] else tuple(p for p in ms.params if trainable[p])
                        for m, ms in enumerate(spec.modules))
    waiters: dict[ParamId, list[ModuleId]] = {}
    for m, ps in enumerate(grad_params):
        for p in ps:
            waiters.setdefault(p, []).append(ModuleId(m))
    own_of = tuple(tuple(p for p in ms.params if trainable[p] and not hooked[p]) if ms.is_leaf else ()
                   for ms in spec.modules)
    leaf_own = tuple(sorted(p for ms in own_of for p in ms))
    quiet = inert if not saves_matter(spec) else (False,) * len(inert)
    by_grads = tuple(bool(ms.params) and bool(grad_params[m]) and all(hooked[p] and alone[p] for p in ms.params)
                     for m, ms in enumerate(spec.modules))
    return CallTables(inert, quiet, grad_params, {p: tuple(ms) for p, ms in waiters.items()}, tuple(trainable),
                      hooked, leaf_own, own_of, at_end, by_grads)


def saves_matter(spec: ModelSpec) -> bool:
    """Whether the shell watches what autograd saves in a pass (fz3/shell/saved.py): the log of
    saved params decides when a call that saved none may let its params go ([Note: backward
    reads no param]), and a saved view of a gathered param is kept as a name so that freeing the
    param frees its memory. Both matter only for params a pass frees: with every param
    persistent nothing is freed before the step, and the watch is all cost (393 saves a step
    on the deep narrow GPT, ~1 ms)."""
    return not all(p.persistent for p in spec.params)


def initial_calls(spec: ModelSpec, trainable: Sequence[bool], config: Config | None = None) -> CallState:
    """`config`: its stage decides whether every param keeps its grad hook (`call_tables`)."""
    hook_all = config is not None and policy(config).grads_at_boundary
    return CallState(call_tables(spec, trainable, hook_all=hook_all), (), False, (), frozenset(), False)


def grad_dtype(config: Config) -> str:
    """The dtype of every param's grad: the compute dtype (the store holds params in it)."""
    return COMM_DTYPES[config.compute_dtype]


# ---- forward -------------------------------------------------------------------------------------

def enter(st: Lifecycle, ev: Enter, *, config: Config) -> tuple[Lifecycle, tuple]:
    """Pre-forward of a call of `ev.module` (Enter's fields say what torch showed)."""
    m, grad, grad_inputs, recomputing, saved = ev.module, ev.grad, ev.grad_inputs, ev.recomputing, ev.saved
    params, grads, calls, effects = st.params, st.grads, st.calls, []
    if m == 0 and not recomputing:
        params, eff = reset_step(params, config=config, grad_enabled=grad, training=ev.training,
                                 aborted=calls.aborted or bool(calls.stack), grad_inputs=grad_inputs)
        grads = new_pass(grads)  # [Note: a pass forgets] (fz3/core/replay.py)
        # a backward still marked running never reached its end (it raised): it is over now
        calls = calls._replace(stack=(), aborted=False, waiting=(), leaves=frozenset(), backward=False,
                               entered=frozenset())
        effects += eff + (BeginPass(),)
    if not calls.stack and not recomputing:  # the outermost call: [Note: persistent params stay live]
        params, eff = hold.gather_persistent(params)
        effects += eff
    t = calls.tables
    wrap = grad and grad_inputs and not t.inert[m] and not _by_grads(params, calls, m)
    waits = grad and not wrap and bool(t.grad_params[m])
    if grad and t.by_grads[m]:
        calls = calls._replace(entered=calls.entered | {m})
    if wrap:
        effects.append(WrapInputs(m))
    elif waits:
        calls = calls._replace(waiting=_wait_one_more(calls, m))
    if grad and st.params.spec.modules[m].is_leaf:
        calls = calls._replace(leaves=calls.leaves | {m})
    params, eff = fetch(params, m, forward=True, config=config, grad_inputs=int(wrap or waits))
    frame = Frame(m, saved if waits else -1)
    return Lifecycle(params, grads, calls._replace(stack=calls.stack + (frame,))), tuple(effects) + eff


def _by_grads(params: ParamState, calls: CallState, m: ModuleId) -> bool:
    """[Note: released by its grads] A call of `m` with grad inputs waits for its own params'
    grads: `m`'s own params are all trainable, hooked and its alone, no other module borrows one
    now, and it is `m`'s first call with grad in this pass."""
    return calls.tables.by_grads[m] and m not in calls.entered and \
        not any(params.is_external(p) for p in params.spec.modules[m].params)


def hold_ended(st: Lifecycle, ev: Unhold, *, config: Config) -> tuple[Lifecycle, tuple]:
    """gathered_parameters' exit (hold.unhold). A stale one inside a call frees persistent
    params that the quiet calls still to come in it read without an event: they are gathered
    again at once ([Note: persistent params stay live], fz3/core/param/hold.py)."""
    params, effects = hold.unhold(st.params, ev.params, config=config, stale=ev.stale)
    if ev.stale and st.calls.stack:
        params, eff = hold.gather_persistent(params)
        effects += eff
    return st._replace(params=params), effects


def running(st: Lifecycle) -> ModuleId:
    """The module whose call is innermost open, or -1: a read of its own params changes nothing
    (`read`'s first rule), so the shell does not report those (every module reads its own params
    at each call: 197 events a step on the deep narrow GPT, issue #27)."""
    stack = st.calls.stack
    return stack[-1].module if stack else ModuleId(-1)


def read(st: Lifecycle, ev: Read, *, config: Config) -> tuple[Lifecycle, tuple]:
    """The running call read param `ev.param` off module `ev.owner`'s _parameters
    (nn.MultiheadAttention reads out_proj.weight without calling out_proj): not its own, so it
    borrows it (external). A read by the owner's own running call changes nothing (`running`:
    the shell sends none)."""
    owner, p = ev.owner, ev.param
    stack = st.calls.stack
    if not stack or stack[-1].module == owner:
        return st, ()
    m = stack[-1].module
    if p in st.params.spec.modules[m].params:
        return st, ()
    if ev.grad:  # also when already borrowed (under no_grad, or returned to m without grad): as leave does
        _check_not_leaf_own(st, m, (p,), "reads it")
    if p in st.params.externals(m):
        return st, ()
    params, effects = core_bwd.register_external(st.params, m, (p,), config=config)
    return st._replace(params=params), effects


def leave(st: Lifecycle, ev: Leave, *, config: Config) -> tuple[Lifecycle, tuple]:
    """Post-forward of the call of `ev.module` on top of the stack (Leave's fields say what
    torch showed)."""
    m, grad_outputs, returned, saved = ev.module, ev.grad_outputs, ev.returned, ev.saved
    calls, params, effects = st.calls, st.params, []
    frame, stack = calls.stack[-1], calls.stack[:-1]
    if returned and stack:
        if grad_outputs:
            _check_not_leaf_own(st, stack[-1].module, returned, f"{_name(st, m)} returns it")
        params, eff = core_bwd.register_external(params, stack[-1].module, tuple(returned), config=config)
        effects += eff
    t = calls.tables
    unit = st.params.spec.modules[m].params + params.externals(m)
    reads_none = frame.saved_at >= 0 and saved is not None and \
        set(unit).isdisjoint(saved.since(frame.saved_at))
    if reads_none:
        effects.append(GradDue(t.grad_params[m]))
    # the outermost call always: its backward queues the end ([Note: persistent grads at the end
    # of backward])
    wrap = grad_outputs and not reads_none and (not t.inert[m] or not (stack or ev.recomputing))
    if wrap:
        effects.append(WrapOutputs(m))
    params, eff = release(params, m, config=config, grad_outputs=wrap)
    effects += eff
    calls = calls._replace(stack=stack)
    if reads_none:
        calls, params, eff = _backward_over(calls, params, m, config)
        effects += eff
    if m == 0 and not ev.recomputing:
        effects.append(EndPass())
    return Lifecycle(params, st.grads, calls), tuple(effects)


def raised(st: Lifecycle, ev: Raised, *, config: Config) -> tuple[Lifecycle, tuple]:
    """[Note: a forward that raised] The post-forward hook runs (always_call) while an exception
    leaves the module's forward: a shape error in one block, or torch.utils.checkpoint's
    non-reentrant recompute, which stops early by raising once it has recomputed what backward
    needs. The call is closed and its params released as after a normal forward, so nothing
    stays gathered and the stack stays true. Outside backward the pass itself is cut short: the
    next pass tells the param lifecycle (reset_step(aborted=True)) to forget its partial trace."""
    calls, m, recomputing = st.calls, ev.module, ev.recomputing
    if not calls.stack or calls.stack[-1].module != m:
        return st, ()  # raised in a pre-forward hook before ours opened this call
    calls = calls._replace(stack=calls.stack[:-1], aborted=calls.aborted or not recomputing)
    params, effects = release(st.params, m, config=config)
    if m == 0 and not recomputing:
        effects += (EndPass(),)
    return Lifecycle(params, st.grads, calls), effects


# ---- backward ------------------------------------------------------------------------------------

def pre_backward(st: Lifecycle, ev: PreBackwardRan, *, config: Config) -> tuple[Lifecycle, tuple]:
    """Grads reached the outputs of a call of `ev.module` (its PreBackward node ran): fetch."""
    calls, queued = _in_backward(st.calls)
    params, effects = core_bwd.fetch_for_backward(st.params, ev.module, config=config)
    return Lifecycle(params, st.grads, calls), queued + effects


def post_backward(st: Lifecycle, ev: PostBackwardRan, *, config: Config) -> tuple[Lifecycle, tuple]:
    """The grads of a call's inputs are done (its PostBackward node ran): release. A leaf
    module's last open call reduces its params first ([Note: leaf modules]); `ev.with_grad`:
    its own params (`CallTables.leaf_own_of`) whose .grad is set."""
    m = ev.module
    calls, effects = _in_backward(st.calls)
    grads, ps = st.grads, st.params
    if m in calls.leaves and ps.grads_remaining(m) <= 1 and ps.pre_backward(m) == 0:
        calls, grads, eff = _reduce_leaf(calls, grads, m, config, ev.with_grad)
        effects += eff
    params, eff = core_bwd.release_after_backward(st.params, m, config=config)
    calls, params, eff2 = _end_waiting(calls, params, m, config)
    return Lifecycle(params, grads, calls), effects + eff + eff2


def grad_ready(st: Lifecycle, ev: GradReady, *, config: Config) -> tuple[Lifecycle, tuple]:
    """`ev.param`'s grad was accumulated (its post-accumulate-grad hook, an `ev.dtype` tensor, in
    autograd's `ev.graph_task`): into its bucket; the calls that waited on it may end."""
    p = ev.param
    calls, effects = _in_backward(st.calls)
    grads, eff = bucket_add(st.grads, p, config=config, dtype=ev.dtype, graph_task=ev.graph_task)
    effects += eff
    params = st.params
    for m in calls.tables.waiters.get(p, ()):
        calls, params, eff = _grad_in(calls, params, m, p, config)
        effects += eff
    return Lifecycle(params, grads, calls), effects + (GradIn(p),)


def end_of_backward(st: Lifecycle, ev: BackwardEnded, *, config: Config) -> tuple[Lifecycle, tuple]:
    """Autograd finished the backward: leaves whose post-backward never ran (no grad input) are
    reduced, the persistent params without a hook that got a grad are reported ([Note:
    persistent grads at the end of backward]), the grad epilogue runs, the params are released
    (finish_backward). `ev.with_grad`: the params without a hook (`CallTables.leaf_own`,
    `at_end`) whose .grad is set."""
    calls, grads, with_grad = st.calls, st.grads, ev.with_grad
    _check_no_late_leaf_grad(st, with_grad, config)
    effects: tuple = (ClearGradDue(),)
    for m in sorted(calls.leaves):
        calls, grads, eff = _reduce_leaf(calls, grads, m, config, with_grad)
        effects += eff
    for p in calls.tables.at_end:
        if p in with_grad:
            grads, eff = bucket_add(grads, p, config=config, dtype=grad_dtype(config))
            effects += eff
    grads, eff = epilogue(grads, config=config)
    params, eff2 = finish_backward(st.params, config=config)
    calls = calls._replace(waiting=(), backward=False, entered=frozenset())
    return Lifecycle(params, grads, calls), effects + eff + eff2 + (EndOfBackward(),)


def step_called(st: Lifecycle, ev: StepCalled, *, config: Config) -> tuple[Lifecycle, tuple]:
    """The user called step(): off the accumulation boundary the micro-step joins the window; at
    it the partitions are averaged and `stepped` comes next, once the shell knows the grad norm
    ([Note: the window closes at step()], fz3/core/grad/epilogue.py). `ev.boundary`:
    set_gradient_accumulation_boundary's override, or None; `ev.loss_scale`: fp16's
    (fz3/core/grad/scaler.py)."""
    grads, effects = micro_step_end(st.grads, config=config, override=ev.boundary, loss_scale=ev.loss_scale)
    return st._replace(grads=grads), effects


def zero_grad(st: Lifecycle, ev: GradsZeroed, *, config: Config) -> tuple[Lifecycle, tuple]:
    """The user's zero_grad() (the engine's, the model's or the optimizer's): the grads of the
    backwards since the last step() are dropped ([Note: zero_grad in a window], epilogue.py)."""
    grads, effects = zero_grads(st.grads, config=config)
    return st._replace(grads=grads), effects


def stepped(st: Lifecycle, ev: Stepped, *, config: Config) -> tuple[Lifecycle, tuple]:
    """At the accumulation boundary, the global grad norm known (`ev.finite`: on every rank
    alike). Finite: the optimizer steps (StepOptimizer: every trainable param no grad reached
    in the window left without one), the window closes, every full param is stale. Not
    finite: SkipStep, the window closes, the weights stay ([Note: a step skipped]). None: left to
    the device, the step taken guarded, as a finite one ([Note: the verdict on the device],
    fz3/core/grad/verdict.py).
    `ev.leaf_grads`: the leaf params (`CallTables.leaf_own`) that got a real grad in the window
    on some rank; None: this rank's own (`leaf_grads(st)`), all there is with one rank."""
    grads = st.grads
    if ev.finite is False:
        grads, eff = optimizer_step(grads, config=config, applied=False)
        return Lifecycle(st.params, grads, st.calls), (SkipStep(st.grads.window + 1),) + eff
    params, waited = before_step(st.params)  # [Note: no step over a gather in flight] (param/step.py)
    effects = waited + (StepOptimizer(no_grad_params(st, ev.leaf_grads), guarded=ev.finite is None),)
    grads, eff = optimizer_step(grads, config=config)
    params, eff2 = end_of_step(params, config=config)
    return Lifecycle(params, grads, st.calls), effects + eff + eff2


def no_grad_params(st: Lifecycle, leaf_grads: frozenset[ParamId] | None = None) -> tuple[ParamId, ...]:
    """The trainable params no grad reached in the current window, on any rank: what the step
    leaves without one ([Note: no grad, no step]). `leaf_grads` as `stepped` takes it."""
    got = frozenset(p for p, g in zip(st.calls.tables.leaf_own, leaf_grads_seen(st)) if g) \
        if leaf_grads is None else leaf_grads
    return without_grad(st.grads, st.calls.tables.trainable, got)


def leaf_grads_seen(st: Lifecycle) -> tuple[bool, ...]:
    """By `CallTables.leaf_own`: whether this rank got a real grad (not zeros standing in) for
    the param in the current window. Summed over ranks, what `stepped` takes ([Note: no grad,
    no step])."""
    w, params = st.grads.window, st.grads.params
    return tuple(params[p].got == w for p in st.calls.tables.leaf_own)


# ---- helpers ---------------------------------------------------------------------------------------

def _in_backward(calls: CallState) -> tuple[CallState, tuple]:
    """The first backward event of a backward queues its end."""
    if calls.backward:
        return calls, ()
    return calls._replace(backward=True), (QueueEndOfBackward(),)


def _check_not_leaf_own(st: Lifecycle, m: ModuleId, pids, how: str) -> None:
    """A leaf's own trainable params are reduced with it: one borrowed by another module (with
    grad) would get that module's grad after the reduction ([Note: leaf modules])."""
    t, spec = st.calls.tables, st.params.spec
    for p in pids:
        if t.trainable[p] and not t.hooked[p] and p not in t.at_end:
            leaf = next(ms for ms in spec.modules if p in ms.params)
            raise ValueError(
                f"fz3: param {spec.params[p].name!r} belongs to the leaf module {leaf.name!r} only, and "
                f"module {_name(st, m)} uses it ({how}). A leaf's params are reduced together when its "
                "backward is done, before grads from outside it arrive; give the other module the same "
                f"Parameter (tie it), or do not mark {leaf.name!r} a leaf")


def _check_no_late_leaf_grad(st: Lifecycle, with_grad: frozenset[ParamId], config: Config) -> None:
    """A leaf's own param whose .grad is set at the end of backward while its leaf is reduced
    already got a grad after the reduction ([Note: leaf modules]): it would never be reduced.
    Not where the grad waits in .grad by design: in an open bucket's slot without
    contiguous_gradients (the reduce reads .grad then), or at stages 0 and 1 (for the boundary)."""
    if policy(config).grads_at_boundary:
        return
    t, g = st.calls.tables, st.grads
    pending = {p for m in st.calls.leaves for p in t.leaf_own_of[m]}
    open_slot = set() if config.contiguous_gradients else {s.param for b in g.buckets for s in b.slots}
    late = sorted(p for p in with_grad if p in t.leaf_own and p not in pending and p not in open_slot)
    if late:
        raise GradError(f"fz3: param {st.params.spec.params[late[0]].name!r} of a leaf module got its grad after "
                        "the leaf was reduced; it would never be reduced (an internal error: please report it)")


def _name(st: Lifecycle, m: ModuleId) -> str:
    return repr(st.params.spec.modules[m].name or "<root>")


def _wait_one_more(calls: CallState, m: ModuleId) -> tuple[Waiting, ...]:
    out, found = [], False
    for w in calls.waiting:
        if w.module == m:
            w, found = w._replace(calls=w.calls + 1), True
        out.append(w)
    if not found:
        out.append(Waiting(m, 1, frozenset(calls.tables.grad_params[m])))
    return tuple(out)


def _backward_over(calls: CallState, params: ParamState, m: ModuleId, config: Config):
    """One waiting call of `m` is over before its grads come ([Note: backward reads no param])."""
    for i, w in enumerate(calls.waiting):
        if w.module == m:
            rest = calls.waiting[:i] + ((w._replace(calls=w.calls - 1),) if w.calls > 1 else ()) \
                + calls.waiting[i + 1:]
            params, effects = core_bwd.release_after_backward(params, m, config=config)
            return calls._replace(waiting=rest), params, effects
    return calls, params, ()


def _grad_in(calls: CallState, params: ParamState, m: ModuleId, p: ParamId, config: Config):
    """p's grad came in: one less that the waiting calls of `m` wait for."""
    for i, w in enumerate(calls.waiting):
        if w.module == m and p in w.due:
            calls = calls._replace(waiting=calls.waiting[:i] + (w._replace(due=w.due - {p}),)
                                   + calls.waiting[i + 1:])
            return _end_waiting(calls, params, m, config)
    return calls, params, ()


def _end_waiting(calls: CallState, params: ParamState, m: ModuleId, config: Config):
    """The waiting calls of `m` end (a post_backward each) once their grads are all in and every
    other call of `m` has ended its backward ([Note: modules without grad inputs])."""
    for i, w in enumerate(calls.waiting):
        if w.module == m:
            if w.due or params.grads_remaining(m) != w.calls:
                return calls, params, ()
            effects: tuple = ()
            for _ in range(w.calls):
                params, eff = core_bwd.release_after_backward(params, m, config=config)
                effects += eff
            return calls._replace(waiting=calls.waiting[:i] + calls.waiting[i + 1:]), params, effects
    return calls, params, ()


def _reduce_leaf(calls: CallState, grads: GradState, m: ModuleId, config: Config,
                 with_grad: frozenset[ParamId]):
    """Every trainable param of leaf `m` without a hook into its bucket; zeros stand in for the
    grads that never came (not in `with_grad`)."""
    ps = calls.tables.leaf_own_of[m]
    zeros = tuple(p for p in ps if p not in with_grad)
    effects: tuple = (ZeroGrads(zeros),) if zeros else ()
    for p in ps:
        grads, eff = bucket_add(grads, p, config=config, dtype=grad_dtype(config), stand_in=p not in with_grad)
        effects += eff
    return calls._replace(leaves=calls.leaves - {m}), grads, effects


# ---- Notes --------------------------------------------------------------------------------------
#
# [Note: inert modules] A module whose own params are all persistent (or that has none: a
# container) never gathers nor frees, and its externals are pinned to the step's end: its
# backward would do nothing, so its calls get no autograd nodes. 18 of the small benchmark GPT's
# 33 calls; ~2.7 ms a step (bench/diagnostics/no_comm_overhead.py, toy). The root and leaf modules always get
# theirs.
#
# Where no param is ever freed (every param persistent: `saves_matter` False), a call of an inert
# module inside another call takes no event either (`CallTables.quiet`): its params are live from
# the outermost call's enter on ([Note: persistent params stay live], fz3/core/param/hold.py),
# its enter and leave would change nothing but the stack of open calls, and what it reads nothing
# (nothing to borrow: nothing is freed). The shell sends none (fz3/shell/engine.py,
# `_pre_forward`), and what the calls inside it do is seen as done by the call around it: on the
# deep narrow benchmark GPT 116 of its 117 calls, ~1.3 ms of its forward (issue #27). Not where
# params are freed: there a param such a call reads off the _parameters of the call around it
# would be that call's own read, and that call may free it at its own grads ([Note: modules
# without grad inputs]) while the inert call's backward still needs it (the calls machine found
# it, fz3/testing/calls_machine.py QuietCallsMachine). The outermost call of an inert module
# (called on its own) always takes its events, and its outputs get a PreBackward node ([Note:
# persistent grads at the end of backward]).
#
# [Note: modules without grad inputs] A call whose inputs need no grad (an embedding on token
# ids) never gets a post-backward, so DeepSpeed keeps its params gathered to the end of backward:
# for the token embedding, the largest unit, through the whole backward. Its backward is over
# once its own params' grads are accumulated, so it is released then (`grad_ready`). To the param
# lifecycle such a call has one grad input: the release at its grads is its post_backward. Its
# params are still read by the module's other calls whose input grads are not done (a block
# called once on a grad-requiring input, once not): so the waiting calls end only when every
# other call of the module has ended its backward (its grads remaining are the waiting calls'),
# at the last grad or at that other call's post_backward, whichever comes later.
#
# [Note: released by its grads] The same holds for a call whose inputs need grad, where every
# own param of its module is trainable, hooked and its alone (`CallTables.by_grads`), and no
# other module borrows one (an external elsewhere, `_by_grads`): its backward's last read of
# a param comes before that param's grad is accumulated. An op that reads a trainable
# param for backward has an edge to it (the grad of its input and the grad of the param come
# from one node: Linear's addmm, LayerNorm's native_layer_norm), so autograd runs it before the
# param's AccumulateGrad, whose hook reports the grad. So such a call waits for its own grads
# as a call without grad inputs does, and its inputs get no PostBackward node: one autograd
# Function and one event less per call (98 a step on the deep narrow benchmark GPT with every
# param sharded, issue #48), and the params go back as soon as their grads are in, where the
# node ran after the input grads too. A param read for backward through a detached alias (no
# edge) would be read after the release: the saved-tensor watch (fz3/shell/saved.py) raises,
# naming it, rather than read freed memory. A module with a frozen or unhooked own param (a
# leaf's, or one reported at the end of backward) keeps the node: no grad tells when its
# backward is done. So does a module's second call with grad in a pass (an ALBERT block applied
# k times; `CallState.entered`): its params' grads come once every call's backward is done, so
# waiting for them would hold the unit from the last call's backward to the first's, where each
# call's node releases what that call fetched ([Note: release per call], fz3/core/param/
# backward.py); the first call alone waits, and its backward is the last. And so does one with
# a param another module uses too (tied, or borrowed): that param's grad comes once the other
# module's backward is done as well, which can be the end of backward (a tied lm_head's weight
# is the token embedding's; the parity test's tiny live budget found it), and the call would
# hold its unit that long. A param that gets no grad in a backward leaves its call waiting to
# the end of backward, as DeepSpeed releases a call without a post-backward.
#
# [Note: backward reads no param] Such a call whose forward saved none of its params for backward
# (the saved-tensor hooks logged none: F.embedding saves the ids and the weight's row count)
# computes its params' grads without reading their values. So its backward needs no fetch and its
# backward bookkeeping is over at its post-forward: its params are freed as soon as no other
# module needs them, with their shape kept for AccumulateGrad (GradDue). A tied embedding /
# lm_head weight, which DeepSpeed keeps gathered from the lm_head's backward through the
# embedding's, is freed right after the lm_head's backward.
#
# [Note: persistent grads at the end of backward] A param of one inert module alone (persistent,
# then) gets no grad hook: autograd's hook, the event and the core's door cost ~5 us a param, and
# 195 of the deep narrow benchmark GPT's 196 params are such (issue #27). Its grad is reported at
# the end of backward when its .grad is set (`with_grad`), in id order: it is never freed, and no
# call waits for it (an inert call never waits: `grad_params`; a persistent param of a module
# that is not inert keeps its hook, since a call of that module without grad inputs ends when
# all its grads are in). A reduce at the end of backward is what the hold path does with a small
# grad anyway. It is reported like a hooked param, not as a leaf's: only when it got a grad, so a
# grad on one rank only is still a reduce the other ranks do not issue, a DivergenceError ([Note:
# no grad, no step], epilogue.py). The price: its grad waits in .grad until then (on a carrier
# that copies grads into buckets, the persistent params' grads, small by the threshold's design,
# live to the end of backward), and it is not reduced while the backward still runs. A tied
# param (two modules) keeps its hook. The outermost call always gets a PreBackward node, so a
# backward through a call of inert modules alone still queues its end. A backward that meets no
# fz3 node and no hooked param (one started from the output of an inert call inside another: the
# calls machine found it) queues none: the engine sees the unhooked grads left in .grad and
# sends that BackwardEnded itself: right after engine.backward, or, after a bare
# loss.backward(), at step() or at the next outermost call's pre-forward (so each such backward
# still counts as one micro-step). Left open: a bare one followed by another backward with no
# forward or step between (retain_graph); the second's end takes both backwards' grads as one
# micro-step, since by its first event its own grads may already be in the same .grad. And a
# .grad set by hand on such a param (not a ZeRO-3 grad in DeepSpeed either) is taken for a
# backward that sent no end: nothing tells the two apart without a hook on every such param.
#
# [Note: leaf modules] A leaf module's own params (in no other module) get no grad hooks: its
# calls' backwards may each add to them (a MoE block's experts), so they are reduced together
# once the backward of all its calls is done: at the post_backward of its last call with grad
# inputs when no call still waits for its pre_backward (a call without grad inputs never gets a
# post_backward, and its backward may come after: calls.py once reduced the leaf before it), else
# at the end of backward. Zeros stand in for grads its experts did not produce on this rank, so
# every rank reduces the same. A leaf param that is also another module's (tied) gets a hook
# like any param, which torch fires once every use added to it. One that a module borrows at run
# time (returned out of the leaf, or read off it) would get grads after the leaf's reduction:
# refused with an error naming it. The shell says which of the leaf's params hold a grad when
# the leaf may be reduced (`with_grad`, what torch shows it); the others get zeros (ZeroGrads),
# reported as stand-ins, not as grads ([Note: no grad, no step], epilogue.py).
