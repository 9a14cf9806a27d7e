"""Rollout engines as a placed pool: engine actors of their own, one router, weights from the trainer.

With `placement.mode=disaggregated` and `placement.rollout_engines = E > 0`, the rollout engines are E Ray
actors (`EngineActor`), each on an accelerator of its own (on CPUs: `placement.cpus_per_engine` CPUs), started
by the driver before the trainers and restarted by Ray when they die. Every controller reaches them through an
`EnginePool`, which has the `RolloutEngine` interface, so the collector drives it as it drives an in-process
engine.

- Routing: one `EngineRouter` actor for the run counts each engine's outstanding work (prompt tokens + n x
  max_new_tokens per prompt) and assigns a request's prompts to the least-loaded engines, heaviest first; a
  prompt's n samples always run on one engine. The sub-requests go from the controller to the engines
  directly: samples never pass through the router or the driver.
- Weights: after a train step the controller of data-parallel group 0 pushes the policy to every engine, in
  buckets, and every controller moves to the new weight version. An engine on the pusher's node reads each
  bucket from the node's object store (one `ray.put`, shared memory); engines on other nodes receive it through
  a gloo broadcast group from the pusher (host copies of the weights; an NCCL group between GPUs is not wired
  yet), one flat buffer per dtype a bucket. `rollout.weight_transport` forces either. An engine never shares
  the trainer's accelerator here (that is the in-process engine's case, where weights move in memory). A push
  that arrives while a request runs is applied between two of its decode steps (`InFlightWeights`); the
  request's unfinished samples continue under the new weights, each token labelled with its version.
- Failures: a restarted engine holds the model directory's weights, so it is stale. A sub-request that meets a
  dead or stale engine is sent again, after this controller pushed the current weights to that engine (when it
  can gather them alone, `train.tp_size=1`) or to another engine. The collector gets every prompt back.
- Sampling: a request without a seed gets one from the controller's seed and a call counter (the pool's
  checkpointed random state), so a run given the same routing samples the same again.
- `rollout.ordered`: routing by a fixed rule (`spread`) instead of the router's loads, and each request on
  exactly the weight version it asks for: an engine keeps pushes in version order and applies the next only
  once no request waiting or running asks for older weights (none in flight). Two runs with one seed then
  generate the same samples, asynchronous ones too.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from yatt_ray.errors import YattError
from yatt_ray.rollout.base import Completion, GenerateRequest, OnFinished, derive_seed

log = logging.getLogger(__name__)

Bucket = list[tuple[str, torch.Tensor]]
# a weight version: (the training function's attempt in this run, pushes in that attempt); a restarted run's
# pushes are newer than every push before it, so an engine never keeps weights the resumed run rolled back
Tag = tuple[int, int]
INITIAL: Tag = (0, -1)  # the model directory's weights
Weights = Callable[[], Iterable[Iterable[tuple[str, torch.Tensor]]]]  # the policy's buckets, gathered anew
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


class EngineActor:
    """One rollout engine in an actor of its own (`make_engine` inside), with the weight version it holds."""

    def __init__(
        self, kind: str, model_dir: str, threads: int, engine_kwargs: dict[str, Any], ordered: bool = False
    ) -> None:
        from yatt_ray.rollout import make_engine

        if threads > 0:
            torch.set_num_threads(threads)
        self.engine = make_engine(kind, model_dir, **engine_kwargs)
        # calls run on a few threads (a weight push need not wait behind every queued request); the engine
        # itself is used by one at a time, under `ready`
        self.ready = threading.Condition()
        self.version: Tag = INITIAL  # the model directory's weights
        self.group: Any = None
        self.store: Any = None
        self.staged: list[Bucket] = []  # buckets received through the broadcast group, not applied yet
        # pushes not applied yet, oldest first: the newest only, unless `ordered`
        self.pending: list[tuple[Tag, list[Bucket]]] = []
        # rollout.ordered: a request runs on exactly the version it asks for; a push waits behind the requests
        # asking for older versions (`asked`: the versions of the requests waiting or running)
        self.ordered = ordered
        self.asked: list[Tag] = []
        self.running = False  # a request holds the engine
        self.in_flight_pushes = 0  # pushes applied between the decode steps of a running request

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "node": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),  # a new one after a restart
            "version": self.version,
            "in_flight_pushes": self.in_flight_pushes,
            "kept_pushes": len(self.pending),
            "running": self.running,
            "takes_image_features": bool(getattr(self.engine, "takes_image_features", False)),
        }

    def generate(self, request: GenerateRequest, version: Tag, pid: int) -> tuple[list, int, Tag] | None:
        """(per prompt its completions or None if aborted, aborted count, the weight version that started
        them). None when this is not the process `pid` the caller knew (restarted: it holds the model
        directory's weights): the caller pushes them or goes elsewhere. Otherwise it waits until it holds
        weights of `version` or newer (a push may still be on its way); a newer version is fine, and is
        reported (asynchronous rollout). One request runs at a time. An engine that takes weights in flight
        (`in_flight_updates`: the HF engine on a text model) applies a push that arrives meanwhile between
        two decode steps, and the request's unfinished completions continue under it (each token's version
        in `Completion.versions`); other engines apply it when the request ends. `ordered`: no push is applied
        in flight, and none past `version` before this request ran, so it runs on `version` exactly (unless
        the engine restarted meanwhile and was given newer weights)."""
        if pid != os.getpid():
            return None
        with self.ready:
            self.asked.append(version)
            self._apply_pending()  # the pushes this request waits for, if nothing older waits
            if not self.ready.wait_for(
                lambda: not self.running and self.version >= version, GROUP_TIMEOUT.total_seconds()
            ):
                self.asked.remove(version)
                raise YattError(
                    f"rollout engine: weights of version {version} never arrived (holds {self.version})"
                )
            self.running, start = True, self.version
        try:
            if getattr(self.engine, "in_flight_updates", False) and not self.ordered:
                engine: Any = (
                    self.engine
                )  # `generate` with `updates` (not part of the RolloutEngine protocol)
                out = engine.generate(request, updates=_Pending(self), version=start)
            else:
                out = self.engine.generate(request)
            return out, int(self.engine.last_aborted), start
        finally:
            with self.ready:
                self.running = False
                self.asked.remove(version)
                self._apply_pending()
                self.ready.notify_all()

    def apply(self, version: Tag, *buckets: Bucket) -> None:
        """Every bucket of weight `version`, then the version: at once when no request runs, else kept until
        the running request reaches a decode step boundary (or its end). Pushes are sent without waiting, so
        two may arrive out of order: one older than what the engine holds is skipped, and so is one older than
        a kept push (unless `ordered`, where each is kept, in order, until no request asks for older weights)."""
        with self.ready:
            kept = [v for v, _ in self.pending]
            newest = max([self.version, *kept]) if not self.ordered else self.version
            if version <= newest or version in kept:
                return
            push = (version, list(buckets))
            self.pending = sorted([*self.pending, push], key=lambda p: p[0]) if self.ordered else [push]
            self._apply_pending()

    def _apply_pending(self) -> None:
        """Load the kept pushes that may be loaded now: none while a request runs (it takes them itself, between
        decode steps, `_take_pending`); `ordered`: oldest first, each only once no request asks for older."""
        with self.ready:
            if self.running:
                return
            if not self.ordered:
                self._take_pending()
            while self.pending and all(v >= self.pending[0][0] for v in self.asked):
                self._load(*self.pending.pop(0))

    def _take_pending(self) -> Tag | None:
        """Load the newest kept push, if any, dropping older ones (the caller holds the engine: no request
        runs, or between two of its decode steps); return its version, or None."""
        with self.ready:
            if not self.pending:
                return None
            version, buckets = self.pending[-1]
            self.pending = []
            self._load(version, buckets)
            return version

    def _load(self, version: Tag, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            self.engine.load_weights(bucket)
        self.engine.finish_weight_sync()
        self.version = version
        self.in_flight_pushes += int(self.running)
        self.ready.notify_all()

    def finish_weight_sync(self, version: Tag) -> None:
        """The end of a push through the broadcast group: the buckets `receive` staged, applied at once (a
        request between two buckets never sees half of the new weights)."""
        staged, self.staged = self.staged, []
        self.apply(version, *staged)

    def join_group(self, host: str, port: int, rank: int, size: int, prefix: str) -> None:
        """Join the pusher's broadcast group as `rank` (blocks until every member joined)."""
        import torch.distributed as dist

        self.store = dist.TCPStore(host, port, size, False, timeout=GROUP_TIMEOUT)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.store), rank, size, GROUP_TIMEOUT)

    def receive(self, meta: list[tuple[str, tuple[int, ...], str]]) -> None:
        """One bucket through the broadcast group: `meta` names each tensor's shape and dtype, in order."""
        buffers = {dt: torch.empty(n, dtype=getattr(torch, dt)) for dt, n in _flat_sizes(meta).items()}
        for buffer in buffers.values():
            _broadcast(self.group, buffer)
        self.staged.append(list(_unflatten(meta, buffers)))  # applied with the rest by finish_weight_sync


