"""Imported first by each fz3.testing module that needs Hypothesis (the machines, the naive models'
strategies, `verify`): without the test extra, a plain ImportError that names it, instead of a
bare "No module named 'hypothesis'"."""
try:
    import hypothesis  # noqa: F401
except ModuleNotFoundError as e:
    raise ImportError("fz3.testing's machines need Hypothesis, which is not installed: install fz3's test extra "
                      "(pip install -e '.[test]' in your clone of fz3) or Hypothesis itself (pip install hypothesis)",
                      name="hypothesis") from e
