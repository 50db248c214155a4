"""Which modules stage3_module_granularity_threshold makes leaves (fz3/core/granularity.py,
[Note: leaf modules by granularity]), drawn: module trees with containers, param-less modules,
empty params, modules with params and children, submodules shared by two parents, and
thresholds around their granularities.

    DeepSpeed's    the choice equals a transcription of DeepSpeed 0.19.8's own methods
                   (runtime/zero/parameter_offload.py), written over nested objects as DeepSpeed
                   writes it: post-order granularity with `>`-kept minimum, pre-order marking
    leaves         no container and no module without params is chosen; each chosen module's
                   granularity is at most the threshold; each is met by the walk from the root
                   through modules not chosen, and every module with params it meets within the
                   threshold is chosen (a shared module may also sit below a chosen one)
    none           nothing is chosen when the smallest granularity is above the threshold, and
                   something is when a module with params is within it (one whose params are all
                   empty has granularity 0 and is never chosen)
Teeth (planted bugs, each caught): containers allowed as leaves; children chosen before their
parent (post-order); every granularity one too large (a module at the threshold left out).
"""
from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fz3.core import granularity
from fz3.core.granularity import Node

CONTAINERS = ("Sequential", "ModuleList", "ModuleDict")


@st.composite
def trees(draw) -> list[Node]:
    """A tree of up to 12 modules (node 0 the root); a later node may be a second parent's
    child too (shared). Own numels 0-40, sometimes an empty param."""
    n = draw(st.integers(1, 12))
    parent = [None] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    children = [[c for c in range(n) if parent[c] == i] for i in range(n)]
    for c in range(2, n):  # a second parent, earlier than the child and not its ancestor's chain twice
        if draw(st.integers(0, 5)) == 0:
            p = draw(st.integers(0, c - 1))
            if c not in children[p] and p != parent[c]:
                children[p].append(c)
    kinds = [draw(st.sampled_from(("Block", "Linear", "Act") + CONTAINERS)) for _ in range(n)]
    own = [draw(st.integers(0, 40)) if kinds[i] != "Act" else 0 for i in range(n)]
    empty = [kinds[i] != "Act" and draw(st.integers(0, 6)) == 0 for i in range(n)]  # a param of numel 0

    def subtree(i, seen):
        for c in children[i]:
            if c not in seen:
                seen.add(c)
                subtree(c, seen)
        return seen

    nodes = []
    for i in range(n):
        below = subtree(i, {i})
        nodes.append(Node(kinds[i], kinds[i] in CONTAINERS, own[i], sum(own[j] for j in below),
                          any(own[j] > 0 or empty[j] for j in below), tuple(children[i])))
    return nodes


class Module:
    """A stand-in for nn.Module: what DeepSpeed's methods read of one."""

    def __init__(self, node: Node) -> None:
        self.node, self.kids, self.leaf = node, [], False

    def children(self):
        return iter(self.kids)


def deepspeed(tree: list[Node], threshold: int):
    """DeepSpeed 0.19.8's _set_z3_leaf_modules_by_threshold, statement for statement."""
    mods = [Module(n) for n in tree]
    for m in mods:
        m.kids = [mods[c] for c in m.node.children]
    state = {"min": sys.maxsize, "min_layer": None, "leaves": []}

    def recurse(module):
        if not module.node.has_params:
            module.g = sys.maxsize
            return 0, 0
        num_layers, num_params = 0, module.node.own
        if not any(module.children()):
            module.g = sys.maxsize
            return 1, num_params
        for child in module.children():
            layers, params = recurse(child)
            num_layers += layers
            num_params += params
        if module.node.cls in CONTAINERS:
            module.g = sys.maxsize
            return num_layers, num_params
        num_layers += 1
        module.g = (num_params // num_layers) if num_params <= 1e9 else sys.maxsize
        if state["min"] > module.g:
            state["min"], state["min_layer"] = module.g, module.node.cls
        return num_layers, num_params

    def preorder(module):
        if module.node.subtree == 0:
            return
        if module.g <= threshold:
            module.leaf = True
            state["leaves"].append(mods.index(module))
            return
        for sub in module.children():
            preorder(sub)

    recurse(mods[0])
    if state["min"] <= threshold:
        preorder(mods[0])
    else:
        state["leaves"] = []
    # (a module under one without params is never reached: DeepSpeed sets no granularity on it)
    return list(dict.fromkeys(state["leaves"])), state["min"], state["min_layer"], \
        [getattr(m, "g", sys.maxsize) for m in mods]


def check(tree: list[Node], threshold: int) -> None:
    got = granularity.leaves(tree, threshold)
    want_leaves, smallest, smallest_class, g = deepspeed(tree, threshold)
    assert list(got.leaves) == want_leaves, f"leaves {got.leaves}, DeepSpeed's {want_leaves}"
    assert (got.smallest, got.smallest_class) == (smallest, smallest_class), "the smallest granularity"
    chosen = set(got.leaves)
    for i in chosen:
        assert not tree[i].container, f"container m{i} chosen"
        assert tree[i].subtree > 0 and g[i] <= threshold, f"m{i}: granularity {g[i]} > {threshold}"
    reach, todo = set(), [0]  # the modules the walk meets: it enters no chosen one
    while todo:
        i = todo.pop()
        if i not in reach:
            reach.add(i)
            todo.extend(tree[i].children if i not in chosen else ())
    assert chosen <= reach, f"chosen below another chosen one only: {chosen - reach}"
    for i in reach - chosen:
        assert tree[i].subtree == 0 or g[i] > threshold, f"m{i} met, granularity {g[i]} <= {threshold}, not chosen"
    if smallest > threshold:
        assert not chosen, "chosen, the smallest granularity above the threshold"
    if any(tree[i].subtree > 0 and g[i] <= threshold for i in range(len(tree))):
        assert chosen, "a module with params within the threshold, and nothing chosen"


@st.composite
def cases(draw):
    tree = draw(trees())
    values = [v for v in granularity.granularities(tree)[0] if v != granularity.NONE] or [1]
    threshold = draw(st.one_of(st.sampled_from(values), st.integers(1, 60)).map(lambda t: t + draw(st.integers(-1, 1))))
    return tree, max(1, threshold)


@settings(max_examples=400, deadline=None)
@given(cases())
def test_the_leaves_are_deepspeeds_choice(case):
    check(*case)


HUNT = settings(max_examples=400, derandomize=True, database=None, deadline=None, phases=(Phase.generate,),
                suppress_health_check=list(HealthCheck))


def _containers_allowed(tree, threshold):
    return _real_leaves([n._replace(container=False) for n in tree], threshold)


def _post_order(tree, threshold):
    real = _real_leaves(tree, threshold)
    return real._replace(leaves=tuple(sorted(real.leaves, reverse=True)))


def _off_by_one(tree):
    g, order = _real_granularities(tree)
    return [v if v == granularity.NONE else v + 1 for v in g], order


_real_leaves, _real_granularities = granularity.leaves, granularity.granularities


@pytest.mark.parametrize("where,fn", [("leaves", _containers_allowed), ("leaves", _post_order),
                                      ("granularities", _off_by_one)],
                         ids=["containers allowed", "children first", "each granularity one too large"])
def test_a_planted_bug_is_caught(monkeypatch, where, fn):
    monkeypatch.setattr(granularity, where, fn)
    with pytest.raises(AssertionError):
        given(cases())(HUNT(lambda case: check(*case)))()