@dataclass
class _Pending:
    """An engine actor's kept push, as the engine's in-flight weight updates (`rollout.base.InFlightWeights`)."""

    actor: EngineActor

    def ready(self) -> bool:
        return bool(self.actor.pending)

    def take(self) -> Tag | None:
        return self.actor._take_pending()


@dataclass
class Generation:
    """A request in flight on the engines (`EnginePool.submit`): its sub-requests, and per prompt the results
    and the weight version that produced them (`EnginePool.age` tells how old)."""

    request: GenerateRequest
    costs: list[int]
    results: list[list[Completion] | None]
    versions: list[Tag]
    pending: dict[Any, tuple[int, list[int]]] = field(default_factory=dict)
    avoid: set[int] = field(default_factory=set)  # stale engines this controller cannot refresh


@dataclass(frozen=True)
class EngineHandles:
    """What the driver hands the workers: the engine actors and the router (picklable Ray handles)."""

    engines: list[Any]
    router: Any
    transport: str  # auto | object_store | broadcast (rollout.weight_transport)
    ordered: bool = False  # rollout.ordered: exact versions, prompts routed by a fixed rule (`spread`)


class EngineRouter:
    """Outstanding work per engine; assigns prompts to the least-loaded engines (heaviest prompt first)."""

    def __init__(self, engines: int) -> None:
        self.load = [0] * engines

    def assign(self, costs: list[int], exclude: list[int]) -> list[int]:
        """An engine index per prompt: each prompt, heaviest first, to the engine outside `exclude` with the
        least work so far."""
        usable = [e for e in range(len(self.load)) if e not in exclude]
        assigned = [0] * len(costs)
        for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
            engine = min(usable, key=lambda e: self.load[e])
            assigned[i] = engine
            self.load[engine] += costs[i]
        return assigned

    def release(self, engine: int, cost: int) -> None:
        self.load[engine] = max(self.load[engine] - cost, 0)

    def loads(self) -> list[int]:
        return list(self.load)


