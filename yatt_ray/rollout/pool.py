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
  a broadcast group from the pusher, one flat buffer per dtype a bucket: NCCL from the trainer's GPU to the
  engines' when both sides have CUDA (`group_backend`; the weights never pass through a host), gloo over host
  copies otherwise. `rollout.weight_transport` forces either. An engine never shares
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
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import ray
import torch

from yatt_ray.errors import YattError
from yatt_ray.rollout.base import Completion, GenerateRequest, Generation, OnFinished, derive_seed

log = logging.getLogger(__name__)

Bucket = list[tuple[str, torch.Tensor]]
# a weight version: (the training function's attempt in this run, pushes in that attempt); a restarted run's
# pushes are newer than every push before it, so an engine never keeps weights the resumed run rolled back
Tag = tuple[int, int]
INITIAL: Tag = (0, -1)  # the model directory's weights
STATS = (  # an engine pool's counters, summed per step (`take_stats`); the queue wait is its maximum
    "rollout/engine_requests", "rollout/resent_prompts", "rollout/engine_refreshes", "rollout/weight_timeouts",
    "rollout/failed_broadcasts", "rollout/engine_queue_s_max",
)  # fmt: skip
Weights = Callable[[], Iterable[Iterable[tuple[str, torch.Tensor]]]]  # the policy's buckets, gathered anew
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
REQUEST_THREADS = 256  # an engine actor's threads for requests (waiting ones hold one each)


class WeightsMissing(YattError):
    """A request waited `rollout.weight_timeout_s` for a weight version no push had brought to its engine."""


class StaleAttempt(YattError):
    """A request from a training attempt that a newer attempt replaced: dropped, not run (nobody reads it)."""


@dataclass
class _Ticket:
    """A request queued on an engine actor: the weights it asks for, its attempt, and its answer once run."""

    request: GenerateRequest
    version: Tag
    attempt: int
    arrived: float = field(default_factory=time.monotonic)
    result: tuple[list, int, Tag, float] | None = None
    error: BaseException | None = None
    done: bool = False

    def joins(self, other: _Ticket) -> bool:
        """Whether `other` may run in one engine call with this one: the same sampling but for the seed, and no
        long-tail abort (`finish_after` counts the prompts of one request)."""
        a, b = self.request, other.request
        return (
            a.finish_after is None
            and b.finish_after is None
            and replace(a.spec, seed=None) == replace(b.spec, seed=None)
        )


