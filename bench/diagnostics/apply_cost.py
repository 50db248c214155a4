"""What one autograd Function node around a module call costs in forward, in CPU time, and what
the pre-hook that stands in for it costs, forward and backward.

    python bench/diagnostics/apply_cost.py [--calls 20000] [--chain 100]

fz3 wraps each module call's inputs and outputs in PreBackward / PostBackward
(fz3/shell/hooks.py), written in the forward + setup_context form. torch's Function.apply binds
the arguments with inspect.signature(forward) on every call of that form; fz3's apply skips it
outside functorch transforms. This times both on a (4, 4) tensor, one intra-op thread.

Then a forward and backward through a chain of `--chain` (4, 32) @ (32, 32) products, each
output given a PreBackward node, or a pre-hook on its node (`before_backward`, [Note: a
pre-hook for one output]), or nothing: the cost of one wrap, forward and backward, is the
difference to the bare chain divided by its length.
"""
from __future__ import annotations

import argparse
import time

import torch

from fz3.shell.hooks import PreBackward, before_backward


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
    ap.add_argument("--chain", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(4, 4, requires_grad=True)
    noop = lambda: None  # noqa: E731
    torchs = torch.autograd.Function.apply.__func__
    rows = {"fz3 PreBackward.apply": lambda: PreBackward.apply(noop, x),
            "torch Function.apply (setup_context form)": lambda: torchs(PreBackward, noop, x)}
    for name, fn in rows.items():
        print(f"{name:<44} {per_call_us(fn, args.calls):6.1f} us/call")
    ws = [torch.randn(32, 32, requires_grad=True) for _ in range(args.chain)]
    x0 = torch.randn(4, 32)

    def chain(wrap) -> None:
        x = x0
        for w in ws:
            x = wrap(x @ w)
        x.sum().backward()

    ways = {"none": lambda y: y, "PreBackward node": lambda y: PreBackward.apply(noop, y)[0],
            "pre-hook (before_backward)": lambda y: before_backward(y, noop)}
    runs = max(10, args.calls // (40 * args.chain))
    best = {name: float("inf") for name in ways}
    for _ in range(15):  # the three interleaved, the least of each: a chain is ~3 ms, noise ~0.5
        for name, wrap in ways.items():
            best[name] = min(best[name], per_call_us(lambda: chain(wrap), runs))
    for name in list(ways)[1:]:
        print(f"{name + ', forward and backward':<44} {(best[name] - best['none']) / args.chain:6.1f} us/call")


if __name__ == "__main__":
    main()