def spread(costs: list[int], engines: list[int], first: int) -> list[int]:
    """An engine per prompt by a fixed rule (`rollout.ordered`): heaviest prompt first (ties by index), each to
    the engine with the least of this request's work, ties to the engine nearest after position `first` of
    `engines` (a controller's rank: controllers start on different engines). The same costs give the same
    assignment whatever else the engines are doing."""
    rank = {e: (k - first) % len(engines) for k, e in enumerate(engines)}
    load = dict.fromkeys(engines, 0)
    assigned = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        engine = min(engines, key=lambda e: (load[e], rank[e]))
        assigned[i] = engine
        load[engine] += costs[i]
    return assigned


def start_engine_pool(
    kind: str, model_dir: str, count: int, resources: dict[str, float], engine_kwargs: dict[str, Any],
    transport: str = "auto", ordered: bool = False,
) -> EngineHandles:  # fmt: skip
    """The driver's part: `count` engine actors with `resources` each ({"CPU": c, "GPU": 1}) and the router.
    Each engine restarts when it dies (its sub-requests are sent again by the pools). `ordered`: see
    `rollout.ordered`."""
    import ray

    threads = int(resources.get("CPU", 0))
    gpus = resources.get("GPU", 0.0)
    actor = ray.remote(EngineActor).options(
        num_cpus=resources.get("CPU", 1.0), num_gpus=gpus, max_restarts=-1, max_task_retries=0,
        max_concurrency=32,  # requests waiting for a push's version must leave a thread for the push
    )  # fmt: skip
    engines: list[Any] = [
        actor.remote(
            kind, model_dir, threads, {**engine_kwargs, "seed": engine_kwargs.get("seed", 0) + i}, ordered
        )
        for i in range(count)
    ]
    router = ray.remote(EngineRouter).options(num_cpus=0).remote(count)
    ray.get([e.info.remote() for e in engines])  # started (models loaded) before the trainers need them
    return EngineHandles(engines, router, transport, ordered)


def stop_engine_pool(handles: EngineHandles) -> None:
    import ray

    for actor in [*handles.engines, handles.router]:
        ray.kill(actor, no_restart=True)


