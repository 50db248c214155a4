"""The shell's autograd hooks (fz3/shell/hooks.py), without processes: pytrees in, pytrees out."""
from collections import namedtuple

import torch

from fz3.shell.hooks import PostBackward, PreBackward, wrap_tensors

Pair = namedtuple("Pair", "a b")


def test_wrap_keeps_structure_none_and_non_tensors():
    x = torch.ones(3, requires_grad=True)
    tree = {"h": x * 2, "gate": None, "k": 3, "pair": Pair(x + 1, None), "t": (torch.zeros(2), "s")}
    calls = []
    out, wrapped = wrap_tensors(tree, PreBackward, lambda: calls.append(1))
    assert wrapped and out["gate"] is None and out["k"] == 3 and out["t"][1] == "s"
    assert isinstance(out["pair"], Pair) and out["pair"].b is None
    assert out["t"][0] is tree["t"][0]  # no grad: passed through untouched
    (out["h"].sum() + out["pair"].a.sum()).backward()
    assert calls == [1]  # one node per call, run once
    assert torch.equal(x.grad, torch.full((3,), 3.0))


def test_wrap_keeps_identity_of_a_tensor_passed_twice():
    """mha(h, h, h): inside, `query is key` must still hold (packed self-attention path)."""
    h = torch.randn(2, 3, requires_grad=True)
    (q, k, v), wrapped = wrap_tensors((h, h, h), PostBackward, lambda: None)
    assert wrapped and q is k is v and q is not h
    (q * k).sum().backward()
    torch.testing.assert_close(h.grad, 2 * h.detach())


def test_wrap_nothing_to_wrap():
    tree = (torch.ones(2), None, "x")
    assert wrap_tensors(tree, PreBackward, lambda: None) == (tree, False)
    with torch.no_grad():
        x = torch.ones(2, requires_grad=True)
        assert wrap_tensors((x,), PreBackward, lambda: None)[1] is False


def test_apply_skips_torchs_signature_binding(monkeypatch):
    """PreBackward.apply is torch's minus inspect.signature(forward).bind (~45 µs a call)."""
    import inspect

    def no_signature(*args, **kwargs):
        raise AssertionError("inspect.signature called on the hot path")
    monkeypatch.setattr(inspect, "signature", no_signature)
    x = torch.ones(3, requires_grad=True)
    calls = []
    (y,) = PreBackward.apply(lambda: calls.append(1), x * 2)
    y.sum().backward()
    assert calls == [1] and torch.equal(x.grad, torch.full((3,), 2.0))


def test_apply_under_a_functorch_transform_uses_setup_context():
    calls = []
    grad = torch.func.grad(lambda x: PostBackward.apply(lambda: calls.append(1), x * 3)[0].sum())
    assert torch.equal(grad(torch.ones(2)), torch.full((2,), 3.0))
    assert calls == [1]



def test_a_wrapped_output_takes_in_place_ops():
    """A module's output the engine wrapped can be changed in place, as any tensor (the HF
    Trainer's `loss *= num_processes`), and the grads are the plain ones."""
    import copy

    import fz3
    from fz3 import launch

    def fn(rank, world):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        ref = copy.deepcopy(model)
        engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), fz3.Config())
        x = torch.ones(2, 3)
        out = engine(x)  # the root's output, wrapped
        out *= 3.0
        engine.backward(out.sum())
        engine.step()
        (ref(x).sum() * 3.0).backward()
        return engine.get_global_grad_norm(), torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()
    ours, plain = launch.run_threads(fn, world_size=1)[0]
    assert abs(ours - plain) <= 1e-6 * plain


def test_one_output_gets_a_pre_hook_that_runs_before_its_node():
    """[Note: a pre-hook for one output] the output comes back as it is; the hook runs once,
    when the grads reach the node, before the node computes (w's grad not in yet)."""
    from fz3.shell.hooks import before_backward
    w = torch.ones(3, requires_grad=True)
    y = w * 2
    seen = []
    out = before_backward(y, lambda: seen.append(w.grad))
    assert out is y
    y.sum().backward()
    assert seen == [None] and torch.equal(w.grad, torch.full((3,), 2.0))


def test_a_view_output_is_hooked_on_its_base_node_and_survives_an_inplace_op():
    """A Linear's output on a 3-d input is a view; an in-place op on it (the caller's
    `h *= 2`) replaces the view's node, and the base's node, hooked, still runs first."""
    from fz3.shell.hooks import before_backward
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 3, 4)
    y = lin(x)
    assert y._is_view()
    seen = []
    out = before_backward(y, lambda: seen.append(lin.weight.grad))
    assert out is y
    y *= 2
    y.sum().backward()
    assert seen == [None] and lin.weight.grad is not None


def test_outputs_of_two_nodes_or_a_leaf_pass_through_one_prebackward_node():
    from fz3.shell.hooks import before_backward
    w = torch.ones(3, requires_grad=True)
    a, b = w * 2, w + 1
    calls = []
    out = before_backward((a, b), lambda: calls.append(1))
    assert out[0] is not a and type(out[0].grad_fn).__name__ == "PreBackwardBackward"
    (out[0].sum() + out[1].sum()).backward()
    assert calls == [1]
    out = before_backward(w, lambda: None)  # a leaf: no node of its own
    assert out is not w and type(out.grad_fn).__name__ == "PreBackwardBackward"
    with torch.no_grad():
        y = w * 2
        assert before_backward(y, lambda: None) is y  # no grad: nothing to hook