class EngineActor:
    """One rollout engine in an actor of its own (`make_engine` inside), with the weight version it holds.

    Requests from every controller queue here and run together: when the engine is free, the oldest request
    whose weights are in takes every queued request it can share an engine call with (`_Ticket.joins`) and
    runs them as one batch (one continuous batch in vLLM, one decode loop in the HF engine). A request waits
    for its weight version at most `weight_timeout_s` of the time that version is missing (neither held nor
    kept as a push); time queued behind other requests does not count. A request of an older training attempt
    than one seen since is dropped. Pushes, `info` and the broadcast group run on a concurrency group of their
    own (`control`), so no number of waiting requests delays a push."""

    def __init__(
        self, kind: str, model_dir: str, threads: int, engine_kwargs: dict[str, Any], ordered: bool = False,
        weight_timeout_s: float = 600.0, join_requests: bool = True,
    ) -> None:  # fmt: skip
        from yatt_ray.rollout import make_engine

        if threads > 0:
            torch.set_num_threads(threads)
        self.engine = make_engine(kind, model_dir, **engine_kwargs)
        self.ready = threading.Condition()  # guards everything below; the engine runs one batch at a time
        self.version: Tag = INITIAL  # the model directory's weights
        self.attempt = 0  # the newest training attempt seen (requests of older ones are dropped)
        self.weight_timeout_s = weight_timeout_s
        self.group: Any = None
        self.store: Any = None
        self.group_device = "cpu"  # where broadcast buckets land: "cuda" in an NCCL group
        self.staged: list[Bucket] = []  # buckets received through the broadcast group, not applied yet
        self.missed: Tag | None = None  # a broadcast push that failed here: requests for it bounce at once
        # pushes not applied yet, oldest first: the newest only, unless `ordered`
        self.pending: list[tuple[Tag, list[Bucket]]] = []
        # rollout.ordered: a request runs on exactly the version it asks for, alone; a push waits behind the
        # requests asking for older versions (`asked`: the versions of the requests waiting or running)
        self.ordered = ordered
        self.join_requests = join_requests and not ordered  # rollout.join_requests
        self.asked: list[Tag] = []
        self.queue: list[_Ticket] = []  # requests waiting, oldest first
        self.running = False  # a batch holds the engine
        self.in_flight_pushes = 0  # pushes applied between the decode steps of a running request
        self.batches = 0  # engine calls so far
        self.batched_requests = 0  # requests they served
        self.receiving = 0  # broadcast buckets being received now (a push under way)

    @ray.method(concurrency_group="control")
    def info(self) -> dict[str, Any]:
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),  # a new one after a restart
            "version": self.version,
            "in_flight_pushes": self.in_flight_pushes,
            "kept_pushes": len(self.pending),
            "running": self.running,
            "queued": len(self.queue),
            "batches": self.batches,
            "batched_requests": self.batched_requests,
            "receiving": self.receiving,
            "takes_image_features": bool(getattr(self.engine, "takes_image_features", False)),
            "cuda": torch.cuda.is_available(),  # a GPU engine: an NCCL broadcast group can reach it
        }

    def generate(
        self, request: GenerateRequest, version: Tag, pid: int, attempt: int = 0
    ) -> tuple[list, int, Tag, float] | None:
        """(per prompt its completions or None if aborted, aborted count, the weight version that started
        them, seconds it queued). None when this is not the process `pid` the caller knew (restarted: it holds
        the model directory's weights), or when a broadcast push of `version` failed here: the caller pushes
        the weights or goes elsewhere. Otherwise it waits until it holds weights of `version` or newer and the
        engine is free (see the class docstring); a newer version is fine, and is reported (asynchronous
        rollout). An engine that takes weights in flight (`in_flight_updates`: the HF engine on a text model)
        applies a push that arrives meanwhile between two decode steps, and the request's unfinished
        completions continue under it (each token's version in `Completion.versions`); other engines apply it
        when the batch ends. `ordered`: requests run alone, no push is applied in flight, and none past
        `version` before this request ran, so it runs on `version` exactly (unless the engine restarted
        meanwhile and was given newer weights). Raises `WeightsMissing` after `weight_timeout_s` of missing
        weights, `StaleAttempt` for a request of an attempt older than one seen."""
        if pid != os.getpid():
            return None
        ticket = _Ticket(request, version, attempt)
        with self.ready:
            if self.missed is not None and self.version < version and version >= self.missed:
                return None
            self._see_attempt(attempt)
            self.queue.append(ticket)
            self.asked.append(version)
            self._apply_pending()  # the pushes this request waits for, if nothing older waits
            batch = self._wait_turn(ticket)
        if batch:
            self._run(batch)
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    def _see_attempt(self, attempt: int) -> None:
        """A newer training attempt: the requests of older ones still queued are dropped (woken to leave)."""
        if attempt > self.attempt:
            self.attempt = attempt
            self.ready.notify_all()

    def _runnable(self, ticket: _Ticket) -> bool:
        return self.version >= ticket.version and ticket.attempt >= self.attempt

    def _missing(self, version: Tag) -> bool:
        """No weights of `version` or newer held or kept (`ordered`: of `version` itself, the only one such a
        request runs on): a push is still on its way, or lost."""
        kept = [v for v, _ in self.pending]
        if self.version >= version:
            return False
        return version not in kept if self.ordered else all(v < version for v in kept)

    def _wait_turn(self, ticket: _Ticket) -> list[_Ticket]:
        """Under `ready`: wait until `ticket` was run by another request's batch ([]) or is the oldest runnable
        request on a free engine (the batch it runs, itself first). Only the time its weights are missing
        counts toward `weight_timeout_s`."""
        missing_s = 0.0
        while not ticket.done:
            if ticket.attempt < self.attempt:
                self._leave([ticket])
                raise StaleAttempt(
                    f"request of training attempt {ticket.attempt} dropped: attempt {self.attempt} has started"
                )
            if not self.running and next((t for t in self.queue if self._runnable(t)), None) is ticket:
                return self._take_batch(ticket)
            missing = self._missing(ticket.version)
            if missing and missing_s >= self.weight_timeout_s:
                self._leave([ticket])
                raise WeightsMissing(
                    f"rollout engine: weights of version {ticket.version} did not arrive within "
                    f"rollout.weight_timeout_s={self.weight_timeout_s:g} s (holds {self.version}); the "
                    "controller pushes them again or sends the prompts to another engine"
                )
            start = time.monotonic()
            self.ready.wait(timeout=max(0.01, min(1.0, self.weight_timeout_s - missing_s)))
            if missing:
                missing_s += time.monotonic() - start
        return []

    def _take_batch(self, first: _Ticket) -> list[_Ticket]:
        """Under `ready`: `first` and every queued runnable request that joins it (none with `ordered` or
        without `rollout.join_requests`), out of the queue; the engine is taken."""
        joining = (
            [t for t in self.queue if t is not first and self._runnable(t)] if self.join_requests else []
        )
        batch = [first, *[t for t in joining if first.joins(t)]]
        self.queue = [t for t in self.queue if t not in batch]
        self.running = True
        return batch

    def _leave(self, tickets: list[_Ticket]) -> None:
        """Under `ready`: `tickets` are done (answered, dropped or timed out); a push they held back may load."""
        for t in tickets:
            t.done = True
            if t in self.queue:
                self.queue.remove(t)
            self.asked.remove(t.version)
        self._apply_pending()
        self.ready.notify_all()

    def _run(self, batch: list[_Ticket]) -> None:
        """Run `batch` on the engine (one call; each request alone if the joint call fails, so one bad
        request fails only itself), answer each ticket, free the engine."""
        try:
            try:
                self._call(batch)
            except Exception:
                if len(batch) == 1:
                    raise
                for ticket in batch:
                    try:
                        self._call([ticket])
                    except Exception as exc:  # noqa: BLE001  (handed to that request's caller)
                        ticket.error = exc
        except Exception as exc:  # noqa: BLE001
            batch[0].error = exc
        finally:
            with self.ready:
                self.running = False
                self._leave(batch)

    def _call(self, batch: list[_Ticket]) -> None:
        """One engine call for the prompts of `batch`, in order; each ticket gets its share of the answer."""
        start, now = self.version, time.monotonic()
        request = batch[0].request if len(batch) == 1 else _joined([t.request for t in batch])
        if getattr(self.engine, "in_flight_updates", False) and not self.ordered:
            engine: Any = self.engine  # `generate` with `updates` (not part of the RolloutEngine protocol)
            out = engine.generate(request, updates=_Pending(self), version=start)
        else:
            out = self.engine.generate(request)
        self.batches += 1
        self.batched_requests += len(batch)
        offset = 0
        for ticket in batch:
            part = out[offset : offset + len(ticket.request.prompts)]
            offset += len(part)
            ticket.result = (part, part.count(None), start, now - ticket.arrived)

    @ray.method(concurrency_group="control")
    def apply(self, version: Tag, *buckets: Bucket) -> None:
        """Every bucket of weight `version`, then the version: at once when no request runs, else kept until
        the running request reaches a decode step boundary (or its end). Pushes are sent without waiting, so
        two may arrive out of order: one older than what the engine holds is skipped, and so is one older than
        a kept push (unless `ordered`, where each is kept, in order, until no request asks for older weights)."""
        self._apply(version, list(buckets))

    def _apply(self, version: Tag, buckets: list[Bucket]) -> None:
        with self.ready:
            self._see_attempt(version[0])
            kept = [v for v, _ in self.pending]
            newest = max([self.version, *kept]) if not self.ordered else self.version
            if version <= newest or version in kept:
                return
            push = (version, buckets)
            self.pending = sorted([*self.pending, push], key=lambda p: p[0]) if self.ordered else [push]
            self._apply_pending()
            self.ready.notify_all()  # a request waiting for this version stops counting it missing

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
        if self.missed is not None and version >= self.missed:
            self.missed = None
        self.in_flight_pushes += int(self.running)
        self.ready.notify_all()

    @ray.method(concurrency_group="control")
    def finish_weight_sync(self, version: Tag) -> None:
        """The end of a push through the broadcast group: the buckets `receive` staged, applied at once (a
        request between two buckets never sees half of the new weights)."""
        staged, self.staged = self.staged, []
        self._apply(version, staged)

    @ray.method(concurrency_group="control")
    def missed_push(self, version: Tag) -> None:
        """A broadcast push of `version` failed before it was whole here (another member died): drop what was
        staged; requests for it bounce at once until a later push loads (their controller goes elsewhere)."""
        with self.ready:
            self.staged = []
            if self.version < version:
                self.missed = version
            self.ready.notify_all()

    @ray.method(concurrency_group="control")
    def join_group(
        self, host: str, port: int, rank: int, size: int, prefix: str, backend: str = "gloo"
    ) -> None:
        """Join the pusher's broadcast group (`backend` gloo or nccl) as `rank` (blocks until every member
        joined); a group joined before is left (its pusher formed a new one)."""
        import torch.distributed as dist

        self.staged, self.group = [], None
        self.store = dist.TCPStore(host, port, size, False, timeout=GROUP_TIMEOUT)
        self.group = _process_group(backend, dist.PrefixStore(prefix, self.store), rank, size)
        self.group_device = "cuda" if backend == "nccl" else "cpu"

    @ray.method(concurrency_group="control")
    def receive(self, meta: list[tuple[str, tuple[int, ...], str]]) -> None:
        """One bucket through the broadcast group: `meta` names each tensor's shape and dtype, in order."""
        if self.group is None:
            raise YattError("rollout engine: a broadcast bucket arrived before this engine joined the group")
        buffers = {
            dt: torch.empty(n, dtype=getattr(torch, dt), device=self.group_device)
            for dt, n in _flat_sizes(meta).items()
        }
        self.receiving += 1
        try:
            for buffer in buffers.values():
                _broadcast(self.group, buffer)
        except Exception:
            self.staged = []  # the push failed (a member or the pusher died): none of it is applied
            raise
        finally:
            self.receiving -= 1
        self.staged.append(list(_unflatten(meta, buffers)))  # applied with the rest by finish_weight_sync


