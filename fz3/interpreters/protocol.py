"""What the engine asks of the interpreter it is given (issue #12: an injected interpreter).

    Engine(model, optimizer, config, device=..., rank=r, world_size=W,
           interpreter=lambda store: SomeInterpreter(store, ...))

The engine builds its tensor store, then the interpreter over it, and from then on hands it every
effect the core returns. Two interpreters implement this:

    DistInterpreter  (dist.py)     torch.distributed: gloo (point-to-point or gloo's own
                                   collectives), nccl, hccl; what fz3.initialize runs
    PlanInterpreter  (planned.py)  a meta-device store, no process group, no data: what fz3.plan
                                   runs to count a run of any world size before it happens

Both count their collectives with fz3/interpreters/accounting.py, so engine.stats() means the
same under either. DistInterpreter moves its bytes through a transport (transport.py):
torch.distributed on a process group, or a rank of a ThreadWorld (threads.py: N ranks as
threads of one process, fz3.launch.run_threads), so the same engine and interpreter also run
without processes. (The simulated world, simulated.py, runs effects for N ranks at once on bare
tensors, below the engine: the core's property machines drive it.)
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol

import torch


@dataclass(frozen=True)
class Capabilities:
    """What an interpreter's carriers can do that the core's decisions depend on, read once by
    the engine when it builds the core's state (fz3.core.grad.grads.init_grad_state)."""
    in_place_reduce_scatter: bool = False  # its reduce-scatter sends each grad from where it lies
    # (gloo's p2p carrier): the core then holds grads (HoldGrad) on the reduce_scatter path
    # instead of copying them into a bucket (CopyToBucket), [Note: copy or hold]
    hold_budget: int = 0  # elements of held grads its reduce-scatter gains from batching; the
    # core reduces a bucket of held grads at the smaller of this and reduce_bucket_size ([Note:
    # hold budget], fz3/core/grad/grads.py); 0: no budget
    shared_memory: bool = False  # its point-to-point messages of 64 KiB or more go through
    # rings in /dev/shm (Options.shared_memory: fz3/interpreters/shared_memory.py); the log says so


class Interpreter(Protocol):
    counts: Counter  # the COUNTERS of engine.stats() (fz3/shell/engine.py), and more
    capabilities: Capabilities
    agreement: Optional[Any]  # the divergence check (fz3/interpreters/agreement.py); None: none
    held_bytes: int  # bytes of grads held for a reduce (HoldGrad), now
    peak_held_bytes: int  # ... and at most since the interpreter was made
    secondary_bytes: int  # bytes of hpZ's secondary shards kept, now ([Note: hpZ], fz3/core/stage.py)
    peak_secondary_bytes: int  # ... and at most since the interpreter was made

    def run(self, effects: Iterable[object]) -> None:
        """Carry out the core's effects, in order."""

    def end_of_backward(self) -> None:
        """The backward is over: let go of what only it needed (the CPU buffer pool's free buffers)."""

    def bucket_bytes(self) -> int:
        """Bytes of IPG bucket buffers allocated (engine.stats()["reduce_buffer_bytes"])."""

    def pool_bytes(self) -> int:
        """Bytes the buffer pool holds (engine.stats()["pool_bytes"])."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over ranks (the global grad norm's squares), in place where it can."""

    def finite(self, norm: torch.Tensor) -> bool:
        """Whether the global grad norm (the same on every rank) is finite: the step is taken."""

    def any_rank(self, flags: tuple[bool, ...]) -> tuple[bool, ...]:
        """Each flag ORed over ranks (every rank passes as many): the leaf params some rank got a
        grad for; () for () with no collective."""

    def broadcast(self, t: torch.Tensor) -> None:
        """Every rank's `t` becomes rank 0's (the buffers: fz3/shell/buffers.py)."""
