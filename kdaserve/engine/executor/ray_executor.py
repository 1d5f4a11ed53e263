"""One Ray actor per rank (docs/parallelism.md, "Across machines with Ray").

Ray places the ranks (a placement group of one bundle per rank: a GPU on CUDA, a CPU core
otherwise) and runs them as actors; torch.distributed stays the data path: the actors join one
process group over tcp:// at rank 0's node and a port rank 0's actor found free there. Every
actor runs the same rank code as a spawned worker (worker.py): rank 0's actor answers the
engine core's calls and publishes each message to the others, which run the follow loop. A
rank that dies (its actor's follow call fails) or does not answer in time ends the engine with
an `ExecutorError` naming it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kdaserve.config import ConfigError, EngineConfig
from kdaserve.engine.executor.base import ExecutorError, RankExecutor

if TYPE_CHECKING:  # for annotations only: importing an executor loads no llguidance
    from kdaserve.structured.manager import StructuredOutputs

logger = logging.getLogger("kdaserve")

LOCAL_OBJECT_STORE_BYTES = 100 << 20    # step messages are small; Ray's default is 30% of RAM


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--distributed-executor ray needs Ray: pip install 'kdaserve[ray]' "
                          "(or pip install ray)") from None
    return ray


def _probe(address: str, timeout_s: float = 10.0) -> None:
    """A HOST:PORT that accepts no connection fails now: ray.init would retry it for
    minutes."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return                           # ray://, "auto", ...: Ray's own resolution
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ExecutorError(f"no Ray cluster answers at {address} ({exc}); start one with "
                            "`ray start --head` (docs/parallelism.md)") from None


def connect(address: str | None) -> bool:
    """Join the cluster at `address`, else $RAY_ADDRESS, else start a local one. True when
    this call started Ray (and shutdown should stop it)."""
    ray = _import_ray()
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        _probe(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError) as exc:
            hint, cause = "", exc
            while cause is not None and "auth" not in str(cause).lower():
                cause = cause.__cause__ or cause.__context__
            if cause is not None:
                hint = (" (the cluster uses token authentication: set RAY_AUTH_MODE=token "
                        "here, with its token in ~/.ray/auth_token or RAY_AUTH_TOKEN)")
            raise ExecutorError(f"cannot join the Ray cluster at {address}{hint}: "
                                f"{_first_line(exc)}") from None
    else:
        ray.init(include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                 logging_level=logging.WARNING)
    return True


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "cause", None) or exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class RankActor:
    """One rank inside a Ray actor (made remote in `RayExecutor`)."""

    def __init__(self, log_level: int) -> None:
        logging.basicConfig(level=log_level,
                            format="%(asctime)s %(levelname)s [ray rank] %(name)s: %(message)s")
        self.state = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it: rank 0's rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, rank: int, world_size: int, init_method: str, config: EngineConfig,
              plan, local_rank: int | None) -> int:
        import torch

        from kdaserve.engine.executor.worker import start_rank

        torch.set_num_threads(config.num_threads or 1)
        self.state = start_rank(rank, world_size, init_method, config, plan, local_rank)
        return os.getpid()

    def follow(self) -> None:
        from kdaserve.distributed.parallel_state import destroy_distributed
        from kdaserve.engine.executor.worker import follow

        follow(self.state)
        destroy_distributed()

    def call(self, msg: tuple):
        from kdaserve.distributed.parallel_state import destroy_distributed
        from kdaserve.engine.executor.worker import publish, run_on_rank

        publish(self.state.ctx, msg)
        if msg[0] == "shutdown":
            destroy_distributed()
            return None
        return run_on_rank(self.state, msg)


@dataclass
class _Held:
    """What the executor holds in Ray, released by `_stop` (also at exit)."""

    started: bool                      # this process started Ray: stop it too
    actors: list = field(default_factory=list)
    follows: list = field(default_factory=list)    # the followers' follow() calls
    pg: object | None = None
    graceful: bool = True              # False after a failure: kill, do not ask


def _stop(held: _Held, grace_s: float = 10.0) -> None:
    import ray

    if not ray.is_initialized():
        return
    if held.graceful and held.follows:
        try:      # rank 0 publishes the stop: every rank leaves its process group
            ray.get(held.actors[0].call.remote(("shutdown",)), timeout=grace_s)
            ray.wait(held.follows, num_returns=len(held.follows), timeout=grace_s)
        except Exception as exc:      # noqa: BLE001 - a rank is gone: kill them all below
            logger.debug("Ray ranks did not stop by themselves: %s", exc)
    for a in held.actors:
        ray.kill(a, no_restart=True)
    if held.pg is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(held.pg)
    if held.started:
        ray.shutdown()