def _joined(requests: list[GenerateRequest]) -> GenerateRequest:
    """Requests that join (`_Ticket.joins`) as one: their prompts (and images) in turn, the first one's
    sampling with a seed mixed from all of theirs (None if any has none)."""
    seeds = [r.spec.seed for r in requests]
    seed = None if None in seeds else derive_seed(*[s for s in seeds if s is not None])
    has_images = any(r.images is not None for r in requests)
    images = [im for r in requests for im in (r.images or [None] * len(r.prompts))] if has_images else None
    return GenerateRequest(
        prompts=[p for r in requests for p in r.prompts],
        spec=replace(requests[0].spec, seed=seed),
        images=images,
    )


@dataclass
class _Pending:
    """An engine actor's kept push, as the engine's in-flight weight updates (`rollout.base.InFlightWeights`)."""

    actor: EngineActor

    def ready(self) -> bool:
        return bool(self.actor.pending)

    def take(self) -> Tag | None:
        return self.actor._take_pending()


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
    transport: str = "auto", ordered: bool = False, weight_timeout_s: float = 600.0, join_requests: bool = True,
) -> EngineHandles:  # fmt: skip
    """The driver's part: `count` engine actors with `resources` each ({"CPU": c, "GPU": 1}, plus any custom
    resource of the nodes they must run on) and the router.
    Each engine restarts when it dies (its sub-requests are sent again by the pools). `ordered`: see
    `rollout.ordered`; `weight_timeout_s`, `join_requests`: the `rollout.` keys of those names."""
    threads = int(resources.get("CPU", 0))
    gpus = resources.get("GPU", 0.0)
    options = dict(
        num_cpus=resources.get("CPU", 1.0), num_gpus=gpus, max_restarts=-1, max_task_retries=0,
        resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
        # a waiting request holds a thread: room for every controller's requests of K + 1 steps, resends
        # included (more queue in Ray); pushes and `info` have threads of their own
        max_concurrency=REQUEST_THREADS,
    )  # fmt: skip
    actor = ray.remote(concurrency_groups={"control": 4})(EngineActor)  # type: ignore[call-overload]
    run = uuid.uuid4().hex[:8]  # named per run (the dashboard, `ray.get_actor`, the drills)
    engines: list[Any] = [
        actor.options(**options, name=f"yatt-engine-{run}-{i}").remote(  # type: ignore[arg-type]
            kind,
            model_dir,
            threads,
            {**engine_kwargs, "seed": engine_kwargs.get("seed", 0) + i},
            ordered,
            weight_timeout_s,
            join_requests,
        )  # fmt: skip
        for i in range(count)
    ]
    router = ray.remote(EngineRouter).options(num_cpus=0).remote(count)
    ray.get([e.info.remote() for e in engines])  # started (models loaded) before the trainers need them
    return EngineHandles(engines, router, transport, ordered)


