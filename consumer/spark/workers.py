"""What the SDK's Spark tasks do to the Python worker they run in (one module for every kind of task: the
`ticdc` source's reads and the Delta writes on the executors, which share the same workers)."""

from __future__ import annotations

import gc
import sys

from pyspark import TaskContext

_settled_modules = 0  # how many modules this worker had imported when its objects were last frozen


def settle_worker() -> None:
    """After a task that imported modules into its Python worker (a worker's first read task: ~100k
    objects; its first Delta write: deltalake's), take what the worker holds by then out of the cyclic
    garbage collector for good (`gc.freeze`). PySpark's daemon runs a full `gc.collect()` after every task
    of a reused worker, before it takes the next: over those objects that took 0.15-0.3 s each time. Only in
    tasks (a driver reading a range is left alone), and only when modules were imported since the last
    time: a later task's own objects stay collectable."""
    global _settled_modules
    if len(sys.modules) == _settled_modules or TaskContext.get() is None:
        return
    _settled_modules = len(sys.modules)
    gc.collect()
    gc.freeze()
