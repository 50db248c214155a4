"""Run a function on N local ranks (127.0.0.1, the device's backend), without torchrun.

    results = fz3.launch.run(fn, world_size=2, args=(...,), timeout=300)
    # fn(rank, world_size, *args) runs in N fresh processes with the default process group
    # initialised; results[r] is what rank r returned (picklable)

    results = fz3.launch.run_threads(fn, world_size=3, args=(...,))
    # the same fn on N threads of this process, no process group: the real engine and
    # interpreter on an in-memory world (CPU; fz3/interpreters/threads.py)

Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR set) use `init_from_env()` instead. Both pick
each rank's device as fz3.initialize will (`pick_device`: FZ3_DEVICE, LOCAL_RANK, what is
present), make it current, and init the group with its backend: gloo on CPU, nccl on CUDA, hccl
on Ascend; an explicit `backend` must fit that device (fz3/shell/pick.py). Every rank
ends with barrier, destroy_process_group, flush, os._exit(0): on torch 2.13 a gloo worker
thread can abort a rank during interpreter shutdown after all its work is done (docs/environment.md).
A rank that raises, or exits without a result, fails the whole run with every rank's error:
the others get `_GRACE_S` to report theirs (a peer's exit usually makes them raise too, e.g.
fz3.DivergenceError), then are killed. A run that exceeds `timeout` fails with TimeoutError.

    fz3.launch.run(fn, world_size=2, malloc_thresholds=True)
    # the ranks start with glibc's MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ at 32 / 64 MiB,
    # so buffers below 32 MiB reuse the heap on CPU ([Note: heap thresholds], fz3/data/heap.py);
    # off by default, and left as they are where the environment already sets glibc's heap policy.
    # This process's own environment is put back once the ranks have started.
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch.distributed as dist

from fz3.data import heap, swap
from fz3.interpreters import threads
from fz3.shell.pick import backend_for, pick_device

run_threads = threads.run_threads  # fn on N threads of this process (fz3/interpreters/threads.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(timeout_s: float = 300, backend: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes; -> (rank, world_size).

    `backend` None means the device's (gloo / nccl / hccl); an explicit one that does not fit
    the device is a ValueError, so the group always suits what fz3.initialize will check.
    A group already initialised is left as it is."""
    if not dist.is_initialized():
        _init_group(backend, timeout_s)
    return dist.get_rank(), dist.get_world_size()


def _init_group(backend: str | None, timeout_s: float, **rendezvous: int) -> None:
    """Pick this rank's device, make it current, then init the group on its backend: NCCL
    binds a rank to the device that is current when the group is made, and is told which one
    (device_id), so it need not guess from the global rank (it warns that a guess can hang)."""
    device = pick_device()
    backend = backend_for(device, backend)
    device.set_device()
    bind = {"device_id": device.torch_device} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **bind, **rendezvous)


@contextlib.contextmanager
def spawn_environment(extra: Mapping[str, str]) -> Iterator[None]:
    """This process's environment plus `extra` while ranks are spawned (a spawned interpreter
    starts with it), then as it was."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: Sequence[Any],
           results: "mp.Queue", group_timeout_s: float, threads: int, backend: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    torch.set_num_threads(threads)
    code = 0
    try:
        _init_group(backend, group_timeout_s, rank=rank, world_size=world_size)
        # plain pickle: tensors travel by value, not as shared-memory handles that die with us
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
        code = 1
    swap.close_all()  # os._exit skips the exit handlers that remove offload's files
    results.close()
    results.join_thread()  # Queue.put hands data to a feeder thread; let it finish first
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_POLL_S = 1.0  # how often run() looks for ranks that died without reporting
_GRACE_S = 10.0  # once a rank failed, how long run() waits for the others' own reports


def _died_silently(procs: list, reported: set) -> dict[int, str]:
    """rank -> 'exited without a result (exit code c)' for each rank that exited and reported
    nothing: a crash while starting, or os._exit in `fn`. A rank that put a result may still die
    at shutdown (docs/environment.md): that is not a failure."""
    return {r: f"exited without a result (exit code {p.exitcode})" for r, p in enumerate(procs)
            if r not in reported and p.exitcode is not None}


def run(fn: Callable, *, world_size: int = 2, args: Sequence[Any] = (), timeout: float = 300,
        threads: int = 1, backend: str | None = None, group_timeout: float | None = None,
        malloc_thresholds: bool = False) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` spawned ranks; -> per-rank results.

    Rank r is local rank r, so on accelerators it needs device r (FZ3_DEVICE=cpu runs any
    number of ranks on gloo); `backend` as in `init_from_env`. `group_timeout`: seconds the
    process group's waits give up after (init_process_group's timeout; None: `timeout`);
    `malloc_thresholds`: start the ranks with glibc's heap thresholds ([Note: heap thresholds])."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not isinstance(malloc_thresholds, bool):
        raise TypeError(f"fz3.launch.run: malloc_thresholds must be a bool, got {malloc_thresholds!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    group_timeout_s = timeout if group_timeout is None else group_timeout
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(r, world_size, port, fn, args, results, group_timeout_s, threads, backend))
             for r in range(world_size)]
    with spawn_environment(heap.rank_environment() if malloc_thresholds else {}):
        for p in procs:
            p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        _collect(procs, results, out, errors, timeout)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("fz3.launch.run: a rank failed\n" + "\n".join(f"rank {r}:\n{errors[r]}"
                                                                       for r in sorted(errors)))
    return [out[r] for r in range(world_size)]


def _collect(procs: list, results: "mp.Queue", out: dict, errors: dict, timeout: float) -> None:
    """Fill `out` (rank -> result) and `errors` (rank -> traceback or how it died) until every
    rank reported, or `_GRACE_S` after the first failure; TimeoutError past `timeout` with no
    failure."""
    deadline = time.monotonic() + timeout
    while len(out.keys() | errors.keys()) < len(procs):
        if errors and time.monotonic() > deadline:
            return  # the ranks still running are killed: their failures are what errors say
        try:
            rank, ok, value = results.get(timeout=_POLL_S)
        except queue.Empty:
            dead = _died_silently(procs, out.keys() | errors.keys())
            if dead:  # what a rank put just before exiting is read first
                time.sleep(_POLL_S)
                if not results.empty():
                    continue
                errors.update(dead)
                deadline = min(deadline, time.monotonic() + _GRACE_S)
            elif time.monotonic() > deadline and not errors:
                raise TimeoutError(f"fz3.launch.run: no result within {timeout}s; ranks alive: "
                                   f"{[r for r, p in enumerate(procs) if p.is_alive()]}") from None
            continue
        if ok:
            out[rank] = pickle.loads(value)
        else:
            errors[rank] = value
            deadline = min(deadline, time.monotonic() + _GRACE_S)
