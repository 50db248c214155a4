"""What every compared system shares: the models, the data, the optimizer, the timed loop, and
how memory is counted. A system module only says how to wrap the model (see __init__.py).

    worker(rank, world, system, spec) -> dict      # run by fz3.launch.run in each rank
    spec = {"model": "small"|"wide", "warmup": 3, "steps": 8, "mode": "time"|"stats"|"launches",
            "options": {...system specific...}}

mode "time": the timed loop only (nothing wrapped). mode "stats": collectives counted over the
measured steps, per-rank bytes of params / grads / optimizer state after the last step, peak
RSS (run it with MALLOC_MMAP_THRESHOLD_ set, in its own launch: it slows steps). mode
"launches", or spec["count_launches"] in another mode: the first step after the warm-up runs
under systems/launch_count.py's op counter (bench/launches.py, bench/gpu_steps.py).
spec["trace"] (a path): rank 0's first steady step runs under torch.profiler, its chrome trace
written there and the share of its communication hidden behind compute reported
(systems/overlap.py; bench/gpu_steps.py --trace).
"""
from __future__ import annotations

import importlib
import os
import resource
import time

import torch

from gpt import GPT, GPTConfig, loss_fn, markov_batch

MODELS = {  # issue #5: same model, data, optimizer and global batch for every system
    "small": (GPTConfig(vocab=4096, d_model=256, n_head=4, n_layer=4, seq=128), 8),
    "wide": (GPTConfig(vocab=32768, d_model=512, n_head=8, n_layer=4, seq=64), 4),
    # issue #27: deep and narrow, ~130 modules and ~0.2M params: a step is almost all framework
    "deep": (GPTConfig(vocab=128, d_model=32, n_head=2, n_layer=16, seq=8), 2),
    # bench/diagnostics/memory.py: two sizes for the bytes-per-param fit, then a ladder for fz3.Init's largest
    # run (d 2048); short sequences and 1 sequence per rank, so activations stay small
    "m100": (GPTConfig(vocab=32768, d_model=768, n_head=12, n_layer=12, seq=64), 2),  # 110,270,976
    "m300": (GPTConfig(vocab=32768, d_model=1024, n_head=16, n_layer=24, seq=64), 2),  # 335,931,392
    "m600": (GPTConfig(vocab=32768, d_model=2048, n_head=16, n_layer=11, seq=64), 2),  # 621,185,024
    "m800": (GPTConfig(vocab=32768, d_model=2048, n_head=16, n_layer=15, seq=64), 2),  # 822,618,112
    "b1": (GPTConfig(vocab=32768, d_model=2048, n_head=16, n_layer=19, seq=64), 2),  # 1,024,051,200
    "b12": (GPTConfig(vocab=32768, d_model=2048, n_head=16, n_layer=23, seq=64), 2),  # 1,225,484,288
    # bench/diagnostics/nvme_offload.py: the ladder with the optimizer on disk
    "b2": (GPTConfig(vocab=32768, d_model=2048, n_head=16, n_layer=39, seq=64), 2),  # 2,031,216,640
    "b25": (GPTConfig(vocab=32768, d_model=2048, n_head=16, n_layer=48, seq=64), 2),  # 2,484,441,088
    "b3": (GPTConfig(vocab=32768, d_model=2048, n_head=16, n_layer=59, seq=64), 2),  # 3,038,382,080
    "b35": (GPTConfig(vocab=32768, d_model=2048, n_head=16, n_layer=68, seq=64), 2),  # 3,491,606,528
    "b4": (GPTConfig(vocab=32768, d_model=2048, n_head=16, n_layer=78, seq=64), 2),  # 3,995,189,248
    # bench/diagnostics/memory.py --smoke: the same pipeline on tiny models
    "s1": (GPTConfig(vocab=512, d_model=64, n_head=4, n_layer=2, seq=64), 2),  # 136,960
    "s2": (GPTConfig(vocab=512, d_model=128, n_head=4, n_layer=4, seq=64), 2),  # 867,072
    "s3": (GPTConfig(vocab=512, d_model=128, n_head=4, n_layer=6, seq=64), 2),  # 1,263,616
}
SEED = 0
LR, WEIGHT_DECAY = 1e-3, 0.01
DEVICE = torch.device(os.environ.get("FZ3_BENCH_DEVICE", "cpu"))
"""Where the models and batches live: cpu (every benchmark here), or cuda for bench/gpu_steps.py
(bench/gpu.sh, on a lent GPU: world 1, each rank's device cuda:LOCAL_RANK)."""


def device() -> torch.device:
    if DEVICE.type == "cpu":
        return DEVICE
    return torch.device(DEVICE.type, int(os.environ.get("LOCAL_RANK", 0)))


def make_model(name: str) -> GPT:
    torch.manual_seed(SEED)
    return GPT(MODELS[name][0]).to(device())


