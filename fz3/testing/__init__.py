"""Reusable test machinery: the Hypothesis state machines (param_machine, calls_machine,
grad_machine), the naive models they are checked against, the simulated autograd
(autograd_sim) and `verify` (python -m fz3 verify), with what
a verifier needs around it: `patch` (a replacement of one of fz3's functions, bound wherever fz3
binds it), `profiles` (the Hypothesis profiles, hunt among them), `planted` (three planted bugs)
and `regression` (a shrunk failure as a pytest function to paste). docs/verify.md says how.
The scaffolding only fz3's own tests use (the core's hand driver, the shadow of a real run, the
grad scenarios, the effect-stream digests) lives with them, in tests/support/.

The machines need the test extra (`pip install -e '.[test]'` in a clone of fz3: Hypothesis).
Without it, importing one of them raises a plain ImportError that says so (fz3/testing/extra.py),
not a bare "No module named 'hypothesis'"; nothing is installed on sys.meta_path.
"""
