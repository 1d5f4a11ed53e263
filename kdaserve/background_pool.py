"""Thread pools for work that must not slow the requests being served: a grammar's first
compile, decoding an uploaded image. Their threads run at a lower scheduling priority (nice
+10), so on a machine with few cores the engine's forward and the HTTP loop keep their share
while a costly compile or decode goes on. Linux sets niceness per thread; where that is not
available (macOS, Windows) the threads keep the process's priority."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

NICENESS = 10


def _lower_this_thread() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + NICENESS)
    except OSError:         # a sandbox that forbids it: the work still runs
        pass


def background_pool(max_workers: int, name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name,
                              initializer=_lower_this_thread)
