"""fz3.plan under optimizer offload: what stays in memory, what each step moves to and from disk,
and, given the memory a rank has, how much of the optimizer to offload so the plan fits.

    figures(engine, rate, stepped)      the offload's rows of a planned step (bytes on disk,
                                        read and written per step, the step's working set, and
                                        the masters and state that leave memory)
    choose(figures_of, budget)          the smallest share of the sub-groups to offload, as
                                        DeepSpeed's `ratio` picks them, that brings the plan's
                                        peak within `budget`; None if even all of them does not
    offloaded(step, figures, engine)    a planned step's row with the optimizer on disk
    param_files(step, engine)           ... with the params' shards in files of their own
    host_step(step, engine, on_disk)    ... with an accelerator's optimizer stepped on the host

A sub-group's bytes are its fp32 masters and the elementwise optimizer state the plan measures
for its params (fz3/observe/plan.py `_optimizer_state_rate`; the per-param scalars, Adam's step
counts, stay in memory). The sub-groups are fz3/core/offload.py's,
from the planned engine's segments (cut at sub_group_size when the config offloads to "nvme").
Under offload the step holds `budget(pipeline_read, pipeline_write)` offloaded sub-groups in
memory at once: the plan counts the largest ones that many times.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from fz3.core import offload


class OffloadFigures(NamedTuple):
    ratio: float
    subgroups: int
    offloaded: tuple[int, ...]  # sub-group indices
    first_params: tuple[str, ...]  # by offloaded sub-group: the name of its first param
    bytes_offloaded: int  # masters + optimizer state of the offloaded sub-groups, on disk
    masters_offloaded: int  # of which the fp32 masters
    disk_read: int  # per optimizer step
    disk_written: int
    working_set: int  # offloaded sub-groups in memory at once during the step, at most


def groups_of(engine, ratio: float) -> tuple[offload.SubGroup, ...]:
    store = engine.store
    runs: list[list[tuple[int, int]]] = [[] for _ in store.runs]
    for k, seg in enumerate(store.segments):
        runs[seg.run].append((k, seg.masters.numel()))
    return offload.sub_groups(runs, sub_group_size=engine.config.sub_group_size, ratio=ratio)


def figures(engine, rate: tuple[int, int], stepped: set[int], ratio: float | None = None) -> OffloadFigures:
    """The offload's figures for the planned engine, at `ratio` (None: the config's)."""
    cfg = engine.config.offload_optimizer
    ratio = cfg.ratio if ratio is None else ratio
    store = engine.store
    groups = groups_of(engine, ratio)
    _, per_elem = rate
    sizes, masters = [], []
    for g in groups:
        ps = [p for s in g.segments for p in store.segments[s].params]
        masters.append(sum(4 * store.masters[p].numel() for p in ps))
        # the elementwise state moves; the per-param scalars (Adam's step count) stay in memory
        sizes.append(masters[-1] + sum(per_elem * store.masters[p].numel() for p in ps if p in stepped))
    off = tuple(i for i, g in enumerate(groups) if g.offloaded)
    moved = sum(sizes[i] for i in off)
    held = sorted((sizes[i] for i in off), reverse=True)[:offload.budget(cfg.pipeline_read, cfg.pipeline_write)]
    names = tuple(store.names[store.segments[groups[i].segments[0]].params[0]] for i in off)
    return OffloadFigures(ratio, len(groups), off, names, moved, sum(masters[i] for i in off), moved, moved,
                          sum(held))


def ratios(n: int) -> list[float]:
    """A ratio for each count k = 0..n of offloaded sub-groups under DeepSpeed's rule (sub-group i
    of n is offloaded when i >= int((1 - ratio) * n)): 0, 1, and between them the middle of the
    interval that gives k, rounded to a short decimal that still gives it (a user copies it)."""
    out = []
    for k in range(n + 1):
        r = 0.0 if k == 0 else 1.0 if k == n else round((k - 0.5) / n, len(str(n)) + 1)
        assert n - int((1 - r) * n) == k, (n, k, r)
        out.append(r)
    return out


def choose(peak_at: Callable[[float], int], n: int, budget: int) -> float | None:
    """The smallest ratio whose planned peak (`peak_at(ratio)`) is within `budget` bytes; None if
    none is."""
    for r in ratios(n):
        if peak_at(r) <= budget:
            return r
    return None


def offloaded(step: dict[str, int], of, engine) -> dict[str, int]:
    """A step's figures with the offloaded sub-groups' masters and state on disk, and the step's
    working set of them in memory (`figures`). Params on NVMe too: each
    gather reads its shards (gathered bytes / world size) from disk, in the share of the masters
    that is offloaded (all of them at ratio 1), and up to prefetch_bucket_size elements of them
    are held read ahead of their gathers (fz3/core/offload.py `param_reads`)."""
    step = dict(step)
    state_off = of.bytes_offloaded - of.masters_offloaded
    masters = 4 * sum(m.numel() for m, t in zip(engine.store.masters, engine.store.trainable) if t)
    step["param_shards"] -= of.masters_offloaded
    step["optimizer_state_bytes"] = max(0, step["optimizer_state_bytes"] - state_off)
    shard_reads = read_ahead = 0
    if engine.config.offload_param.device == "nvme" and not engine.store.separate and masters:
        shard_reads = step["gathered_bytes"] // engine.world_size * of.masters_offloaded // masters
        read_ahead = min(4 * engine.config.prefetch_bucket_size, of.masters_offloaded)
    step.update(offloaded_bytes=of.bytes_offloaded, disk_read_bytes=of.disk_read + shard_reads,
                disk_written_bytes=of.disk_written, offload_working_bytes=of.working_set,
                param_read_ahead_bytes=read_ahead)
    step["model_state_peak_bytes"] += of.working_set - of.bytes_offloaded + read_ahead
    return step


def param_files(step: dict[str, int], engine) -> dict[str, int]:
    """A step's figures with offload_param "nvme" where the shards are not the masters (bf16 or
    fp16, or the optimizer in memory): each sub-group's shards of params not persistent (of the
    offloaded sub-groups, with the optimizer on NVMe) leave memory for a file of their own,
    written once a step, read by the gathers (gathered bytes / world size, in their share of the
    shards), up to prefetch_bucket_size elements of them held read ahead (fz3/shell/offload.py)."""
    step = dict(step)
    store, config = engine.store, engine.config
    nvme = config.offload_optimizer.device == "nvme"
    groups = groups_of(engine, config.offload_optimizer.ratio)
    numel = sum(store.masters[p].numel() for g in groups if g.offloaded or not nvme for s in g.segments
                for p in store.segments[s].params if not engine.spec.params[p].persistent)
    nbytes, size = numel * store.dtype.itemsize, store.dtype.itemsize
    total = sum(m.numel() for m in store.masters)
    read_ahead = min(size * config.prefetch_bucket_size, nbytes)
    step["param_shards"] -= nbytes
    step["model_state_peak_bytes"] += read_ahead - nbytes
    for key, add in (("offloaded_bytes", nbytes), ("disk_written_bytes", nbytes), ("offload_working_bytes", 0),
                     ("disk_read_bytes", step["gathered_bytes"] // engine.world_size * numel // max(total, 1)),
                     ("param_read_ahead_bytes", read_ahead)):
        step[key] = step.get(key, 0) + add
    return step


def host_step(step: dict[str, int], engine, masters_on_disk: int) -> dict[str, int]:
    """A step's figures on an accelerator whose optimizer steps on the host (fz3/core/offload.py
    `host`): the fp32 masters, the optimizer state (what of them is not on disk) and the grads'
    host copies in host memory (`host_bytes`), and with offload_param "cpu" the compute shards
    too; the device holds the compute shards (copies of their own, even in fp32) and the rest.
    The model states at the peak are the device's. `masters_on_disk`: bytes of masters the
    offload to "nvme" already took out of the step's param_shards."""
    step = dict(step)
    store, config = engine.store, engine.config
    masters = 4 * sum(m.numel() for m in store.masters)
    grads = 4 * sum(seg.grads.numel() for seg in store.segments)
    held = step["param_shards"] + step["optimizer_state_bytes"] + step.get("offload_working_bytes", 0)
    if store.separate:  # the plan's compute shards, beside the masters
        compute = step["param_shards"] - (masters - masters_on_disk)
    else:
        compute = store.dtype.itemsize * sum(m.numel() for p, m in enumerate(store.masters)
                                             if not engine.spec.params[p].persistent)
    compute = max(compute, 0)
    on_host = config.offload_param.device == "cpu"
    step["host_bytes"] = held - (compute if store.separate else 0) + grads + (compute if on_host else 0)
    step["model_state_peak_bytes"] += (0 if on_host else compute) - held
    step["param_shards"] = 0 if on_host else compute
    step["optimizer_state_bytes"] = 0
    return step
