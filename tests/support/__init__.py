"""This repository's own test fixtures: the parity suite's models, data and launch (parity*),
the drawn networks of the exact-equality tests (drawn_nets), the live-budget watch (live_watch).
Not shipped with fz3; fz3.testing keeps what other projects can reuse."""
