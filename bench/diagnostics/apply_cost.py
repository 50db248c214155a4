"""What one autograd Function node around a module call costs in forward, in CPU time.

    python bench/diagnostics/apply_cost.py [--calls 20000]

fz3 wraps each module call's inputs and outputs in PreBackward / PostBackward
(fz3/shell/hooks.py), written in the forward + setup_context form. torch's Function.apply binds
the arguments with inspect.signature(forward) on every call of that form; fz3's apply skips it
outside functorch transforms. This times both on a (4, 4) tensor, one intra-op thread.
"""
from __future__ import annotations

import argparse
import time

import torch

from fz3.shell.hooks import PreBackward


def per_call_us(fn, calls: int) -> float:
    for _ in range(500):
        fn()
    t0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(4, 4, requires_grad=True)
    noop = lambda: None  # noqa: E731
    torchs = torch.autograd.Function.apply.__func__
    rows = {"fz3 PreBackward.apply": lambda: PreBackward.apply(noop, x),
            "torch Function.apply (setup_context form)": lambda: torchs(PreBackward, noop, x)}
    for name, fn in rows.items():
        print(f"{name:<44} {per_call_us(fn, args.calls):6.1f} us/call")


if __name__ == "__main__":
    main()
