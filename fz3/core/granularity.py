"""Which modules DeepSpeed's `stage3_module_granularity_threshold` makes leaf modules.

    leaves(tree, threshold) -> Choice(leaves, smallest, smallest_class)

[Note: leaf modules by granularity] A model of many small modules pays ZeRO-3's per-module work
(hooks, core events, autograd nodes) on every one of them: the deep narrow GPT of issue #48
spends more in it than in its compute. DeepSpeed's answer (PR #6649, "fast sharding") is a
threshold: a module whose granularity, its subtree's param count over its count of layers, is
at most the threshold becomes a leaf module, one fetch unit with no hooks below it. Read off
DeepSpeed 0.19.8 (runtime/zero/parameter_offload.py `_get_granularity_recursively`,
`_set_leaf_by_threshold_preorder`), rule for rule:

    a module with no param in its subtree        granularity "none"; 0 layers (and one whose
                                                 params are all empty is never made a leaf)
    a torch leaf (no children)                   granularity "none"; 1 layer, its own params
    a container (nn.Sequential, ModuleList, ...) granularity "none"; its children's layers
    any other module                             its children's layers + 1; granularity
                                                 params // layers (params: its own plus its
                                                 children's sums, so a param two children hold
                                                 counts twice), "none" above 1e9 params

Leaves are chosen top down: a module with params whose granularity is at most the threshold is
a leaf and its subtree is not looked at further; else its children are looked at. Nothing is
chosen unless the smallest granularity is at most the threshold; then DeepSpeed logs a warning
naming the smallest (its class and value), which `smallest` carries here for the shell's log.
A module reached twice (a submodule shared by two parents) is looked at once per path, as
DeepSpeed walks `children()`; a leaf is a leaf wherever it is met.

The tree is the shell's description of the nn.Module tree (fz3/shell/tables.py `granular`):
nodes by index, the root 0, each with its class name, whether torch counts it a container,
its own params' numel and its children. It is numbers only, so the property tests draw trees
(property_tests/test_granularity_properties.py) and the record of DeepSpeed's own choices on
real models (tests/data/deepspeed_granularity_0.19.8.json) holds it to DeepSpeed's.
"""
from __future__ import annotations

import sys
from typing import NamedTuple, Optional, Sequence

NONE = sys.maxsize  # DeepSpeed's granularity of a module that can never be a leaf
MAX_LEAF_PARAMS = 10 ** 9  # DeepSpeed's Z3_MAX_LEAF_SIZE: no leaf holds more params than this


class Node(NamedTuple):
    cls: str  # the module's class name
    container: bool  # its class is one of torch.nn.modules.container's (Sequential, ModuleList, ...)
    own: int  # the numel of its own params (parameters(recurse=False))
    subtree: int  # the numel of every distinct param of its subtree (parameters())
    has_params: bool  # its subtree has a param, of any numel (DeepSpeed asks `list(parameters())`)
    children: tuple[int, ...]  # node indices, in children() order


class Choice(NamedTuple):
    leaves: tuple[int, ...]  # node indices, in the order the walk chose them
    smallest: int  # the smallest granularity of the tree (NONE if no module has one)
    smallest_class: Optional[str]  # the class of the first module given it (children first)


def granularities(tree: Sequence[Node]) -> tuple[list[int], list[int]]:
    """Each node's granularity (NONE where it can have none), as DeepSpeed computes it, and the
    nodes given one, in the order DeepSpeed computes them (children first)."""
    out, order = [NONE] * len(tree), []

    def visit(i: int) -> tuple[int, int]:  # -> (layers, params) of the subtree, as DeepSpeed counts
        node = tree[i]
        if not node.has_params:
            out[i] = NONE
            return 0, 0
        if not node.children:
            out[i] = NONE
            return 1, node.own
        layers, params = 0, node.own
        for c in node.children:
            cl, cp = visit(c)
            layers, params = layers + cl, params + cp
        if node.container:
            out[i] = NONE
            return layers, params
        layers += 1
        out[i] = params // layers if params <= MAX_LEAF_PARAMS else NONE
        order.append(i)
        return layers, params

    if tree:
        visit(0)
    return out, order


def leaves(tree: Sequence[Node], threshold: int) -> Choice:
    """The modules `threshold` makes leaves (none at 0, DeepSpeed's default: it is off)."""
    if threshold <= 0 or not tree:
        return Choice((), NONE, None)
    g, order = granularities(tree)
    smallest, smallest_class = NONE, None
    for i in order:  # the first of the smallest, as DeepSpeed's strict `>` keeps it
        if g[i] < smallest:
            smallest, smallest_class = g[i], tree[i].cls
    if smallest > threshold:
        return Choice((), smallest, smallest_class)
    chosen: dict[int, None] = {}  # in the order first chosen; a shared module once

    def walk(i: int) -> None:
        if tree[i].subtree == 0:
            return
        if g[i] <= threshold:
            chosen[i] = None
            return
        for c in tree[i].children:
            walk(c)

    walk(0)
    return Choice(tuple(chosen), smallest, smallest_class)