class EnginePool:
    """A controller's view of the engine actors, with the `RolloutEngine` interface (see the module docstring).

    `pusher`: this controller pushes weights (data-parallel group 0's); `weights`: gathers the policy's buckets
    for a restarted engine (None when gathering needs other ranks, tp_size > 1); `seed`: this controller's
    sampling stream; `rank`: its data-parallel rank (where `ordered` routing starts)."""

    def __init__(
        self, handles: EngineHandles, pusher: bool, weights: Weights | None, seed: int, attempt: int = 1,
        rank: int = 0,
    ) -> None:  # fmt: skip
        import ray

        self.engines, self.router, self.transport = handles.engines, handles.router, handles.transport
        self.ordered, self.rank = handles.ordered, rank
        self.pusher, self.weights, self.seed = pusher, weights, seed
        infos = ray.get([e.info.remote() for e in self.engines])
        self.takes_image_features = infos[0]["takes_image_features"]
        self.nodes = [i["node"] for i in infos]
        # the training function's start in this run: the versions of earlier starts are older
        self.attempt = attempt
        self.version = -1  # pushes so far in this attempt (-1: the model directory's weights)
        self.calls = 0  # requests without a seed so far: the sampling stream's position
        self.last_aborted = 0
        self.stats = {"rollout/engine_requests": 0.0, "rollout/resent_prompts": 0.0}
        self._group_members: list[int] = []  # engines on the broadcast group (pusher only)
        self._group: Any = None
        self._store: Any = None
        self._pids = [i["pid"] for i in infos]
        self._syncing = False
        self._buckets: list[Any] = []  # this push's buckets in the object store (pusher only)
        self._applying: list[Any] = []  # the engines' applies of the latest push, not waited for

    @property
    def tag(self) -> Tag:
        """The weight version this controller's requests ask for (or newer)."""
        return INITIAL if self.version < 0 else (self.attempt, self.version)

    def age(self, tag: Tag) -> int:
        """Pushes between the weights that generated a sample (`tag`) and this controller's: its staleness.
        The model directory's weights are push -1 of the first attempt; an earlier attempt's are older than
        any bound."""
        if tag == INITIAL:
            return self.version + 1
        return self.version - tag[1] if tag[0] == self.attempt else 2**31

    # ---- generation -------------------------------------------------------------------------------------
    def generate(
        self, request: GenerateRequest, on_finished: OnFinished | None = None
    ) -> list[list[Completion] | None]:
        """Split `request` over the engines by the router, gather the results in prompt order; each prompt's
        `on_finished` as its engine's part returns."""
        return self.wait(self.submit(request), on_finished)

    def submit(self, request: GenerateRequest) -> Generation:
        """Send `request` to the engines and return at once: `wait()` gathers it (asynchronous rollout keeps
        generating while the trainer trains)."""
        if request.spec.seed is None:  # a run given the same routing samples the same
            request = replace(request, spec=replace(request.spec, seed=derive_seed(self.seed, self.calls)))
            self.calls += 1
        costs = [len(p) + request.spec.n * request.spec.max_new_tokens for p in request.prompts]
        generation = Generation(
            request, costs, [None] * len(request.prompts), [INITIAL] * len(request.prompts)
        )
        generation.pending = self._dispatch(
            request, list(range(len(request.prompts))), costs, generation.avoid
        )
        return generation

    def wait(
        self, generation: Generation, on_finished: OnFinished | None = None
    ) -> list[list[Completion] | None]:
        """The results of a submitted request (prompts of a dead or stale engine sent again); the weight
        version of each prompt's samples lands in `generation.versions`."""
        import ray

        self.last_aborted = 0
        g = generation
        while g.pending:
            [ref], _ = ray.wait(list(g.pending), num_returns=1)
            engine, idxs = g.pending.pop(ref)
            if not self.ordered:  # ordered routing does not count loads
                self.router.release.remote(engine, sum(g.costs[i] for i in idxs))
            out = self._result(ref, engine)
            if out is None:  # died or stale: the same prompts again, after weights reached that engine
                if not self._refresh(engine):
                    g.avoid.add(engine)
                self.stats["rollout/resent_prompts"] += len(idxs)
                g.pending.update(self._dispatch(g.request, idxs, g.costs, g.avoid))
                continue
            groups, aborted, version = out
            self.last_aborted += aborted
            for i, group in zip(idxs, groups):
                g.results[i], g.versions[i] = group, version
                if group is not None and on_finished is not None:
                    on_finished(i, group)
        return g.results

    def _dispatch(
        self, request: GenerateRequest, idxs: list[int], costs: list[int], avoid: set[int]
    ) -> dict[Any, tuple[int, list[int]]]:
        """One sub-request per engine the router picks for prompts `idxs`: {ref: (engine, its prompts)}."""
        import ray

        if len(avoid) == len(self.engines):
            raise YattError(
                f"no rollout engine holds the policy's weights (version {self.version}): all "
                f"{len(self.engines)} restarted since the last push and this controller cannot push them alone "
                "(train.tp_size > 1); the run restarts from its last checkpoint"
            )
        if self.ordered:
            usable = [e for e in range(len(self.engines)) if e not in avoid]
            assigned = spread([costs[i] for i in idxs], usable, self.rank % len(usable))
        else:
            assigned = ray.get(self.router.assign.remote([costs[i] for i in idxs], sorted(avoid)))
        by_engine: dict[int, list[int]] = {}
        for i, engine in zip(idxs, assigned):
            by_engine.setdefault(engine, []).append(i)
        pending = {}
        for engine, part in by_engine.items():
            sub = _sub_request(request, part)
            self.stats["rollout/engine_requests"] += 1
            call = self.engines[engine].generate.remote(sub, self.tag, self._pids[engine])
            pending[call] = (engine, part)
        return pending

    def _result(self, ref: Any, engine: int) -> tuple[list, int, Tag] | None:
        import ray

        try:
            return ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            log.warning("rollout engine %d failed (%s); its prompts go out again", engine, type(exc).__name__)
            return None

    def _refresh(self, engine: int) -> bool:
        """Push the current weights to `engine` (restarted: it waits for it); False when this controller cannot
        gather them alone."""
        import ray

        if self.weights is None:
            return False
        actor = self.engines[engine]
        self._pids[engine] = _wait_until_up(actor)["pid"]
        refs = [ray.put(list(bucket)) for bucket in self.weights()]
        ray.get(actor.apply.remote(self.tag, *refs))
        return True

    # ---- weight sync ------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket of the new weights (the pusher only; other controllers skip it): into the object store
        for the engines on this node, through the broadcast group to the others."""
        import ray

        if not self.pusher:
            return
        if not self._syncing:  # the push's first bucket: the previous push applied, every engine up
            self._check_engines()
            self._syncing = True
        bucket = [(name, t.detach().cpu()) for name, t in named_tensors]
        if len(self._broadcast_members()) < len(self.engines):
            self._buckets.append(ray.put(bucket))  # once: every engine on the node reads the same object
        if self._group_members:
            self._push_by_broadcast(bucket)

    def finish_weight_sync(self, version: int | None = None) -> None:
        """This controller's requests ask for the new version from now on. The pusher sends each engine on its
        node the push's buckets and version without waiting: an engine applies them once its current request
        is done, and a request for the new version waits for them (the trainer goes on meanwhile)."""
        self.version = self.version + 1 if version is None else version
        if not self.pusher:
            return
        if not self._syncing:
            self._check_engines()
        local = [e for i, e in enumerate(self.engines) if i not in self._group_members]
        self._applying = [e.apply.remote(self.tag, *self._buckets) for e in local]
        if self._group_members:
            _finish([self.engines[i] for i in self._group_members], self.tag)
        self._buckets, self._syncing = [], False

    def wait_applied(self) -> None:
        """Until every engine applied the latest push (one that died meanwhile gets the next push instead)."""
        import ray

        for call in self._applying:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                ray.get(call)
        self._applying = []

    def _check_engines(self) -> None:
        """The previous push applied (an engine that died meanwhile restarts with the model directory's
        weights and gets these); every engine up; a restarted member of the broadcast group means a new
        group."""
        self.wait_applied()
        pids = [_wait_until_up(e)["pid"] for e in self.engines]
        if self._group is not None and any(pids[i] != self._pids[i] for i in self._group_members):
            self._group = self._store = None  # formed again, with the restarted engines, on first use
        self._pids = pids

    def _broadcast_members(self) -> list[int]:
        """Engines that get weights through the broadcast group: those on other nodes (auto), all (broadcast)
        or none (object_store); the group is formed on first use."""
        if self._group is None and self.transport != "object_store":
            import ray

            here = ray.get_runtime_context().get_node_id()
            members = [
                i for i, node in enumerate(self.nodes) if self.transport == "broadcast" or node != here
            ]
            if members:
                self._group, self._store = _form_group([self.engines[i] for i in members])
            self._group_members = members
        return self._group_members

    def _push_by_broadcast(self, bucket: Bucket) -> None:
        import ray

        meta = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]
        refs = [self.engines[i].receive.remote(meta) for i in self._group_members]
        for buffer in _flatten(bucket).values():
            _broadcast(self._group, buffer)
        ray.get(refs)

    # ---- the rest of the engine interface -----------------------------------------------------------------
    def take_stats(self) -> dict[str, float]:
        """Sub-requests sent and prompts sent again (after a dead or stale engine) since the last call."""
        stats, self.stats = self.stats, dict.fromkeys(self.stats, 0.0)
        return stats

    def sleep(self) -> int:
        return 0  # the engines hold accelerators of their own: nothing to give back

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass  # the driver stops the actors (stop_engine_pool)

    def rng_state(self) -> dict[str, torch.Tensor | None]:
        return {"pool_calls": torch.tensor([self.calls], dtype=torch.int64)}

    def set_rng_state(self, state: dict[str, torch.Tensor | None]) -> None:
        calls = state.get("pool_calls")
        if calls is None:
            raise YattError(
                "the checkpoint's rollout sampling state is an in-process engine's, not an engine pool's: resume "
                "with the placement the run was saved with (placement.rollout_engines)"
            )
        self.calls = int(calls.item())


def _sub_request(request: GenerateRequest, part: list[int]) -> GenerateRequest:
    """The prompts `part` of `request` (in order), with their images, share of `finish_after` and `wait_for`."""
    images = None if request.images is None else [request.images[i] for i in part]
    finish_after, wait_for = None, frozenset[int]()
    if request.finish_after is not None:
        local = {i: j for j, i in enumerate(part)}
        wait_for = frozenset(local[i] for i in request.wait_for if i in local)
        share = -(-request.finish_after * len(part) // len(request.prompts))  # ceil
        finish_after = min(max(share, 1), len(part))
    return GenerateRequest(
        prompts=[request.prompts[i] for i in part],
        spec=request.spec,
        images=images,
        finish_after=finish_after,
        wait_for=wait_for,
    )


def _wait_until_up(actor: Any, timeout_s: float = 600.0) -> dict[str, Any]:
    """The engine actor's `info()`, once it answers (a restarting one: its model loaded again); YattError after
    `timeout_s`."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.info.remote(), timeout=timeout_s)
        except ray.exceptions.ActorUnavailableError:  # restarting: ask again shortly
            if time.monotonic() > deadline:
                raise YattError(f"a rollout engine did not come back within {timeout_s:.0f} s") from None
            time.sleep(0.2)


