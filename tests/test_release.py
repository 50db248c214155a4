"""release: free what nobody needs, keep what is reused soon (fz3/core/param/release.py).

The tied embedding / lm_head case: `emb` and `head` share emb.w; between them `l1` holds 55
elements. On a COMPLETE trace, release(emb) keeps emb.w iff 55 < max_reuse_distance and the
keep leaves live numel within max_live_parameters.
"""
from __future__ import annotations

import pytest

from fz3.config.config import Config
from fz3.core.effects import AllGather, Free, Wait
from fz3.core.param.fetch import fetch
from fz3.core.ids import TraceMode
from fz3.core.param.release import release
from fz3.core.param.step import reset_step
from tests.support.driver import Driver

HUGE = 10**9
TIED = ([("emb.w", 100), ("l1.w", 50), ("l1.b", 5)],
        [("", [], False), ("emb", [0], False), ("l1", [1, 2], False), ("head", [0], False)])


def cfg(reuse=HUGE, live=HUGE, bucket=0, threshold=0):
    return Config(prefetch_bucket_size=bucket, max_live_parameters=live, max_reuse_distance=reuse,
                  param_persistence_threshold=threshold)


def tied_pass(d: Driver) -> list[list]:
    """reset + root[emb, l1, head]: effects of fetch/release per call (root's first and last)."""
    d(reset_step)
    return d.forward([[0, [1, 2, 3]]], inputs=0)


# (max_reuse_distance, max_live_parameters) -> (release emb, fetch head, release head) in the
# COMPLETE pass; each pass's handles count from 0: emb gathers with 0 and l1 with 1.
TIED_CASES = [
    ("distance 0: free, gather again", 0, HUGE,
     [[Free((0,), True)], [AllGather(2, (0,), False, True), Wait(2)], [Free((0,), True)]]),
    ("distance 55 = the gap: not strictly within", 55, HUGE,
     [[Free((0,), True)], [AllGather(2, (0,), False, True), Wait(2)], [Free((0,), True)]]),
    ("distance 56: kept for head", 56, HUGE, [[], [], [Free((0,), True)]]),
    ("distance huge: kept", HUGE, HUGE, [[], [], [Free((0,), True)]]),
    ("kept within budget 155", HUGE, 155, [[], [], [Free((0,), True)]]),
    ("budget 99 < 100 live: the keep is dropped", HUGE, 99,
     [[Free((0,), True)], [AllGather(2, (0,), False, True), Wait(2)], [Free((0,), True)]]),
]


@pytest.mark.parametrize("why,reuse,live,expected", TIED_CASES, ids=[c[0] for c in TIED_CASES])
def test_tied_embedding_reuse(why, reuse, live, expected):
    d = Driver(*TIED, config=cfg(reuse=reuse, live=live))
    first = tied_pass(d)
    assert first[2] == [Free((0,), True)]  # RECORD pass: no plan, no keeping (the backward gathers it)
    got = tied_pass(d)
    assert d.st.trace.mode is TraceMode.COMPLETE
    assert [got[2], got[5], got[6]] == expected
    assert got[4] == [Free((1, 2), True)]  # l1's params are used once in forward


def test_release_keeps_params_of_other_active_modules():
    """A parent and its child share `shared`: the child's release frees only its own."""
    d = Driver([("shared", 4), ("own", 4)], [("", [0], False), ("child", [0, 1], False)],
               config=cfg())
    d(reset_step)
    d(fetch, 0, forward=True)
    d(fetch, 1, forward=True)
    assert d.st.params[0].users == 2
    assert d(release, 1) == [Free((1,))]
    assert d.statuses() == "AN" and d.st.params[0].users == 1
    assert d(release, 0) == [Free((0,))]


def test_persistent_params_are_not_released():
    d = Driver([("bias", 3), ("w", 4)], [("", [], False), ("m", [0, 1], False)],
               config=cfg(threshold=3))
    d(reset_step)
    d(fetch, 1, forward=True)
    assert d(release, 1) == [Free((1,))]
    assert d.statuses() == "AN" and d.live == 3


