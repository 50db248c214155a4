"""I7 drawn and bitwise on real gloo processes: a few drawn models, configs and carriers
(property_tests/test_engine_exact.py runs many on thread ranks) train under fz3 on 2 spawned
ranks exactly as plain single-process PyTorch does (tests/support/drawn_nets.py says why the
comparison can be exact)."""
from __future__ import annotations

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from fz3 import launch
from tests.support import drawn_nets as dn

SIZES = st.sampled_from([0, 7, 10**9])


@st.composite
def configs(draw) -> tuple[dict, dict]:
    contiguous = draw(st.booleans())
    config = dict(param_persistence_threshold=draw(st.sampled_from([0, 5])), prefetch_bucket_size=draw(SIZES),
                  max_live_parameters=draw(st.sampled_from([20, 10**9])), max_reuse_distance=draw(SIZES),
                  reduce_bucket_size=draw(st.sampled_from([16, 10**9])), overlap_comm=draw(st.booleans()),
                  gradient_accumulation_steps=draw(st.sampled_from([1, 2])), contiguous_gradients=contiguous,
                  reduce_scatter=not contiguous or draw(st.booleans()))
    carriers = st.sampled_from(["p2p", "all_reduce", "native"])
    return config, dict(gloo_all_gather=draw(carriers), gloo_reduce_scatter=draw(carriers))


@settings(max_examples=4, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(dn.nets(), configs())
def test_drawn_models_train_bit_for_bit_on_gloo_processes(spec, setup):
    config, options = setup
    note(f"config {config}, options {options}")
    outs = launch.run(dn.train_rank, world_size=2, args=(spec, config, options), timeout=120)
    dn.assert_bitwise(outs, dn.reference(spec, 2, config["gradient_accumulation_steps"]))
