"""One small file per system compared by bench/compare.py; each exposes `build(rank, world, spec)`.

The benchmarks' GPT is the examples' (examples/gpt.py): importing this package puts examples/ on
sys.path, so `from gpt import GPT` works here and in the ranks spawned from here."""
import os
import sys

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
