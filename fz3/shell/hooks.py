"""The hooks that turn module calls and autograd into core events.

    pre-forward   (every registered module)  wrap grad inputs in PostBackward, fetch
    post-forward                             externals in outputs, a pre-hook on the node of
                                             the outputs (or wrap them in PreBackward), release
    PreBackward.backward   grads reached a forward call's outputs  -> pre_backward (fetch)
      (or that pre-hook)
    PostBackward.backward  grads of a forward call's inputs done    -> post_backward (release)
    ParamDict.__getitem__  a module reads a param it does not own (nn.MultiheadAttention reads
                           out_proj.weight without calling out_proj) -> register_external

Both autograd Functions are identities over the tensors they wrap, written in the forward +
setup_context form. DeepSpeed uses the same two Functions (PreBackwardFunctionForModule,
PostBackwardFunctionModule); FSDP2's RegisterPostBackwardFunction is the second.
[Note: why not register_full_backward_hook] Module backward hooks fire unreliably with
multiple outputs, in-place ops and params without grads (seed article 4.2); a Function node
sits in the graph itself, so autograd runs it exactly when the grads it wraps are ready.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._functorch.utils import unwrap_dead_wrappers

from fz3.shell import pytree


class PreBackward(torch.autograd.Function):
    """Identity on a forward call's outputs; its backward fetches the module's params.

    forward returns each tensor detached, not as it came: a tensor a Function returns as-is is
    a view of its input to autograd, and an in-place op on it (`loss *= n`, as the HF Trainer's
    compute_loss does) is an error. A detached tensor shares the storage and the version
    counter, so a tensor saved for backward that an in-place op overwrites is still caught.
    DeepSpeed: PreBackwardFunctionForModule.forward (`outputs.detach()`)."""

    @staticmethod
    def forward(on_backward: Callable[[], None], *tensors: torch.Tensor):
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.on_backward = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward()
        return (None, *grads)

    @classmethod
    def apply(cls, *args):
        """torch's Function.apply without its per-call inspect.signature(forward).bind(...):
        forward takes positionals only and has no defaults, so the binding changes nothing, and
        it cost ~38 us of each call (bench/diagnostics/apply_cost.py: 8.9 against 46.6 us). Under a functorch
        transform torch's own apply runs, which routes through setup_context."""
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))


class PostBackward(PreBackward):
    """Identity on a forward call's inputs; its backward runs when their grads are done, after
    every op of the call: the module's params may be released then."""


ONE_ARG = pytree.flatten(((None,), {}))[1]
"""The spec of a call's (args, kwargs) with one positional argument, a tensor, and no keywords:
most module calls (every Linear and LayerNorm of a transformer)."""


def flatten(tree: Any) -> tuple[list, Any]:
    """A structure's leaves and its spec: tuple, list, dict, namedtuple, dataclass, ModelOutput,
    any type registered with torch.utils._pytree, nested (fz3/shell/pytree.py)."""
    if isinstance(tree, torch.Tensor):
        return [tree], None  # the common cases, without the walk: an output, ...
    if type(tree) is tuple and len(tree) == 2:  # ... and a call's (args, kwargs) of one tensor
        args, kwargs = tree
        if type(args) is tuple and len(args) == 1 and type(kwargs) is dict and not kwargs \
                and isinstance(args[0], torch.Tensor):
            return [args[0]], ONE_ARG
    return pytree.flatten(tree)


def needs_grad(leaves: list) -> bool:
    """Some tensor among a pytree's leaves requires grad (whether or not grad mode is on)."""
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)


