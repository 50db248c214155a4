"""Step-level interleaving: each system keeps its own rank processes (own gloo group, own port)
alive for the whole measurement, and the orchestrator tells one system at a time to run one
step: A B C D E, B C D E A, ... so that load drift on a shared machine hits every system alike
within seconds, not minutes. Systems stay isolated in their own processes (no shared allocator,
no DeepSpeed global state next to fz3). An idle system blocks on its pipe and uses no CPU.

    groups = {label: Group(label, system, spec) for ...}; wait_ready(groups)
    for i in range(n): for label in rotate(labels, i): groups[label].step()
    [g.close() for g in groups.values()]
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import time
import traceback

from fz3.launch import free_port, spawn_environment


def _rank_main(rank: int, world: int, port: int, module: str, spec: dict, conn, bench_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    code = 0
    try:
        import warnings
        warnings.simplefilter("ignore", FutureWarning)
        sys.path.insert(0, bench_dir)
        import importlib

        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
        from systems.common import batches
        t0 = time.perf_counter()
        sysobj = importlib.import_module(f"systems.{module}").build(rank, world, spec)
        data = batches(spec["model"], rank, world, spec["warmup"] + spec["steps"])
        conn.send(("ready", time.perf_counter() - t0))
        i = 0
        while True:
            cmd = conn.recv()
            if cmd != "step":
                break
            x, y = data[i % len(data)]
            i += 1
            c0, t0 = time.process_time(), time.perf_counter()
            loss = sysobj.step(x, y)
            conn.send(("step", time.perf_counter() - t0, time.process_time() - c0, loss))
        dist.barrier()
        dist.destroy_process_group()
        conn.send(("bye",))
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo can abort a rank at interpreter shutdown (docs/environment.md)


class Group:
    """One system's ranks, stepping on command."""

    def __init__(self, label: str, system: dict, spec: dict, timeout: float = 900) -> None:
        self.label, self.timeout = label, timeout
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        here = os.path.dirname(os.path.abspath(__file__))
        for r in range(system["world"]):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, system["world"], port, system["module"], spec, child, here),
                            daemon=True)
            with spawn_environment(system.get("env", {})):  # compare.py's `fz3_variant`
                p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []
        self.build_s = 0.0

    def _recv(self, conn, kind: str):
        if not conn.poll(self.timeout):
            raise TimeoutError(f"{self.label}: no answer within {self.timeout} s")
        msg = conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"{self.label}: a rank failed\n{msg[1]}")
        if msg[0] != kind:
            raise RuntimeError(f"{self.label}: expected {kind}, got {msg!r}")
        return msg

    def ready(self) -> None:
        self.build_s = max(self._recv(c, "ready")[1] for c in self.conns)

    def step(self) -> float:
        for c in self.conns:
            c.send("step")
        msgs = [self._recv(c, "step") for c in self.conns]
        self.times.append(max(m[1] for m in msgs))  # the slower rank
        self.cpu.append(sum(m[2] for m in msgs) / len(msgs))  # process CPU time (all threads), rank mean
        self.losses.append(sum(m[3] for m in msgs) / len(msgs))  # equal local batches
        return self.times[-1]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send("stop")
            except OSError:
                pass
        for c in self.conns:
            try:
                if c.poll(30):
                    c.recv()
            except (EOFError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def run_interleaved(table: dict, labels: list[str], model: str, warmup: int, steps: int,
                    log=print) -> dict[str, dict]:
    """Start every system's ranks, then interleave single steps, rotating the order each step."""
    groups = {}
    try:
        for label in labels:
            spec = {"model": model, "warmup": warmup, "steps": steps, "mode": "time",
                    "options": table[label]["options"]}
            groups[label] = Group(label, table[label], spec)
        for g in groups.values():
            g.ready()
        log(f"{model}: all systems built ({', '.join(f'{k} {g.build_s:.0f} s' for k, g in groups.items())})")
        n = len(labels)
        for i in range(warmup + steps):
            order = labels[i % n:] + labels[:i % n]
            for label in order:
                groups[label].step()
            if (i + 1) % 4 == 0 or i + 1 == warmup + steps:
                log(f"{model}: step {i + 1}/{warmup + steps} " + ", ".join(
                    f"{k} {1e3 * g.times[-1]:.0f}" for k, g in groups.items()))
    finally:
        for g in groups.values():
            g.close()
    return {label: {"times": g.times[warmup:], "warmup_times": g.times[:warmup], "cpu": g.cpu[warmup:],
                    "losses": g.losses, "build_s": g.build_s, "load": os.getloadavg()[0]}
            for label, g in groups.items()}
