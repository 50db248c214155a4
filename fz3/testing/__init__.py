"""Reusable test machinery: the Hypothesis state machines (param_machine, calls_machine,
grad_machine), the naive models they are checked against, the simulated autograd
(autograd_sim), the shadow of a real run (shadow) and `verify` (python -m fz3 verify).

The machines need the test extra (`pip install -e '.[test]'` in a clone of fz3: Hypothesis).
Without it, importing one of them raises a plain ImportError that says so (fz3/testing/extra.py),
not a bare "No module named 'hypothesis'"; nothing is installed on sys.meta_path.
"""