def before_backward(tree: Any, on_backward: Callable[[], None], flat: tuple[list, Any] | None = None) -> Any:
    """WrapOutputs: `on_backward` runs once autograd has the grads of the call's outputs, before
    it computes anything of the call. [Note: a pre-hook for one output] Where every
    grad-requiring output comes from one autograd node, that is a pre-hook on the node, and the
    outputs are returned as they are; else the outputs pass through one PreBackward node. Same moment: autograd runs a node's pre-hooks once all its grads are in,
    which is when the PreBackward node before it would run. Cheaper: a pre-hook costs ~7 us
    a call forward and backward where the Function costs ~19 (bench/diagnostics/apply_cost.py),
    and most calls return one tensor (98 a step on the deep narrow benchmark GPT, issue #48).
    For a view (a Linear's output on a 3-d input is one) the node is its base's: an in-place
    op on the view replaces the view's own node, which then never runs, but autograd still
    runs the base's node after the op's; the view's node between them computes nothing of
    the call. `flat`: `flatten(tree)`, if made (its leaves are consumed). -> the outputs."""
    leaves, treedef = flat if flat is not None else flatten(tree)
    node = _one_node(leaves)
    if node is not None:
        node.register_prehook(lambda grads: on_backward())
        return tree
    return wrap_leaves(tree, leaves, treedef, PreBackward, on_backward)[0]


def _one_node(leaves: list):
    """The autograd node every grad-requiring tensor among `leaves` comes from (a view's: its
    base's), if there is one, grad is on and no functorch transform is active; else None."""
    if not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        return None
    node = None
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            fn = x._base.grad_fn if x._is_view() else x.grad_fn
            if fn is None or (node is not None and fn is not node):
                return None
            node = fn
    return node


def wrap_tensors(tree: Any, fn: type[torch.autograd.Function], on_backward: Callable[[], None],
                 flat: tuple[list, Any] | None = None) -> tuple[Any, bool]:
    """Pass the grad-requiring tensors of a pytree (non-tensor leaves kept) through one `fn`
    node. `flat`: `flatten(tree)` if the caller has it (its leaves are consumed). -> (new tree,
    whether any was wrapped)."""
    return wrap_leaves(tree, *(flat if flat is not None else flatten(tree)), fn, on_backward)


def wrap_leaves(tree: Any, leaves: list, treedef: Any, fn: type[torch.autograd.Function],
                on_backward: Callable[[], None]) -> tuple[Any, bool]:
    """`wrap_tensors` on a tree already flattened (`leaves` is consumed)."""
    if len(leaves) == 1 and (treedef is None or treedef is ONE_ARG):  # one tensor: [Note: identity] holds
        x = leaves[0]
        if not (isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()):
            return tree, False
        out = fn.apply(on_backward, x)[0]
        return (out if treedef is None else ((out,), {})), True
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx or not torch.is_grad_enabled():
        return tree, False
    # [Note: identity] A tensor passed twice (mha(h, h, h)) goes through the node once and
    # comes back as one tensor, so `query is key` still holds inside the module
    # (nn.MultiheadAttention then takes its packed self-attention path, as it would unwrapped).
    slot: dict[int, int] = {}
    for i in idx:
        slot.setdefault(id(leaves[i]), len(slot))
    distinct = list({id(leaves[i]): leaves[i] for i in idx}.values())
    out = fn.apply(on_backward, *distinct)
    for i in idx:
        leaves[i] = out[slot[id(leaves[i])]]
    return pytree.unflatten(treedef, leaves), True


class ParamDict(dict):
    """A registered module's `_parameters`: reading a param during some *other* module's
    forward tells the shell, which registers it as an external param of the running module.
    `running[0]` is the module whose call is innermost open, -1 outside every call
    (fz3.core.calls.running, kept by the engine; None when a call opened or closed since it was
    last looked up: `resolve()` looks it up): a read by the owner's own call, or by no call, is
    told nothing, the core would do nothing with it. DeepSpeed: ZeROOrderedDict."""

    def __init__(self, params: dict, module_id: int, on_read: Callable[[int, torch.nn.Parameter], None],
                 running: list, resolve: Callable[[], int]):
        super().__init__(params)
        self.module_id, self.on_read, self.running, self.resolve = module_id, on_read, running, resolve

    def __getitem__(self, name: str):
        p = dict.__getitem__(self, name)
        if p is not None:
            running = self.running[0]
            if running is None:
                running = self.resolve()
            if running != self.module_id and running >= 0:
                self.on_read(self.module_id, p)
        return p
