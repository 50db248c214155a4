"""All ranks or none: before a multi-rank operation changes anything (loading a checkpoint or
weights, publishing a save), every rank learns which ranks failed, so all raise together or all
go on. One all-reduce replaces a barrier that a failed rank would never reach (a hang until the
process group's timeout).

`outcomes` says more than `failed_ranks`: each rank's own code (an error, or the signal that
interrupted it), and which peers left (their process ended: killed, or stopped by a signal
they could not report), each named by rank instead of one raw transport error. `strings`: every
rank's text (the save_dir each rank gave).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

OUTCOMES = 2**31 - 2
"""The tag of `outcomes`' messages: below the divergence check's DESCRIPTORS (2**31 - 1), and
sent only between steps (a checkpoint is taken at an accumulation boundary), when no
collective's data is in flight under a tag made from a descriptor."""


def every_rank(engine, kind: int, numel: int = 0) -> None:
    """The user's call `kind` (agreement.CALLS), which every rank must make at the same point:
    its descriptor goes first, so a rank that calls it alone (under `if master_process:`) gets a
    DivergenceError naming the call, on every rank, once the others reach their next checked
    collective, instead of a hang in its first gather."""
    ag = engine.interp.agreement
    if ag is not None:
        ag.check(kind, (), numel)


def failed_ranks(engine, failed: bool) -> list[int]:
    """The ranks of `engine`'s group that report `failed`, the same list on every rank."""
    flags = torch.zeros(engine.world_size, dtype=torch.int32, device=engine.store.device)  # (W,)
    flags[engine.rank] = int(failed)
    engine.transport.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


class Outcomes(NamedTuple):
    codes: dict[int, int]  # rank -> its code (0: it went well), every rank that answered, this one too
    gone: dict[int, str]  # rank -> why its answer never came (the transport's error)


def outcomes(engine, code: int) -> Outcomes:
    """Every rank's `code`, sent by each rank to each other one under the OUTCOMES tag, so that a
    peer whose process ended is named (`gone`) rather than failing this rank with the
    transport's own error ("Connection closed by peer"). On gloo and thread worlds the
    divergence check's transport carries them; elsewhere (NCCL without the check) one
    all-reduce, which cannot name a peer that left."""
    ag = engine.interp.agreement
    comm = ag.comm if ag is not None else engine.transport
    if engine.world_size == 1 or comm.backend not in ("gloo", "threads"):
        codes = torch.zeros(engine.world_size, dtype=torch.int64, device=engine.store.device)  # (W,)
        codes[engine.rank] = code
        engine.transport.all_reduce(codes)
        return Outcomes(dict(enumerate(codes.tolist())), {})
    peers = [j for j in range(engine.world_size) if j != engine.rank]
    mine, got = torch.tensor([code], dtype=torch.int64), {j: torch.zeros(1, dtype=torch.int64) for j in peers}
    codes, gone, timeout = {engine.rank: code}, {}, comm.timeout()
    works = {}
    for j in peers:
        try:
            works[j] = (comm.irecv(got[j], j, OUTCOMES), comm.isend(mine, j, OUTCOMES))
        except RuntimeError as e:
            gone[j] = f"{type(e).__name__}: {e}"
    for j, (recv, send) in works.items():
        try:
            recv.wait(timeout=timeout)
            send.wait(timeout=timeout)
            codes[j] = int(got[j])
        except RuntimeError as e:  # gloo: the peer closed its connections; a thread world: WorldFailed
            gone[j] = f"{type(e).__name__}: {e}"
    return Outcomes(codes, gone)


def strings(engine, text: str) -> list[str]:
    """Every rank's `text`, in rank order, the same list on every rank: the lengths in one
    all-reduce, then the UTF-8 bytes, padded to the longest, in one all-gather."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    lengths = torch.zeros(engine.world_size, dtype=torch.int64, device=engine.store.device)  # (W,)
    lengths[engine.rank] = data.numel()
    engine.transport.all_reduce(lengths)
    sizes = lengths.tolist()
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=engine.store.device)  # (L,)
    mine[:data.numel()] = data.to(mine.device)
    every = torch.empty(engine.world_size * longest, dtype=torch.uint8, device=engine.store.device)  # (W * L,)
    engine.transport.all_gather_into(every, mine)
    rows = every.cpu().view(engine.world_size, longest)
    return [bytes(rows[r, :n].tolist()).decode() for r, n in enumerate(sizes)]
