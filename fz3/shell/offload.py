"""Runs fz3/core/offload.py's schedule: the optimizer stepped a sub-group at a time, the offloaded
sub-groups' fp32 masters and optimizer state read from and written to the disk tier
(fz3/data/swap.py) around their step, and with a host step the grads copied to the host and the
stepped masters copied back into the device's compute shards around it.

    store_layout(config, device, options)   how the tensor store is laid out for the offload the
                                     config asks: where the masters live (`host`: the CPU, for
                                     "cpu" or "nvme" on an accelerator's ranks, or on CPU ranks
                                     under Options(host_step=True); None otherwise), whether the
                                     shards are apart from them, the segments' size, pinning, and
                                     whether the optimizer steps a sub-group at a time (`in_parts`)
    OptimizerOffload.build(engine)   None unless offload_optimizer.device is "nvme" or the
                                     optimizer steps on the host; at build the offloaded masters
                                     go to disk (their state does not exist until the first step
                                     makes it)
    offload.step(no_grad)            the optimizer step: the schedule's effects, in order; each
                                     Step is optimizer.step() over that sub-group's masters
                                     ([Note: a step in parts], flat_step.py), then its compute
                                     shards are refreshed from the masters. The groups step by
                                     shard (torch's own state per master, a storage each), not
                                     flat: a flat group's per-master state is views of its chunks',
                                     which cannot be made while a chunk is on disk
    with offload.resident(): ...     every sub-group in memory for the block (checkpoints, full
                                     state dicts, the user's optimizer.state_dict()), written
                                     back after it, state made or replaced inside it included
    offload.stats()                  bytes read and written and seconds waited on the disk, in
                                     all and since the step before the last (step_*: the last
                                     step's passes, their gathers' reads included, and its own)

offload_param "nvme": with the optimizer on NVMe, in fp32, the compute shards are the masters,
so they are on disk with their sub-groups; otherwise the shards (of the params not persistent)
are copies with a file of their own per sub-group, written after each refresh (`_refresh`). A
gather takes each param's shard from disk (`store.shard`, fz3/data/store.py) as it sends it: the
shards leave memory too.
From the second window on, each shard a gather takes sets off the reads of the shards the next
gathers will want, along the order the last window's gathers took them (a steady window
repeats it), within prefetch_bucket_size elements (fz3/core/offload.py `param_reads`), so the
gathers find them read; stats() counts `param_reads_ahead`, `param_reads_waited` and the
`param_read_wait_seconds` the gathers spent on them.

"cpu" on CPU ranks: the masters, the state and the params already live in host memory, so
nothing moves, and the log says so once (`describe`). On an accelerator's ranks (ZeRO-Offload)
the grads are reduced on the device and clipped there, then each sub-group's are copied to its
host buffers (all issued at the step's start, each awaited before its sub-group steps), the
optimizer (the user's, torch's CPU kernels) steps the host masters, and each stepped sub-group
is copied back into its compute shards while the next one steps; "nvme" is staged through the
same host memory. `pin_memory` makes the host buffers pinned, so the copies are asynchronous.
"""
from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future
from typing import Iterator, NamedTuple

import torch

from fz3.core import offload
from fz3.core.offload import (AwaitGrads, AwaitParams, AwaitRead, AwaitWrite, GradsToHost, ParamsToDevice, Read,
                              Step, Write)
from fz3.data.swap import DiskTier

RECORDED = 64  # a window's order of gathers is kept up to this many gathers of each param on disk
# optimizer states per element, fp32, for the free-space check (an optimizer not named here is
# counted as Adam's two: the state's size is only known after the first step)
STATES = {torch.optim.Adam: 2, torch.optim.AdamW: 2, torch.optim.Adamax: 2, torch.optim.NAdam: 2,
          torch.optim.RAdam: 2, torch.optim.Adagrad: 1, torch.optim.RMSprop: 1}


class StoreLayout(NamedTuple):
    host: torch.device | None  # where the masters live when the optimizer steps apart from the device
    separate_shards: bool  # compute shards of their own, even in fp32
    segment_numel: int | None  # segments cut at sub_group_size (None: the store's default)
    pin: bool  # the host buffers pinned
    params_on_host: bool  # offload_param "cpu" with the host step: the shards in host memory
    in_parts: bool  # the optimizer steps a sub-group at a time (OptimizerOffload), no group flat


