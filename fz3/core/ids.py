r"""Small typed ids and the status enums of the parameter lifecycle.

    NOT_AVAILABLE --AllGather--> INFLIGHT --Wait--> AVAILABLE --Free--> NOT_AVAILABLE
          \____________________ (sync gather) _______/

    trace:  INVALID --reset_step--> RECORD --reset_step--> COMPLETE
               ^                                  |  (a step departs from the recording)
               +----------------------------------+
"""
from __future__ import annotations

from enum import IntEnum
from typing import NewType

ParamId = NewType("ParamId", int)  # DeepSpeed's ds_id; index into the param table
ModuleId = NewType("ModuleId", int)  # depth-first pre-order from the root (root = 0)
Handle = NewType("Handle", int)  # one AllGather in flight; waited exactly once or drained
BucketId = NewType("BucketId", int)  # one reduce of an IPG bucket


class Status(IntEnum):
    """Where a parameter's full (gathered) value is. DeepSpeed's ZeroParamStatus."""

    NOT_AVAILABLE = 0  #: only this rank's shard is resident; the full param does not exist
    INFLIGHT = 1  #: an AllGather was issued and not yet waited; do not read, do not free
    AVAILABLE = 2  #: the full param is resident and may be computed with


class TraceMode(IntEnum):
    """State of the recorded module order that drives prefetch. DeepSpeed's ZeRoTraceMode."""

    INVALID = 0  #: no usable trace: fetch on demand only (start, or after a departure)
    RECORD = 1  #: this step records the order of module fetches
    COMPLETE = 2  #: the recording is frozen; each fetch is checked against it and prefetches
