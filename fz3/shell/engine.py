"""The engine: the shell's mutable cells and the event handlers that drive the core.

    engine(*args)      root pre-forward: reset_step; every registered module:
                       fetch on entry, release on exit (hooks.py)
    engine.backward(loss) / loss.backward()
                       PreBackward -> pre_backward, PostBackward -> post_backward,
                       grad hooks -> bucket_add, end of backward (queue_callback) ->
                       epilogue + finish_backward
    engine.step()      at the accumulation boundary: clip, optimizer.step() on the fp32 master
                       shards, shards refreshed, optimizer_step + end_of_step

Every decision is a core transition; this file only moves events in and effects out, and holds
the only mutable cells: the current ParamState and GradState, the tensor store, the in-flight
handles (in the interpreter) and the forward stack.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import nn

from fz3.core import backward as core_bwd
from fz3.core.config import Config
from fz3.core.epilogue import at_boundary, epilogue, optimizer_step
from fz3.core.fetch import fetch
from fz3.core.grads import bucket_add, init_grad_state
from fz3.core.ids import Status, TraceMode
from fz3.core.release import release
from fz3.core.state import GRADS_REMAINING, STATUS, initial_state
from fz3.core.step import end_of_step, finish_backward, reset_step
from fz3.interpreters.protocol import Interpreter
from fz3.shell import checks, pytree
from fz3.shell.log import StepLog
from fz3.shell.hooks import ParamDict, PostBackward, PreBackward, flatten, wrap_leaves, wrap_tensors
from fz3.shell.memory import memory_stats
from fz3.shell.saved import SavedParams
from fz3.shell.optim import bind_optimizer, check_scheduler, clip_grad_norm, global_grad_norm
from fz3.shell.options import Options
from fz3.shell.store import DTYPES, TensorStore
from fz3.shell.tables import read_tables


COUNTERS = ("all_gather", "all_gather_on_demand", "all_gather_prefetch", "all_gather_via_all_reduce",
            "all_gather_via_native", "all_gather_via_p2p", "gathered_bytes", "reduce",
            "reduce_all_reduce", "reduce_p2p", "reduce_reduce_scatter", "reduced_bytes")
"""The interpreter's counters stats() reports; every key is present, 0 until it first counts."""