def store_layout(config, device: torch.device, options) -> StoreLayout:
    """The store's layout for the config's offload, on `device` (fz3.plan's meta device: none)."""
    nvme, param_nvme = config.offload_optimizer.device == "nvme", config.offload_param.device == "nvme"
    host = None
    if config.offload_optimizer.device != "none" and device.type != "meta" and (device.type != "cpu"
                                                                                or options.host_step):
        host = torch.device("cpu")
    # params on NVMe in fp32 beside the optimizer there: the shards are the masters, read from its
    # files; else the shards are copies, with files of their own under params on NVMe
    from_masters = nvme and param_nvme and config.compute_dtype == "fp32"
    in_parts = nvme or param_nvme or host is not None
    return StoreLayout(host=host, separate_shards=(nvme or param_nvme) and not from_masters,
                       segment_numel=config.sub_group_size if in_parts else None,
                       pin=host is not None and device.type != "cpu" and config.offload_optimizer.pin_memory,
                       params_on_host=config.offload_param.device == "cpu", in_parts=in_parts)


class OptimizerOffload:
    def __init__(self, engine, groups: tuple[offload.SubGroup, ...], disk: DiskTier | None) -> None:
        self.store, self.flat_steps = engine.store, engine.flat_steps
        cfg = engine.config.offload_optimizer
        self.groups = groups
        self.host = self.store.host is not None
        self.effects = offload.schedule(groups, read_ahead=cfg.pipeline_read, write_behind=cfg.pipeline_write,
                                        host=self.host)
        self.disk = disk
        self.device = engine.accelerator  # its events say when a copy to or from it has landed
        self.non_blocking = self.store.segments[0].masters.is_pinned() if self.store.segments else False
        self.events: dict[tuple[str, int], object] = {}  # copies in flight: ("grads" | "params", sub-group)
        self.copied = {"bytes_to_host": 0, "bytes_to_device": 0, "copies_to_host": 0, "copies_to_device": 0}
        # by sub-group: its params (each a master, a compute shard to refresh) and their segments
        self.segments = [frozenset(g.segments) for g in groups]
        self.params = [tuple(p for s in g.segments for p in self.store.segments[s].params) for g in groups]
        # what ParamsToDevice copies of each: its compute shards (none: params in host memory)
        self.shard_bytes = [0 if self.store.params_on_host else
                            sum(self.store.shards[p].numel() * self.store.shards[p].element_size() for p in ps)
                            for ps in self.params]
        self.last: dict[str, float] = {}
        # params on NVMe: where each param's shard lies on disk, for the gathers to read it there.
        # In fp32 beside the optimizer on NVMe the shards are the masters, in their sub-group's
        # file (written first, segment by segment); else the shards (of the params not persistent)
        # have a file of their own per sub-group, key ("params", i), written after each refresh
        self.param_files: dict[int, tuple[int, ...]] = {}  # sub-group -> its params in its shards' file
        self.where: dict[int, tuple[object, int]] = {}
        on_disk = engine.config.offload_param.device == "nvme"
        if on_disk and not self.store.separate:
            for i, g in enumerate(groups):
                offset = 0
                for s in sorted(g.segments):
                    for p in self.store.segments[s].params:
                        self.where[p] = (i, offset + self.store.masters[p].storage_offset() * 4)
                    offset += self.store.segments[s].masters.numel() * 4
        elif on_disk:
            for i, g in enumerate(groups):
                if g.offloaded or cfg.device != "nvme":
                    ps = tuple(p for p in self.params[i]
                               if not engine.spec.params[p].persistent and self.store.shards[p].numel())
                    self.param_files[i] = ps
                    offset = 0
                    for p in ps:
                        self.where[p] = (("params", i), offset)
                        offset += self.store.shards[p].numel() * self.store.dtype.itemsize
        # params on NVMe read ahead of their gathers (offload.param_reads, along the order the last
        # window's gathers took them): by param, the queue index it was read for, the read in
        # flight and the shard it fills
        self.reads: dict[int, tuple[int, Future, torch.Tensor]] = {}
        self.read_budget = engine.config.prefetch_bucket_size
        self.disk_numel = ({p: self.store.shards[p].numel() for ps in self.param_files.values() for p in ps}
                           if self.store.separate else
                           {p: self.store.masters[p].numel() for i, g in enumerate(groups) if g.offloaded
                            for p in self.params[i]} if on_disk else {})
        self.read_dtype = self.store.dtype  # the masters' in fp32
        self.recording: list[int] = []  # this window's gathers' shards, in order
        self.queue: tuple[tuple[int, ...], dict[int, tuple[int, ...]]] = ((), {})  # the last window's, indexed
        self.pos = 0  # just past the queue index of the last gather that took a shard
        # the gathers' reads: found read ahead, read then, and the seconds the gathers waited on them
        self.read_counts = {"param_reads_ahead": 0, "param_reads_waited": 0, "param_read_wait_seconds": 0.0}
        if engine.config.offload_param.device == "nvme":
            self.store.from_disk = self._shard_from_disk
        for i, g in enumerate(groups):  # nothing to step yet: the masters alone go to disk
            if g.offloaded:
                self._write(i)
                self.disk.await_write(i)
        for i in self.param_files:  # and the params' shards, as they are
            self._write_params(i)
        self.mark = self._disk_stats()  # what a step's figures count from (stats: the last step's)

    @classmethod
    def build(cls, engine) -> "OptimizerOffload | None":
        cfg, store = engine.config.offload_optimizer, engine.store
        if engine.transport is None:  # fz3.plan's engine: nothing to move, nothing on disk
            return None
        host = store.host is not None
        param = engine.config.offload_param.device
        if param == "nvme" and store.device.type != "cpu":
            raise ValueError(f"zero_optimization.offload_param.device = 'nvme' on {store.device}: fz3 reads an "
                             "accelerator's params from host memory ('cpu'), not yet from NVMe; set "
                             "offload_param.device 'cpu' or 'none'")
        if param == "cpu" and store.device.type != "cpu" and not host:
            raise ValueError(f"zero_optimization.offload_param.device = 'cpu' with offload_optimizer.device = "
                             f"{cfg.device!r} on {store.device}: fz3 keeps an accelerator's params in host memory "
                             "beside the optimizer stepped there; set offload_optimizer.device 'cpu' (or 'nvme') "
                             "too, or offload_param.device 'none'")
        if cfg.device == "cpu" and host and cfg.ratio < 1:
            raise ValueError(f"zero_optimization.offload_optimizer.ratio = {cfg.ratio} with device 'cpu' on "
                             f"{store.device}: fz3 steps every sub-group on the host, and keeps none of the "
                             "optimizer on the device; set ratio 1 (the default), or offload_optimizer.device 'none'")
        if not store_layout(engine.config, store.device, engine.options).in_parts:
            return None
        runs: list[list[tuple[int, int]]] = [[] for _ in store.runs]
        for k, seg in enumerate(store.segments):
            runs[seg.run].append((k, seg.masters.numel()))
        groups = offload.sub_groups(runs, sub_group_size=engine.config.sub_group_size, ratio=cfg.ratio,
                                    offload=cfg.device == "nvme")
        if cfg.device != "nvme" and param != "nvme":
            return cls(engine, groups, None)
        numel = sum(g.numel for g in groups if g.offloaded)
        states = STATES.get(type(engine.optimizer))
        if states is None and isinstance(engine.optimizer, torch.optim.SGD):
            states = int(any(g.get("momentum", 0) for g in engine.optimizer.param_groups))
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # the ranks of this host write to the same drive
        needed = numel * 4 * (1 + (2 if states is None else states)) * ranks
        if param == "nvme" and store.separate:  # the shards' files of their own
            needed += sum(g.numel for g in groups) * store.dtype.itemsize * ranks
        path, what = ((cfg.nvme_path, "offload_optimizer.nvme_path") if cfg.device == "nvme" else
                      (engine.config.offload_param.nvme_path, "offload_param.nvme_path"))
        disk = DiskTier(path, what=what, rank=engine.rank, block_size=engine.config.aio.block_size,
                        threads=engine.config.aio.intra_op_parallelism, needed=needed)
        return cls(engine, groups, disk)

    # ---- the step ------------------------------------------------------------------------------

    def step(self, no_grad: tuple[int, ...]) -> None:
        self._drop_reads()
        if self.recording:  # the window's order of gathers: the next window's queue
            queue = tuple(self.recording)
            self.queue, self.recording = (queue, offload.queue_index(queue)), []
        flat = self.flat_steps.begin(no_grad)
        for e in self.effects:
            match e:
                case Read(group=i):
                    self.disk.read(i)
                case AwaitRead(group=i):
                    self.disk.await_read(i)
                case GradsToHost(group=i):
                    n = self.store.grads_to_host(sorted(self.segments[i]), non_blocking=self.non_blocking)
                    self._copied(("grads", i), "host", n)
                case AwaitGrads(group=i) | AwaitParams(group=i):
                    self.events.pop(("grads" if isinstance(e, AwaitGrads) else "params", i)).synchronize()
                case Step(group=i):
                    self.flat_steps.part(flat, self.segments[i])
                    if not self.host:  # else ParamsToDevice copies them
                        self._refresh(i)
                case ParamsToDevice(group=i):  # params in host memory: their shards there, refreshed
                    self._refresh(i, non_blocking=self.non_blocking)
                    self._copied(("params", i), "device", self.shard_bytes[i])
                case Write(group=i):
                    self._write(i)
                case AwaitWrite(group=i):
                    self.disk.await_write(i)
        self.flat_steps.end(flat)
        after = {**self._disk_stats(), **self.copied, **self.read_counts,
                 "param_bytes_to_device": self.store.param_bytes_to_device}  # since the last step: its gathers' reads
        self.last = {k: after[k] - self.mark.get(k, 0) for k in after}  # (params on NVMe) and its own
        self.mark = after

    def _copied(self, key: tuple[str, int], to: str, nbytes: int) -> None:
        """A copy to the host or the device issued: its event, for the await; its bytes counted."""
        self.events[key] = self.device.record_event()
        self.copied[f"bytes_to_{to}"] += nbytes
        self.copied[f"copies_to_{to}"] += 1

    def _disk_stats(self) -> dict[str, float]:
        return self.disk.stats() if self.disk is not None else {}

    def _refresh(self, i: int, non_blocking: bool = False) -> None:
        """Sub-group i's compute shards from its stepped masters; with a shards' file, into their
        memory back for the while and out to the file again."""
        if i in self.param_files:
            self.disk.restore(("params", i))
        self.store.refresh_shards(self.params[i], non_blocking=non_blocking)
        if i in self.param_files:
            self._write_params(i)

    def _write_params(self, i: int) -> None:
        """Sub-group i's shards (of the params not persistent) to their file, their memory gone."""
        self.disk.write(("params", i), [self.store.shards[p] for p in self.param_files[i]])
        self.disk.await_write(("params", i))

    def _shard_from_disk(self, p: int) -> torch.Tensor:
        """Param p's shard for a gather (its fp32 master, or its copy in the shards' file): read
        ahead if the last window's order foresaw it, else read now; then the reads ahead of the
        gathers to come. The window's order is kept up to a bound (passes with no optimizer step,
        an evaluation loop, would grow it for good): past it, the next window reads as it goes."""
        if len(self.recording) < RECORDED * max(len(self.disk_numel), 1):
            self.recording.append(p)
        start = time.perf_counter()
        read = self.reads.pop(p, None)
        if read is not None:
            self.disk.await_range(read[1])
            out = read[2]
            self.read_counts["param_reads_ahead"] += 1
        else:
            key, offset = self.where[p]
            out = torch.empty(self.store.shards[p].numel(), dtype=self.read_dtype)
            self.disk.read_range(key, offset, out)
            self.read_counts["param_reads_waited"] += 1
        self.read_counts["param_read_wait_seconds"] += time.perf_counter() - start
        self._read_ahead(p)
        return out

    def _read_ahead(self, p: int) -> None:
        """Where the gather taking p stands in the last window's order, and the shards to read
        after it within prefetch_bucket_size (fz3/core/offload.py)."""
        queue, index = self.queue
        here = offload.queue_position(index, p, self.pos)
        if here is None:  # the first window, or p was not gathered in the last
            return
        self.pos = here + 1
        pending = {q: r[0] for q, r in self.reads.items()}
        for q in offload.passed_over(pending, here):
            self.disk.await_range(self.reads.pop(q)[1])
            del pending[q]
        for at, q in offload.param_reads(queue, here + 1, self.disk_numel, pending=pending, budget=self.read_budget):
            key, offset = self.where[q]
            into = torch.empty(self.disk_numel[q], dtype=self.read_dtype)
            self.reads[q] = (at, self.disk.read_range_async(key, offset, into), into)

    def _drop_reads(self) -> None:
        """The masters are about to change (a step, a resident block): no shard read before is kept."""
        for _, future, _ in self.reads.values():
            self.disk.await_range(future)
        self.reads.clear()
        self.pos = 0

    def _write(self, i: int) -> None:
        """Start writing sub-group i: its masters and the optimizer's state of them, as they are now."""
        segs = self.segments[i]
        tensors = [self.store.segments[s].masters for s in sorted(segs)] + self.flat_steps.state_tensors(segs)
        self.disk.write(i, tensors)

    # ---- everything in memory for a while -------------------------------------------------------

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every offloaded sub-group in memory for the block, written back after it (with the
        state the block made or replaced)."""
        self._drop_reads()
        ins = [i for i, g in enumerate(self.groups) if g.offloaded and self.disk.on_disk(i)]  # none without a disk
        ins += [("params", i) for i in self.param_files]
        for key in ins:
            self.disk.read(key)
        for key in ins:
            self.disk.await_read(key)
        try:
            yield
        finally:
            for key in ins:
                if isinstance(key, tuple):
                    self._write_params(key[1])
                else:
                    self._write(key)
                    self.disk.await_write(key)

    def stats(self) -> dict[str, float]:
        total = {**self._disk_stats(), **(self.copied if self.host else {}),
                 **({"param_bytes_to_device": self.store.param_bytes_to_device} if self.store.params_on_host else {}),
                 **(self.read_counts if self.store.from_disk is not None else {})}
        return {**total, **{f"step_{k}": v for k, v in self.last.items() if k in total},
                "offloaded_subgroups": sum(g.offloaded for g in self.groups), "subgroups": len(self.groups)}

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def describe(config, host: torch.device | None = None, pinned: bool = False) -> str:
    """The log's word on offload (fz3/shell/log.py), "" without it. `host`: the store's (the
    optimizer steps in host memory apart from the device)."""
    parts = []
    if host is not None:
        parts.append(f"the optimizer steps on the host ({'pinned' if pinned else 'pageable'} buffers): each "
                     "sub-group's grads are copied there before its step and its stepped masters back into the "
                     "compute shards while the next one steps")
    for name, section in (("offload_optimizer", config.offload_optimizer), ("offload_param", config.offload_param)):
        if section.device == "cpu" and host is not None and name == "offload_optimizer":
            continue
        if section.device == "cpu" and host is not None:
            parts.append("offload_param 'cpu': the params' compute shards live in host memory, refreshed there "
                         "after each step, and each gather copies its shards to the device")
            continue
        if section.device == "cpu":
            parts.append(f"{name} 'cpu': the ranks compute on the CPU, where these already live; nothing moves")
        elif section.device == "nvme" and name == "offload_param":
            fp32 = config.compute_dtype == "fp32" and config.offload_optimizer.device == "nvme"
            parts.append("offload_param 'nvme': the params' shards are " + (
                "their fp32 masters, on disk with the optimizer's sub-groups" if fp32 else
                f"on disk in files of their own under {section.nvme_path}, written after each step (the persistent "
                "ones stay in memory)") + "; each gather reads its params' shards from there, ahead of it along "
                "the last window's order")
        elif section.device == "nvme":
            o = config.offload_optimizer
            parts.append(f"{name} 'nvme' under {section.nvme_path}: the fp32 masters and optimizer state of "
                         f"{'all' if o.ratio == 1 else f'a share {o.ratio} of'} the optimizer's sub-groups "
                         f"(sub_group_size {config.sub_group_size:,}) on disk between steps, read and written "
                         f"around each sub-group's step (pipeline_read {o.pipeline_read}, pipeline_write "
                         f"{o.pipeline_write})")
    return "; ".join(parts)
