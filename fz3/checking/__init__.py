"""`fz3.check`: the user's model trained under configs drawn around theirs, on 1-3 thread ranks
running the real engine and beside them in one process doing the same arithmetic, every loss and
param compared, a failure shrunk to the smallest config (docs/check.md). Its public signature is
fz3/api.py's, which passes fz3.initialize down.

    check.py     the run: draw, train, compare, shrink
    build.py     what the user's build() returns, read into model, batches and loss
    draw.py      the configs drawn around the user's, and shrinking one
    run.py       the reference in one process and the thread ranks
    watch.py     the core's invariants watched on every event of the real engine
    compare.py   losses, params and buffers compared; the likely cause named
    report.py    CheckReport

(Not fz3/check/: a package of that name would replace the function `fz3.check` on the fz3
module once imported.)
"""
