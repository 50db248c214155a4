"""The parameter state and its primitive moves (fz3/core/param/state.py)."""
from __future__ import annotations

from fz3.config.config import Config
from fz3.core.effects import AllGather, Wait
from fz3.core.param.fetch import fetch
from fz3.core.spec import build_spec
from fz3.core.param.state import initial_state
from fz3.core.param.step import reset_step
from tests.support.driver import Driver


def test_initial_state_has_nothing_live_and_no_peak():
    """Every param NOT_AVAILABLE, nothing live or in flight, peak live numel 0, handles from 0."""
    st = initial_state(build_spec([("w", 4)], [("", [0], False)], world_size=1, persistence_threshold=0))
    assert [(int(s.status), s.handle, s.users, s.fetched_for) for s in st.params] == [(0, None, 0, -1)]
    assert (st.live_numel, st.peak_live_numel, st.inflight, st.next_handle) == (0, 0, (), 0)


def test_peak_stays_zero_while_only_empty_params_are_gathered():
    """The peak is the largest live numel reached: gathering numel-0 params leaves it at 0."""
    d = Driver([("empty", 0)], [("", [0], False)],
               config=Config(prefetch_bucket_size=0, max_live_parameters=10, max_reuse_distance=0,
                             param_persistence_threshold=0))
    d(reset_step)
    assert d(fetch, 0, forward=True) == [AllGather(0, (0,), False, True), Wait(0)]
    assert d.st.peak_live_numel == 0