def test_release_of_inactive_module_is_a_no_op():
    d = Driver(*TIED, config=cfg())
    d(reset_step)
    before = list(d.st.params)
    assert d(release, 1) == []
    assert list(d.st.params) == before
    d(fetch, 1, forward=True)
    assert d(release, 1) == [Free((0,))]
    assert d(release, 1) == []  # a second release finds the module inactive


def test_grad_outputs_counts_one_backward_fetch():
    d = Driver(*TIED, config=cfg())
    d(reset_step)
    d(fetch, 1, forward=True)
    d(release, 1, grad_outputs=True)
    assert d.st.modules[1].pre_backward == 1


def test_param_prefetched_for_a_later_step_is_kept():
    """Y's param was prefetched for W (a later step) once X's walk had passed Y's entry while X
    held it: Y's release keeps it for W even with reuse distance 0. Steps: root, X(p0), V(p1),
    Y(p0), U(p2), W(p0); the plan's offsets 0, 4, 8, 12, 13, the reach 6 elements."""
    d = Driver([("p0", 4), ("p1", 4), ("p2", 1)],
               [("", [], False), ("X", [0], False), ("V", [1], False), ("Y", [0], False),
                ("U", [2], False), ("W", [0], False)], config=cfg(reuse=0, bucket=6))
    d(reset_step)
    d.forward([[0, [1, 2, 3, 4, 5]]], inputs=0)  # RECORD: handles 0..4; the next pass counts from 0 again
    d(reset_step)
    got = d.forward([[0, [1, 2, 3, 4, 5]]], inputs=0)
    root, x, x_rel, v, v_rel, y, y_rel, u, u_rel, w, w_rel, root_rel = got
    assert root == [AllGather(0, (0, 1), True, True)]
    assert x == [Wait(0)] and x_rel == [Free((0,), True)]  # its walk passed Y's p0, still gathered
    assert v == [AllGather(1, (0, 2), True, True)]  # p2 for U, and p0 again, for W at step 5
    assert y == [Wait(1)] and y_rel == []  # kept: it was prefetched for step 5
    assert w == [] and w_rel == [Free((0,), True)]


def test_free_says_whether_the_module_fetches_again_in_this_pass():
    """Free.refetch: a forward release of a module whose backward will fetch it (outputs wrapped)
    lets an interpreter keep the memory for that gather; any other release gives it back."""
    from fz3.core.param.backward import fetch_for_backward, release_after_backward
    d = Driver(*TIED, config=cfg(reuse=0))
    d(reset_step)
    d(fetch, 2, forward=True, grad_inputs=1)
    assert d(release, 2, grad_outputs=True) == [Free((1, 2), refetch=True)]
    d(fetch, 1, forward=True)
    assert d(release, 1) == [Free((0,), refetch=False)]  # no backward fetch: next pass's
    assert d(fetch_for_backward, 2)[-1:] == [Wait(2)]
    assert d(release_after_backward, 2) == [Free((1, 2), refetch=False)]  # its backward is over


# x owns a tied weight (10, used again by z) and a bias (6); y (1 element) runs in between
TIED_BIAS = ([("x.w", 10), ("x.b", 6), ("y.w", 1)],
             [("", [], False), ("x", [0, 1], False), ("y", [2], False), ("z", [0], False)])


@pytest.mark.parametrize("live,expected", [(10, [Free((1,), True)]), (9, [Free((0, 1), True)])],
                         ids=["16 live - 6 freed = budget 10: kept", "budget 9: the keep is dropped"])
def test_keep_budget_counts_what_the_release_frees(live, expected):
    """The keep's live check is on what stays live after the release frees the rest: 16 live
    (x.w + x.b) less the 6 of x.b freed must be <= max_live_parameters."""
    d = Driver(*TIED_BIAS, config=cfg(live=live))
    assert tied_pass(d)[2] == [Free((0, 1), True)]  # RECORD: nothing kept
    got = tied_pass(d)
    assert d.st.trace.mode is TraceMode.COMPLETE and d.st.trace.plan.reused[1] == (0,)
    assert got[2] == expected
