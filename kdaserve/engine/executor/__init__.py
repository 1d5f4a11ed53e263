"""Executors: how the engine core reaches its model runner(s) (docs/parallelism.md)."""

from kdaserve.engine.executor.base import Executor, ExecutorError

__all__ = ["Executor", "ExecutorError"]