class RayExecutor(RankExecutor):
    def __init__(self, config: EngineConfig, plan, structured: StructuredOutputs,
                 startup_timeout_s: float = 900.0, placement_timeout_s: float = 120.0) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._init_ranks(config, structured)
        par = config.parallel
        self.timeout_s = par.worker_timeout_s + 30.0    # rank 0's collectives fail first
        self._held = _Held(started=connect(par.ray_address))
        self._finalizer = weakref.finalize(self, _stop, self._held)
        self.actors = self._held.actors
        gpu = config.device.startswith("cuda")
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        # one node: all ranks on it or a clear failure. Several: PACK still fills as few nodes
        # as fit (the collectives of a step are latency-bound: fewer hops is faster), but may
        # spill onto the next node where STRICT_PACK would never place a layout bigger than
        # one node; SPREAD would cross nodes on purpose.
        strategy = "STRICT_PACK" if len(nodes) <= 1 else "PACK"
        try:
            pg = self._held.pg = placement_group([bundle] * self.world_size, strategy=strategy)
            try:
                ray.get(pg.ready(), timeout=placement_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ExecutorError(
                    f"Ray could not place {self.world_size} ranks of {bundle} ({strategy}) "
                    f"within {placement_timeout_s:.0f} s; the cluster has "
                    f"{ray.cluster_resources()} on {len(nodes)} node(s)") from None
            actor_cls = ray.remote(RankActor)
            level = logging.getLogger("kdaserve").getEffectiveLevel()
            for rank in range(self.world_size):
                self.actors.append(actor_cls.options(
                    num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=rank)).remote(level))
            ip, port = self._get(self.actors[0].address.remote(), startup_timeout_s,
                                 "starting")
            init = f"tcp://{ip}:{port}"
            starts = [a.start.remote(r, self.world_size, init, config, plan, 0 if gpu else None)
                      for r, a in enumerate(self.actors)]
            self.worker_pids = self._start_all(starts, startup_timeout_s)
            self._held.follows.extend(a.follow.remote() for a in self.actors[1:])
        except BaseException:
            self.shutdown()
            raise
        logger.info("kdaserve: %d Ray actors ready (%s placement, rendezvous %s)",
                    self.world_size, strategy, init)

    def _start_all(self, refs: list, timeout_s: float) -> list[int]:
        """Every rank's start; the first that fails (rank 0 would wait for it until the
        rendezvous timeout) ends the startup."""
        import ray

        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
            if not ready:
                raise ExecutorError(f"the Ray actors did not start within {timeout_s:.0f} s")
            try:
                ray.get(ready[0])
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                rank = refs.index(ready[0])
                raise ExecutorError(f"the Ray actor of rank {rank} failed to start: "
                                    f"{_first_line(exc)}") from None
        return ray.get(refs)

    def check_alive(self) -> None:
        why = None if self._closed or not self._held.follows else self._dead_follower()
        if why is not None:
            raise ExecutorError(f"a worker died while the engine was idle: {why}")

    def _dead_follower(self) -> str | None:
        """Which follow call ended (a follower only returns on shutdown, so: it died)."""
        import ray

        done, _ = ray.wait(self._held.follows, num_returns=len(self._held.follows), timeout=0)
        for ref in done:
            rank = 1 + self._held.follows.index(ref)
            try:
                ray.get(ref)
                return f"rank {rank} stopped"
            except Exception as exc:       # noqa: BLE001 - RayActorError, RayTaskError
                return f"the Ray actor of rank {rank} died ({_first_line(exc)})"
        return None

    def _get(self, ref, timeout_s: float, doing: str):
        """rank 0's answer, watching the followers meanwhile; fatal errors shut down."""
        import ray

        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._abort()
                raise ExecutorError(f"Ray rank 0 did not answer within {timeout_s:.0f} s "
                                    f"while {doing}")
            ready, _ = ray.wait([ref, *self._held.follows], num_returns=1, timeout=min(left, 1.0))
            if ref in ready:
                try:
                    return ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    if self.world_size == 1 and doing != "starting":
                        raise exc.as_instanceof_cause() from None   # one request's failure
                    why = self._dead_follower() or f"rank 0 failed: {exc.cause!r}"
                except ray.exceptions.RayActorError as exc:
                    why = f"the Ray actor of rank 0 died ({_first_line(exc)})"
                self._abort()
                raise ExecutorError(f"a rank failed while {doing}: {why}")
            if ready:
                time.sleep(0.2)          # rank 0 may report the same failure: either will do
                why = self._dead_follower()
                self._abort()
                raise ExecutorError(f"a rank failed while {doing}: {why}")

    def _call(self, msg: tuple, doing: str):
        if self._closed:
            raise ExecutorError("the executor is shut down")
        return self._get(self.actors[0].call.remote(msg), self.timeout_s, doing)


    def _abort(self) -> None:
        self._held.graceful = False
        self.shutdown()