class Engine:
    """What `fz3.initialize` returns. Call it like the model."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: Config, *,
                 device, rank: int, world_size: int, interpreter: Callable[[TensorStore], Interpreter],
                 transport=None, lr_scheduler=None, options: Options = Options()) -> None:
        """`interpreter(store)` builds what runs the core's effects on this rank's tensor store
        (fz3/interpreters/protocol.py): DistInterpreter under fz3.initialize, PlanInterpreter under
        fz3.plan. `transport` moves the bytes of the real run's other collectives (consolidation,
        checkpoints' agreement; fz3/interpreters/transport.py); None under fz3.plan. `options`:
        fz3's own switches (fz3/shell/options.py; the interpreter takes the same)."""
        self.module, self.optimizer, self.config, self.device = model, optimizer, config, device
        self.lr_scheduler = check_scheduler(lr_scheduler, optimizer)
        self.grad_norm: torch.Tensor | None = None  # at the last boundary, before clipping
        self.transport, self.options = transport, options
        self.rank, self.world_size = rank, world_size
        self.tables = read_tables(model, world_size=self.world_size, config=config)
        self.spec = self.tables.spec
        self.store = TensorStore(self.tables, rank=self.rank, world_size=self.world_size,
                                 compute_dtype=config.compute_dtype, device=device.torch_device)
        self.interp = interpreter(self.store)
        self.params_state = initial_state(self.spec)
        self.grads_state = init_grad_state(self.spec)
        self.param_ids = {id(p): i for i, p in enumerate(self.tables.params)}
        self.module_ids = {id(m): i for i, m in enumerate(self.tables.modules)}
        self.units = [set(m.params) for m in self.spec.modules]
        self.leaf_params = {p for m in self.spec.modules if m.is_leaf for p in m.params}
        self.stack: list[int] = []
        self.aborted = False  # a forward of this pass raised (see _raised)
        self.leaves_pending: set[int] = set()  # leaf modules run in forward, not yet reduced
        # [Note: inert modules] A module whose own params are all persistent (or that has none: a
        # container) never gathers nor frees, and its externals are pinned to the step's end: its
        # backward would do nothing, so its calls get no autograd nodes (its forward still goes
        # through the core: trace, prefetch). 18 of the small benchmark GPT's 33 calls; ~2.7 ms
        # a step (bench/no_comm_overhead.py, toy). The root and leaf modules always get theirs.
        self.inert = [m > 0 and not ms.is_leaf and all(self.spec.params[p].persistent for p in ms.params)
                      for m, ms in enumerate(self.spec.modules)]
        self.grad_params = [tuple(p for p in ms.params if self.tables.params[p].requires_grad)
                            if not (ms.is_leaf or self.inert[m]) else ()
                            for m, ms in enumerate(self.spec.modules)]
        self.grad_waiters: dict[int, list[int]] = {}  # param -> modules released by its grad
        for m, ps in enumerate(self.grad_params):
            for p in ps:
                self.grad_waiters.setdefault(p, []).append(m)
        self.calls_awaiting_grads: dict[int, int] = {}  # module -> calls with no grad inputs
        self.awaiting_since: dict[int, int] = {}  # such a call -> len(saved.log) at its start
        self.grads_awaited: dict[int, set[int]] = {}  # module -> its params' grads still due
        self.callback_queued = False
        self.optimizer_steps = 0
        self.step_log = StepLog()
        self.saved = SavedParams(self.store, self.tables.names, self.param_ids)
        self.saved_hooks = None  # entered for each root forward
        if config.compute_dtype != "fp32":
            _cast_buffers(model, DTYPES[config.compute_dtype])
        bind_optimizer(optimizer, self.tables.params, self.store.masters)
        self._install()

    # ---- running effects ----------------------------------------------------------------------

    def _params(self, transition, *args, **kwargs) -> None:
        """Run a parameter-lifecycle transition of the core on the current state, then its effects:
        `self._params(fetch, m, forward=True)` is `fetch(self.params_state, m, forward=True,
        config=self.config)`. The one door every transition goes through (fz3.timeline times it)."""
        self.params_state, effects = transition(self.params_state, *args, config=self.config, **kwargs)
        self.interp.run(effects)
        if self.options.debug_checks:
            checks.after_param_event(self.params_state, effects, self.config)

    def _grads(self, transition, *args, **kwargs) -> None:
        """The same for a gradient-lifecycle transition."""
        self.grads_state, effects = transition(self.grads_state, *args, config=self.config, **kwargs)
        self.interp.run(effects)
        if self.options.debug_checks:
            checks.after_grad_event(self.grads_state, self.config)

    # ---- hooks ------------------------------------------------------------------------------

    def _install(self) -> None:
        for m, module in enumerate(self.tables.modules):
            module.register_forward_pre_hook(self._pre_forward, with_kwargs=True, prepend=True)
            module.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
            if not self.spec.modules[m].is_leaf:
                module._parameters = ParamDict(module._parameters, m, self._on_param_read)
        for p, param in enumerate(self.tables.params):
            if param.requires_grad and p not in self.leaf_params:
                param.register_post_accumulate_grad_hook(self._make_grad_hook(p))

    def _pre_forward(self, module, args, kwargs):
        m = self.module_ids[id(module)]
        if m == 0 and torch._C._current_graph_task_id() == -1:  # the root, not recomputed in backward
            self._new_pass(module)
            if self.saved_hooks is None:  # [Note: saved views of gathered params] (saved.py)
                self.saved_hooks = self.saved.context()
                self.saved_hooks.__enter__()
            if self.store.dtype != torch.float32:
                args, kwargs = _cast_floating((args, kwargs), self.store.dtype)
        if self.inert[m]:
            wrapped = False
        else:
            (args, kwargs), wrapped = wrap_tensors((args, kwargs), PostBackward, lambda: self._post_backward(m))
        if not wrapped and torch.is_grad_enabled() and self.grad_params[m]:
            wrapped = True  # released once its own grads are in: see _grads_in
            self.calls_awaiting_grads[m] = self.calls_awaiting_grads.get(m, 0) + 1
            if self.saved_hooks is not None:  # [Note: backward reads no param] (_post_forward)
                self.awaiting_since[m] = len(self.saved.log)
        self._params(fetch, m, forward=True, grad_inputs=int(wrapped))
        if self.options.debug_checks:
            checks.fetched(self.params_state, m)
        if self.spec.modules[m].is_leaf and torch.is_grad_enabled():
            self.leaves_pending.add(m)
        self.stack.append(m)
        return args, kwargs

    def _new_pass(self, root: nn.Module) -> None:
        """The root's pre-forward: a new pass, of the kind grad mode and train mode say. The
        last pass's leftovers are dropped; if it raised (see _raised; or it left its stack
        behind), the core is told so and forgets its partial trace."""
        aborted, self.aborted = self.aborted or bool(self.stack), False
        self.stack.clear()
        self.calls_awaiting_grads.clear()  # a pass with grad but no backward left these
        self.grads_awaited.clear()
        self.awaiting_since.clear()
        self.saved.log.clear()
        self.store.clear_grad_due()  # params no grad reached (or a pass with no backward)
        self.leaves_pending.clear()
        if [p.requires_grad for p in self.tables.params] != self.store.trainable:
            checks.requires_grad_unchanged(self.tables, self.store.trainable)
        self._params(reset_step, grad_enabled=torch.is_grad_enabled(), training=root.training, aborted=aborted)
        self.step_log.new_pass(self)

    def _post_forward(self, module, args, kwargs, output):
        if output is None and sys.exc_info()[1] is not None:
            return self._raised(module)
        m = self.stack.pop()
        leaves, treedef = flatten(output)  # once: for returned params and for wrapping
        found = [self.param_ids[id(t)] for t in leaves if id(t) in self.param_ids]
        if found and self.stack:  # a param returned to the caller: external on the caller
            self._register_external(self.stack[-1], found)
        start = self.awaiting_since.pop(m, None)
        reads_none = start is not None and self.units[m].isdisjoint(self.saved.log[start:])
        if reads_none:  # freed from now on with their shape kept, for AccumulateGrad (store.free)
            self.store.grad_due.update(self.grad_params[m])
        if self.inert[m] or reads_none:
            wrapped = False
        else:
            output, wrapped = wrap_leaves(output, leaves, treedef, PreBackward, lambda: self._pre_backward(m))
        self._params(release, m, grad_outputs=wrapped)
        if reads_none:
            self._backward_reads_none(m)
        if m == 0:
            self._end_saved_hooks()
        return output

    def _backward_reads_none(self, m: int) -> None:
        """[Note: backward reads no param] A call with no grad-requiring input (an embedding on
        token ids) whose forward saved none of its params for backward (the saved-tensor hooks
        saw none: F.embedding saves the ids and the weight's row count) computes its params'
        grads without reading their values. So its backward needs no fetch and its own backward
        bookkeeping is over now, not when its grads arrive (_grads_in): its params are freed as
        soon as no other module needs them. A tied embedding/lm_head weight, which DeepSpeed
        keeps gathered from the lm_head's backward through the embedding's (the last in the
        backward, where autograd holds the lm_head's grad, the embedding's and their sum), is
        freed right after the lm_head's backward."""
        left = self.calls_awaiting_grads.get(m, 0) - 1
        if left < 0:
            return
        if left:
            self.calls_awaiting_grads[m] = left
        else:
            del self.calls_awaiting_grads[m]
        self._params(core_bwd.post_backward, m)

    def _end_saved_hooks(self) -> None:
        if self.saved_hooks is not None and torch._C._current_graph_task_id() == -1:
            self.saved_hooks.__exit__(None, None, None)
            self.saved_hooks = None

    def _raised(self, module: nn.Module) -> None:
        """[Note: a forward that raised] The post-forward hook is registered with always_call,
        so torch calls it (with no output) while an exception leaves the module's forward: a
        shape error in one block, or torch.utils.checkpoint's non-reentrant recompute, which
        stops early by raising once it has recomputed what backward needs. The call is closed
        and its params released as after a normal forward, so nothing stays gathered and the
        forward stack stays true. Outside backward the pass itself is cut short: the next pass
        tells the core (reset_step(aborted=True)) to forget its partial trace."""
        m = self.module_ids[id(module)]
        if not self.stack or self.stack[-1] != m:
            return  # raised in a pre-forward hook before ours pushed this call
        self.stack.pop()
        self.awaiting_since.pop(m, None)
        if torch._C._current_graph_task_id() == -1:
            self.aborted = True
        self._params(release, m)
        if m == 0:
            self._end_saved_hooks()

    def _on_param_read(self, owner: int, param: nn.Parameter) -> None:
        if not self.stack or self.stack[-1] == owner:
            return
        p = self.param_ids[id(param)]
        if p not in self.units[self.stack[-1]]:
            self._register_external(self.stack[-1], [p])

    def _register_external(self, m: int, pids: list[int]) -> None:
        self.units[m].update(pids)
        self._params(core_bwd.register_external, m, tuple(pids))

    def _pre_backward(self, m: int) -> None:
        self._queue_end_of_backward()
        self._params(core_bwd.pre_backward, m)

    def _post_backward(self, m: int) -> None:
        self._queue_end_of_backward()
        if self.spec.modules[m].is_leaf and m in self.leaves_pending and \
                self.params_state.module_rows[m][GRADS_REMAINING] <= 1:  # its last call's backward
            self._reduce_leaf(m)
        self._params(core_bwd.post_backward, m)

    def _reduce_leaf(self, m: int) -> None:
        """A leaf's params are reduced together when its backward is done, zeros standing in
        for grads its experts did not produce on this rank, so every rank reduces the same."""
        self.leaves_pending.discard(m)
        for p in self.spec.modules[m].params:
            param = self.tables.params[p]
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self._grad_ready(p)

    def _make_grad_hook(self, p: int):
        def hook(param: nn.Parameter) -> None:
            self._queue_end_of_backward()
            self._grad_ready(p)
            self._grads_in(p)
            self.store.grad_in(p)
        return hook

    def _grads_in(self, p: int) -> None:
        """[Note: modules without grad inputs] A call whose inputs need no grad (an embedding
        on token ids) never gets a post-backward, so DeepSpeed keeps its params gathered to the
        end of backward: for the token embedding, the largest unit, through the whole backward.
        Its backward is over once its own params' grads are accumulated, so release it then."""
        for m in self.grad_waiters.get(p, ()):
            if m in self.calls_awaiting_grads:
                waiting = self.grads_awaited.setdefault(m, set(self.grad_params[m]))
                waiting.discard(p)
                if not waiting:
                    del self.grads_awaited[m]
                    for _ in range(self.calls_awaiting_grads.pop(m)):
                        self._params(core_bwd.post_backward, m)

    def _grad_ready(self, p: int) -> None:
        grad = self.tables.params[p].grad
        dtype = str(grad.dtype).removeprefix("torch.")
        self._grads(bucket_add, p, dtype=dtype, graph_task=torch._C._current_graph_task_id())

    def _queue_end_of_backward(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self.callback_queued = False
        self.calls_awaiting_grads.clear()
        self.grads_awaited.clear()
        self.store.clear_grad_due()  # params no grad reached (or a pass with no backward)
        for m in sorted(self.leaves_pending):  # no grad-requiring input: post-backward never ran
            self._reduce_leaf(m)
        self._grads(epilogue)
        self._params(finish_backward)
        self.interp.end_of_backward()
        if self.options.debug_checks:
            checks.quiescent(self.params_state)

    # ---- public API -------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """loss.backward(); the grads are summed over ranks and micro-steps and divided once at
        the boundary, by world_size * gradient_accumulation_steps over what each was divided by
        before its reduce (fz3/core/epilogue.py; no loss scaling here)."""
        loss.backward(**kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return at_boundary(self.grads_state, config=self.config)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """At the accumulation boundary: the global grad norm, clipping, the optimizer step on
        the fp32 master shards, then the lr scheduler (`lr_scheduler.step(**lr_kwargs)`). A
        no-op between boundaries, as DeepSpeed's."""
        if not self.is_gradient_accumulation_boundary():
            return
        self.store.bind_grads()
        norm = global_grad_norm(self.store, self.interp.all_reduce_sum)
        if self.config.gradient_clipping > 0:
            clip_grad_norm(self.store, self.config.gradient_clipping, norm)
        self.optimizer.step()
        self.store.refresh_shards()
        self._grads(optimizer_step)
        self._params(end_of_step)
        self.optimizer_steps += 1
        self.grad_norm = norm
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.step_log.step(self)

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the averaged gradient at the last accumulation boundary, before
        clipping; None before the first optimizer step. DeepSpeed: get_global_grad_norm."""
        return None if self.grad_norm is None else float(self.grad_norm)

    def get_lr(self) -> list[float]:
        """Each param group's current learning rate. DeepSpeed: get_lr."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated fp32 params (and buffers), keys as the model's state_dict."""
        from fz3.shell.consolidate import full_state_dict
        return full_state_dict(self)

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None) -> bool:
        """Sharded, atomic checkpoint under save_dir/<tag> (fz3/shell/checkpoint.py).
        DeepSpeed: save_checkpoint."""
        from fz3.shell.checkpoint import save_checkpoint
        return save_checkpoint(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **options) -> tuple[str, dict]:
        """-> (path, client_state); any saved world size; DeepSpeed's load_optimizer_states,
        load_lr_scheduler_states, load_module_only (fz3/shell/checkpoint_load.py).
        DeepSpeed: load_checkpoint."""
        from fz3.shell.checkpoint_load import load_checkpoint
        return load_checkpoint(self, load_dir, tag, **options)

    def stats(self) -> dict[str, object]:
        st = self.params_state
        out: dict[str, object] = {k: self.interp.counts[k] for k in COUNTERS}  # 0 if none yet
        out.update(live_numel=st.live_numel, peak_live_numel=st.peak_live_numel,
                   trace=TraceMode(st.trace.mode).name, trace_invalidations=st.trace.invalidations,
                   micro_step=self.grads_state.micro_step, optimizer_steps=self.optimizer_steps,
                   **memory_stats(self))
        return out

    def param_status(self, param: nn.Parameter) -> str:
        return Status(self.params_state.param_rows[self.param_ids[id(param)]][STATUS]).name


def _cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point():
                module._buffers[name] = b.to(dtype)


def _cast_floating(tree, dtype: torch.dtype):
    leaves, spec = flatten(tree)
    return pytree.unflatten(spec, [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                                   else x for x in leaves])
