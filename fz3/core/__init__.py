"""fz3's control plane: pure state transitions, no torch (tests/test_core_is_pure.py enforces it)."""
