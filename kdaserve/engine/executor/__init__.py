"""Executors: how the engine core reaches its model runner(s) (docs/parallelism.md)."""

from kdaserve.engine.executor.base import Executor, ExecutorError

__all__ = ["Executor", "ExecutorError", "start_ranks"]


def start_ranks(config, plan, structured) -> Executor:
    """The executor of a multi-rank layout, by who starts the ranks: the engine (mp),
    torchrun, or Ray."""
    kind = config.parallel.executor
    if kind == "torchrun":
        from kdaserve.engine.executor.torchrun import TorchrunExecutor

        return TorchrunExecutor(config, plan, structured)
    if kind == "ray":
        from kdaserve.engine.executor.ray_executor import RayExecutor

        return RayExecutor(config, plan, structured)
    from kdaserve.engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, plan, structured)
