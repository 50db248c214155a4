"""I7 drawn and bitwise: the real engine and interpreter train drawn models (tests/support/drawn_nets.py:
chains, branches, shared and tied params, modules called twice, frozen params, a leaf module
of experts, a token embedding, odd sizes) under drawn configs and carriers on exact data, and
equal plain single-process PyTorch bit for bit: every loss of the window, the parameters after
the optimizer step, the next forward.

On thread ranks (fz3.launch.run_threads: N ranks of one ThreadWorld in this process) at the
profile's example count; a smaller drawn set on real gloo processes in tests/test_engine_exact_gloo.py.
"""
from __future__ import annotations

from hypothesis import given, note, settings

from tests.support import drawn_nets as dn


@settings(deadline=None)
@given(dn.nets(), dn.setups())
def test_the_engine_trains_drawn_models_bit_for_bit_like_plain_pytorch(spec, setup):
    world, config, options = setup
    note(f"world {world}, config {config}, options {options}")
    dn.check_on_threads(spec, world, config, options)
