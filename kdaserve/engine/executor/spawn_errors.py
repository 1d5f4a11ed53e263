"""Why a spawned worker died before it could say so over its pipe.

A spawned worker first re-imports the engine's main script (as `__mp_main__`), then runs
`worker_main`. A script that creates `LLM(...)` without an `if __name__ == "__main__":` guard
runs that again in the worker, which then tries to start workers of its own, and
multiprocessing refuses ("An attempt has been made to start a new process before the current
process has finished its bootstrapping phase"). The worker dies there, before its pipe exists,
so the engine saw only "rank 0 exited with code 1". The engine names a file in the environment
its workers inherit; a worker dying that way writes its error there, and the engine's error
carries it and the fix.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ERROR_FILE_ENV = "KDASERVE_WORKER_STARTUP_ERROR_FILE"
MAIN_GUARD_FIX = ('put the code that creates LLM(...) under `if __name__ == "__main__":`; '
                  "worker processes are spawned and re-import the main script")


def bootstrapping() -> bool:
    """This process is a spawned worker still importing the main script."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def report_from_worker(exc: BaseException) -> BaseException:
    """In a worker that failed to start workers while importing the main script: write the
    error where the engine reads it, and return the error to raise, which names the fix."""
    # multiprocessing's message spans lines of advice on freeze_support(): its first
    # sentence is the cause
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        try:
            Path(path).write_text(text, encoding="utf-8")
        except OSError:
            pass            # the engine still says which rank died
    return RuntimeError(f"{MAIN_GUARD_FIX} (this worker process re-imported the main script, "
                        f"which creates another LLM: {_cause(text)})")


def _cause(text: str) -> str:
    return text.split(". ")[0].rstrip(".") + "."


@contextmanager
def error_file() -> Iterator[Path]:
    """A file for the workers started meanwhile to write a startup error to (named in the
    environment they inherit); removed afterwards. In a worker re-importing the main script,
    the file its engine named (it will report there)."""
    if bootstrapping():
        yield Path(os.environ.get(ERROR_FILE_ENV) or os.devnull)
        return
    fd, name = tempfile.mkstemp(prefix="kdaserve-worker-", suffix=".err")
    os.close(fd)
    saved = os.environ.get(ERROR_FILE_ENV)
    os.environ[ERROR_FILE_ENV] = name
    try:
        yield Path(name)
    finally:
        if saved is None:
            os.environ.pop(ERROR_FILE_ENV, None)
        else:
            os.environ[ERROR_FILE_ENV] = saved


def explain(path: Path) -> str:
    """What a worker wrote to the startup error file, with the fix; '' when nothing."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        return ""
    if not text:
        return ""
    return f"; the worker's error: {_cause(text)}\nfix: {MAIN_GUARD_FIX}"