def _finish(engines: list[Any], version: Tag) -> None:
    import ray

    ray.get([e.finish_weight_sync.remote(version) for e in engines])


def _form_group(members: list[Any]) -> tuple[Any, Any]:
    """A gloo group: this process (rank 0, the store's host) and `members` (ranks 1..)."""
    import ray
    import torch.distributed as dist

    host = ray.util.get_node_ip_address()
    size = len(members) + 1
    store = dist.TCPStore(host, 0, size, True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
    prefix = f"engines-{socket.gethostname()}-{store.port}"
    joins = [m.join_group.remote(host, store.port, r + 1, size, prefix) for r, m in enumerate(members)]
    group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 0, size, GROUP_TIMEOUT)
    ray.get(joins)
    return group, store  # the store must live as long as the group


def _broadcast(group: Any, buffer: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buffer], opts).wait()


def _flatten(bucket: Bucket) -> dict[str, torch.Tensor]:
    """One contiguous buffer per dtype, the bucket's tensors in order: {dtype name: [numel]}."""
    parts: dict[str, list[torch.Tensor]] = {}
    for _, t in bucket:
        parts.setdefault(str(t.dtype).removeprefix("torch."), []).append(t.reshape(-1))
    return {dt: torch.cat(ts) for dt, ts in parts.items()}


def _flat_sizes(meta: list[tuple[str, tuple[int, ...], str]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for _, shape, dt in meta:
        sizes[dt] = sizes.get(dt, 0) + int(torch.Size(shape).numel())
    return sizes


def _unflatten(
    meta: list[tuple[str, tuple[int, ...], str]], buffers: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    offsets = dict.fromkeys(buffers, 0)
    for name, shape, dt in meta:
        n = int(torch.Size(shape).numel())
        yield name, buffers[dt][offsets[dt] : offsets[dt] + n].view(shape)
        offsets[dt] += n