def make_optimizer(params, foreach: bool | None = None, fused: bool | None = None) -> torch.optim.Optimizer:
    """torch AdamW with its defaults on CPU (single-tensor loop) for every system; `foreach`:
    its multi-tensor kernels, the default on an accelerator (bench/launches.py's DDP and FSDP2);
    `fused`: its fused kernel, which takes a skip as a tensor (bench/launches.py's fz3 fused)."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=foreach, fused=fused)


def plain_step(model, optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step of a model without any data-parallel wrapper: zero_grad, forward, backward,
    optimizer step. -> the loss."""
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def fz3_step(engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One fz3 step: forward, engine.backward, engine.step. -> the loss."""
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss


def engine_step_seconds(engine, x: torch.Tensor, y: torch.Tensor) -> float:
    """One fz3 step (forward, backward, optimizer) between barriers: the slower rank's seconds."""
    return slowest_seconds(lambda: (engine.backward(loss_fn(engine(x), y)), engine.step()))


def slowest_seconds(run) -> float:
    """run() between barriers: the slower rank's seconds."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    run()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def paired_steps(engines: dict, step, steps: int, warmup: int = 3) -> dict[str, list[float]]:
    """Two engines (labels a, b) stepping in turn, the order alternating every step: `step(engine,
    i)` -> seconds; -> each label's seconds after `warmup` steps each."""
    a, b = engines
    times: dict[str, list[float]] = {a: [], b: []}
    for i in range(warmup + steps):
        for label in ((a, b) if i % 2 == 0 else (b, a)):
            t = step(engines[label], i)
            if i >= warmup:
                times[label].append(t)
    return times


def batches(name: str, rank: int, world: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slice of the global batch of each step (the whole batch when world == 1)."""
    cfg, global_batch = MODELS[name]
    per = global_batch // world
    out = []
    for step in range(n):
        x, y = markov_batch(step, batch=global_batch, seq=cfg.seq, vocab=cfg.vocab)
        out.append((x[rank * per:(rank + 1) * per].to(device()), y[rank * per:(rank + 1) * per].to(device())))
    return out


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor -> its shard


def storage_bytes(groups: dict[str, list]) -> dict[str, int]:
    """Bytes of distinct storages per category, each storage counted once, in the first
    category (in dict order) that reaches it; views of one flat buffer count the buffer once."""
    seen: set[int] = set()
    out = {}
    for cat, tensors in groups.items():
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            st = _local(t).untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
        out[cat] = total
    return out


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def worker(rank: int, world: int, system: str, spec: dict) -> dict:
    """One rank: build the system, run warm-up + measured steps, report."""
    counter = None
    if spec["mode"] == "stats":
        from systems import comm_count
        counter = comm_count.install(rings=system == "fz3_z3")
    mod = importlib.import_module(f"systems.{system}")
    t_build = time.perf_counter()
    sysobj = mod.build(rank, world, spec)
    build_s = time.perf_counter() - t_build
    warmup, steps = spec["warmup"], spec["steps"]
    data = batches(spec["model"], rank, world, warmup + steps)
    times, cpu, losses = [], [], []
    launches = None
    for i, (x, y) in enumerate(data):
        if i == warmup:
            if counter is not None:
                counter.reset()
            if hasattr(sysobj, "mark"):
                sysobj.mark()
        c0, t0 = time.process_time(), time.perf_counter()
        if (spec["mode"] == "launches" or spec.get("count_launches")) and i == warmup:  # the first steady
            # step, under the op counter
            from systems.launch_count import LaunchCount
            with LaunchCount() as launches:
                loss = sysobj.step(x, y)
        elif spec.get("trace") and i == warmup and rank == 0:  # the first steady step, profiled
            loss = _profiled(sysobj, x, y, spec["trace"])
        else:
            loss = sysobj.step(x, y)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(loss)
    out = {"rank": rank, "times": times[warmup:], "warmup_times": times[:warmup], "cpu": cpu[warmup:],
           "losses": losses, "build_s": build_s}
    if DEVICE.type == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated(device())
    if counter is not None:
        out["comm"] = {k: {"calls": v["calls"] / steps, "bytes": v["bytes"] / steps}
                       for k, v in counter.snapshot().items()}
        out["mem"] = storage_bytes(sysobj.memory())
        out["peak_rss"] = peak_rss_bytes()
        out["rss"] = rss_bytes()
    if hasattr(sysobj, "extra"):
        out["extra"] = sysobj.extra(steps)
    if launches is not None:
        out["launches"] = launches.snapshot()
    if spec.get("trace") and rank == 0:
        from systems.overlap import hidden
        out["overlap"] = hidden(spec["trace"])
    return out


def _profiled(sysobj, x, y, path: str) -> float:
    """One step under torch.profiler (the device's kernels too), its chrome trace written to
    `path` (bench/gpu_steps.py --trace; systems/overlap.py reads it)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    with profile(activities=activities) as prof:
        loss = sysobj.step(x, y)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return loss


class Plain:
    """A model + optimizer stepped without sharding (single process, DDP): the loop body."""

    def __init__(self, model: torch.nn.Module, wrapped: torch.nn.Module, foreach: bool | None = None) -> None:
        self.model, self.wrapped = model, wrapped
        self.opt = make_optimizer(model.parameters(), foreach=foreach)

    def step(self, x, y) -> float:
        self.opt.zero_grad()  # first, so the last step's grads are still there to be counted
        loss = loss_fn(self.wrapped(x), y)
        loss.backward()
        self.opt.step()
        return loss.item()

    def memory(self) -> dict[str, list]:
        ps = list(self.model.parameters())
        return {"params": ps, "grads": [p.grad for p in ps], "optimizer": optimizer_state_tensors(self.opt)}


def fz3_settings(fields: dict):
    """-> (fz3.Config, fz3.Options) from one flat dict of field names: the benches name DeepSpeed's
    knobs and fz3's own switches (the gloo carriers) side by side. fz3's defaults where a field is
    not given (the shared-memory carrier off since 2026-12-06; glibc's heap thresholds are the
    launch's, not an option: bench/compare.py's `launch_env`)."""
    import dataclasses

    import fz3
    own = {f.name for f in dataclasses.fields(fz3.Options)}
    return (fz3.Config(**{k: v for k, v in fields.items() if k not in own}),
            fz3.Options(**{k: v for k, v in fields.items() if k in own}))