def stop_engine_pool(handles: EngineHandles) -> None:

    for actor in [*handles.engines, handles.router]:
        ray.kill(actor, no_restart=True)


class EnginePool:
    """A controller's view of the engine actors, with the `RolloutEngine` interface (see the module docstring).

    `pusher`: this controller pushes weights (data-parallel group 0's); `weights`: gathers the policy's buckets
    for a restarted engine (None when gathering needs other ranks, tp_size > 1); `seed`: this controller's
    sampling stream; `rank`: its data-parallel rank (where `ordered` routing starts)."""

    asynchronous = True  # `submit` / `wait`: requests run on the actors while the controller trains

    def __init__(
        self, handles: EngineHandles, pusher: bool, weights: Weights | None, seed: int, attempt: int = 1,
        rank: int = 0,
    ) -> None:  # fmt: skip
        self.engines, self.router, self.transport = handles.engines, handles.router, handles.transport
        self.ordered, self.rank = handles.ordered, rank
        self.pusher, self.weights, self.seed = pusher, weights, seed
        infos = [_wait_until_up(e) for e in self.engines]
        self.takes_image_features = infos[0]["takes_image_features"]
        self.nodes = [i["node"] for i in infos]
        # the training function's start in this run: the versions of earlier starts are older
        self.attempt = attempt
        self.version = -1  # pushes so far in this attempt (-1: the model directory's weights)
        self.calls = 0  # requests without a seed so far: the sampling stream's position
        self.last_aborted = 0
        self.stats = dict.fromkeys(STATS, 0.0)
        self._group_members: list[int] = []  # engines on the broadcast group (pusher only)
        self._backend = "gloo"  # the broadcast group's (`group_backend`)
        self._group: Any = None
        self._store: Any = None
        self._pids = [i["pid"] for i in infos]  # each engine's process as this controller last knew it
        self._group_pids: list[int] = []  # the members' processes when the group formed (pusher only)
        self._syncing = False
        self._push_failed = False  # a broadcast of this push failed (pusher only): the members get it again
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
            groups, aborted, version, queued_s = out
            self.stats["rollout/engine_queue_s_max"] = max(self.stats["rollout/engine_queue_s_max"], queued_s)
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
            call = self.engines[engine].generate.remote(sub, self.tag, self._pids[engine], self.attempt)
            pending[call] = (engine, part)
        return pending

    def _result(self, ref: Any, engine: int) -> tuple[list, int, Tag, float] | None:
        """A sub-request's answer, or None: its engine died, restarted, or waited past
        `rollout.weight_timeout_s` for the weights (a slow engine is slow, a lost push is pushed again)."""
        try:
            return ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            log.warning("rollout engine %d failed (%s); its prompts go out again", engine, type(exc).__name__)
        except WeightsMissing as exc:
            self.stats["rollout/weight_timeouts"] += 1
            log.warning("rollout engine %d: %s", engine, str(exc).splitlines()[-1])
        return None

    def _refresh(self, engine: int) -> bool:
        """Make `engine` hold this controller's weights, waiting for it to be up (restarted): True when it holds
        them already (the pusher refreshed it since) or this controller pushed them; False when it cannot
        gather them alone (tp_size > 1) or the engine does not come back."""
        actor = self.engines[engine]
        try:
            info = _wait_until_up(actor)
            if (
                info["version"] >= self.tag
            ):  # restarted, then given the weights: this controller learns its id
                self._pids[engine] = info["pid"]
                return True
            if self.weights is None:
                return False
            self._pids[engine] = info["pid"]
            refs = [ray.put(list(bucket)) for bucket in self.weights()]
            ray.get(actor.apply.remote(self.tag, *refs), timeout=GROUP_TIMEOUT.total_seconds())
        except (YattError, ray.exceptions.RayError) as exc:
            log.warning("rollout engine %d could not be given the weights (%s)", engine, type(exc).__name__)
            return False
        self.stats["rollout/engine_refreshes"] += 1
        return True

    # ---- weight sync ------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket of the new weights (the pusher only; other controllers skip it): into the object store
        for the engines on this node, through the broadcast group to the others."""

        if not self.pusher:
            return
        if not self._syncing:  # the push's first bucket: the previous push applied, every engine up
            self._check_engines()
            self._syncing = True
        bucket = [(name, t.detach()) for name, t in named_tensors]
        if len(self._broadcast_members()) < len(self.engines):  # once: every engine on the node reads it
            self._buckets.append(ray.put([(name, t.cpu()) for name, t in bucket]))
        if self._group_members and not self._push_failed:
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
        members = self._broadcast_members()
        local = [e for i, e in enumerate(self.engines) if i not in members]
        self._applying = [e.apply.remote(self.tag, *self._buckets) for e in local]
        if members and not self._push_failed:
            try:
                ray.get([self.engines[i].finish_weight_sync.remote(self.tag) for i in members])
            except ray.exceptions.RayError as exc:
                self._broadcast_failed(exc)
        if self._push_failed:
            self._push_again([self.engines[i] for i in members])
        self._buckets, self._syncing, self._push_failed = [], False, False

    def wait_applied(self) -> None:
        """Until every engine applied the latest push (one that died meanwhile gets the next push instead)."""

        for call in self._applying:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                ray.get(call)
        self._applying = []

    def _check_engines(self) -> None:
        """The previous push applied (an engine that died meanwhile restarts with the model directory's
        weights and gets these); every engine up; a member of the broadcast group that restarted since the
        group formed (whoever met it first) means a new group."""
        self.wait_applied()
        pids = [_wait_until_up(e)["pid"] for e in self.engines]
        if self._group is not None and any(
            pids[i] != self._group_pids[k] for k, i in enumerate(self._group_members)
        ):
            self._group = self._store = None  # formed again, with the restarted engines, on first use
        self._pids = pids

    def _broadcast_members(self) -> list[int]:
        """Engines that get weights through the broadcast group: those on other nodes (auto), all (broadcast)
        or none (object_store); the group is formed on first use (not again within a push it failed)."""
        if self._group is None and self.transport != "object_store" and not self._push_failed:
            here = ray.get_runtime_context().get_node_id()
            members = [
                i for i, node in enumerate(self.nodes) if self.transport == "broadcast" or node != here
            ]
            if members:
                infos = [ray.get(self.engines[i].info.remote()) for i in members]
                self._backend = group_backend(
                    torch.cuda.is_available(), [info.get("cuda", False) for info in infos]
                )
                self._group, self._store = _form_group([self.engines[i] for i in members], self._backend)
            self._group_members = members
            self._group_pids = [self._pids[i] for i in members]
        return self._group_members

    def _push_by_broadcast(self, bucket: Bucket) -> None:
        """One bucket to the group's members. A member that dies meanwhile fails the broadcast: the group is
        dropped (formed again at the next push) and the members get this push again (`_push_again`)."""
        meta = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]
        refs = [self.engines[i].receive.remote(meta) for i in self._group_members]
        try:
            device = "cuda" if self._backend == "nccl" else "cpu"
            for buffer in _flatten([(name, t.to(device)) for name, t in bucket]).values():
                _broadcast(self._group, buffer)
            ray.get(refs, timeout=GROUP_TIMEOUT.total_seconds())
        except Exception as exc:  # noqa: BLE001  (gloo's errors are RuntimeErrors; Ray's, RayErrors)
            self._broadcast_failed(exc)

    def _broadcast_failed(self, exc: BaseException) -> None:
        """A member of the broadcast group died during a push: drop the group (its other members' waits end as
        its connections close); the rest of the push skips it and `finish_weight_sync` sends the push again."""
        log.warning("weight broadcast to the rollout engines failed (%s); pushing again", type(exc).__name__)
        self._push_failed = True
        self._group = self._store = None
        self.stats["rollout/failed_broadcasts"] += 1

    def _push_again(self, members: list[Any]) -> None:
        """The push the broadcast failed to finish, again, to each member up now that does not hold it: through
        the object store with the weights gathered anew (tp_size 1), else told it missed the push (its requests
        bounce and go elsewhere until the next push). A member still restarting gets it when met, or at the
        next push."""
        refs: list[Any] | None = None
        for actor in members:
            try:
                info = ray.get(actor.info.remote(), timeout=60)
            except ray.exceptions.RayError:
                continue  # restarting: refreshed when a request meets it, and in the next push's new group
            if info["version"] >= self.tag:
                continue
            if self.weights is None:
                self._applying.append(actor.missed_push.remote(self.tag))
                continue
            refs = refs if refs is not None else [ray.put(list(b)) for b in self.weights()]
            self._applying.append(actor.apply.remote(self.tag, *refs))

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
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.info.remote(), timeout=max(deadline - time.monotonic(), 1.0))
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            if time.monotonic() > deadline:
                raise YattError(
                    f"a rollout engine did not come back within {timeout_s:.0f} s: see its actor's log "
                    "(`ray logs`), or lower placement.rollout_engines"
                ) from None
            time.sleep(0.2)  # restarting: ask again shortly


def group_backend(pusher_cuda: bool, members_cuda: list[bool]) -> str:
    """The broadcast group's backend: "nccl" (device to device) when the pusher and every member have a GPU,
    else "gloo" (host copies)."""
    return "nccl" if pusher_cuda and members_cuda and all(members_cuda) else "gloo"


def _process_group(backend: str, store: Any, rank: int, size: int) -> Any:
    import torch.distributed as dist

    if backend == "nccl":  # on this process's current GPU; NCCL connects at the first broadcast
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, GROUP_TIMEOUT)


def _form_group(members: list[Any], backend: str = "gloo") -> tuple[Any, Any]:
    """A broadcast group of `backend`: this process (rank 0, the store's host) and `members` (ranks 1..)."""
    import torch.distributed as dist

    host = ray.util.get_node_ip_address()
    size = len(members) + 1
    store = dist.TCPStore(host, 0, size, True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
    prefix = f"engines-{socket.gethostname()}-{store.port}"
    joins = [
        m.join_group.remote(host, store.port, r + 1, size, prefix, backend) for r, m in enumerate(members)
    ]
    group = _process_group(backend, dist.PrefixStore(prefix, store), 0, size)
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
