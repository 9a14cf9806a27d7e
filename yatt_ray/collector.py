"""`RolloutCollector`: the rollout phase of one data-parallel group, owned by its controller.

It holds what the phase needs and nothing of training: the prompt feed (the group's stream, queue and data
position), the prompt encoder, the rollout engine, the scorer, and dynamic sampling's keep rate. One call a
step, `collect(step) -> RolloutBatch`: draw prompts, generate (over-sampling and abort of the long tail),
score, filter (dynamic sampling), and pack the kept groups into the scored batch the trainer phases read.
Asynchronous rollout's look-ahead window is scheduled here too: `collect(s)` ends by starting steps
s+1 .. s+K on the engine actors, and `collect_started` checks the staleness that schedule bounds.
`evaluate()` scores this group's share of the eval set greedily. `state_dict()` / `load_state_dict()` carry
the phase's own state across a checkpoint (the keep rate; the feed's position and the engine's sampling
stream are read by the checkpoint at each save).

The decisions are pure functions in `yatt_ray.draws`; the collector drives the engine, the scorer and the
feed. It runs without a cluster given an engine, a scorer and a feed (tests/unit/test_controller.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from yatt_ray.algos import ADVANTAGE_ESTIMATORS, staleness_stats
from yatt_ray.batch import Pixels, RolloutBatch, pack, prompt_images
from yatt_ray.config import Config
from yatt_ray.data.feed import describe_rejected
from yatt_ray.data.images import ERROR as IMAGE_ERROR
from yatt_ray.draws import Group, groups_to_finish, is_informative, prompts_to_start, split_finished, top_up
from yatt_ray.errors import DataError, YattError
from yatt_ray.metrics.timeline import SpanRecorder
from yatt_ray.metrics.timers import PhaseTimer
from yatt_ray.model_dir import ImageLayout
from yatt_ray.prompts import PromptEncoder
from yatt_ray.reward.rules import score_with_rule
from yatt_ray.reward.scorer import Sample
from yatt_ray.rollout.base import GenerateRequest, Generation, Images, RolloutEngine, SamplingSpec, complete

log = logging.getLogger(__name__)

ImageFeatures = Callable[[list[Pixels]], list[torch.Tensor]]  # the policy's `image_features`


@dataclass
class InFlight:
    """A step's prompts generating on the engine actors (asynchronous rollout)."""

    rows: list  # FeedRow, popped from the feed and not yet consumed
    encoded: list  # their EncodedPrompt
    generation: Generation
    streamed: set[int] = field(default_factory=set)  # prompts whose samples went to the GenRM
    judging: threading.Thread | None = None  # streams them as they finish, while the trainer trains


class RolloutCollector:
    """The rollout phase of data-parallel group `dp_rank` (module docstring).

    `feed` (a `PromptFeed`) and `engine` are set when they exist (the feed once the checkpoint's data position
    is known, the engine once started); `image_features` gives an engine that takes features (vLLM) the
    policy's own; `dp_group` is the controllers' process group (reads are in lockstep over it).
    """

    def __init__(
        self,
        config: Config,
        dp_rank: int,
        dp_size: int,
        *,
        scorer: Any,
        tokenizer: Any,
        reward_fn: Callable,
        timer: PhaseTimer,
        recorder: SpanRecorder,
        dp_group: Any = None,
        image_features: ImageFeatures | None = None,
    ) -> None:
        self.config, self.dp_rank, self.dp_size, self.dp_group = config, dp_rank, dp_size, dp_group
        self.scorer, self.tokenizer, self.reward_fn = scorer, tokenizer, reward_fn
        self.timer, self.recorder, self.image_features = timer, recorder, image_features
        self.share = config.train.prompts_per_step // dp_size  # prompt groups a step
        self.needs_greedy = ADVANTAGE_ESTIMATORS.get(config.algo.estimator).needs_greedy_baseline  # ReMax
        # partial / disaggregated: each prompt's samples go to the GenRM as soon as they finish generating
        self.streams_to_genrm = config.reward.mode != "rule" and config.placement.mode != "full"
        self.feed: Any = None
        self._engine: RolloutEngine | None = None  # `attach_engine`
        self.keep_rate = 1.0  # dynamic sampling: the fraction of drawn groups kept, estimated over steps
        self.step_rows: list = []  # the prompt rows the latest step consumed (trained on, or dropped)
        self.inflight: dict[int, InFlight] = {}  # asynchronous rollout: steps whose prompts are generating
        self.streaming = threading.Lock()  # one submitter at a time: this thread or an InFlight's `judging`
        self.stop_ids = tuple({tokenizer.eos_token_id} - {None})
        layout = ImageLayout.from_model_dir(config.model.path)  # None for a text policy
        self.prompts = PromptEncoder(
            tokenizer, config.data.max_prompt_tokens, layout, system_prompt=config.data.system_prompt
        )
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (tokenizer.eos_token_id or 0))  # masked out

    @property
    def engine(self) -> RolloutEngine:
        if self._engine is None:
            raise YattError("the rollout collector has no engine yet: attach_engine() it once started")
        return self._engine

    @engine.setter
    def engine(self, engine: RolloutEngine) -> None:
        self._engine = engine

    def attach_engine(self, engine: RolloutEngine, saved_rng: dict | None = None) -> None:
        """The rollout engine, once started; a resumed run's sampling stream (`saved_rng`, the checkpoint's)
        goes into it when the checkpoint's engine was of the same kind (engine actors, or in process), so it
        samples as the uninterrupted run would."""
        self.engine = engine
        if saved_rng is None:
            return
        if ("pool_calls" in saved_rng) == engine.asynchronous:  # an `EnginePool`'s state holds its call count
            engine.set_rng_state(saved_rng)
        else:  # placement.rollout_engines changed between the runs: a legitimate change of placement
            log.warning(
                "the checkpoint's sampling stream is that of %s; this run's start a fresh one (its samples "
                "differ from an uninterrupted run's)",
                "engine actors" if "pool_calls" in saved_rng else "in-process engines",
            )

    # ---- state across checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, float]:
        return {"keep_rate": self.keep_rate}

    def engine_rng_state(self) -> dict[str, torch.Tensor | None] | None:
        """The engine's sampling stream, for a checkpoint (None before an engine is attached)."""
        return None if self._engine is None else self._engine.rng_state()

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Dynamic sampling's keep rate only when dynamic sampling is on (else it would size every draw by a
        rate nothing updates)."""
        if self.config.algo.dynamic_sampling != "off":  # draws as it did before the stop
            self.keep_rate = float(state.get("keep_rate", 1.0))

    # ---- one step -------------------------------------------------------------------------------------------
    def collect(self, step: int) -> RolloutBatch:
        """The scored batch of `step`: draw, generate and score until the group holds its share of prompt
        groups. Asynchronous rollout (`rollout.max_staleness` = K > 0): the batch of the step started earlier
        (`collect_started`), then steps step+1 .. step+K start (`_start_ahead`: the look-ahead window).

        Every draw starts `ceil(rollout.over_sample x target)` prompts (queue first, then the stream), where
        `target` is what it still needs over the recent keep rate of dynamic sampling (1 without it); the
        engine aborts the rest once `target` have finished. Finished groups are taken in finish order; with
        `algo.dynamic_sampling`, groups whose samples all score the same are dropped (consumed) and more are
        taken (first the ones that finished past the need, then a new draw), at most `algo.max_draws` draws;
        then the batch is topped up with dropped groups. What finished but was not taken, and what was
        aborted, goes back to the queue unconsumed. Collective over the controllers (`_lockstep`): every group
        reads its stream in lockstep (see `yatt_ray.data.feed`).
        """
        if self.config.rollout.max_staleness > 0:
            batch = self.collect_started(step)
            self._start_ahead(step)
            return batch
        self.step_rows = []
        return self._finish(step, *self._draw_until_full(step))

    def _finish(
        self, step: int, kept: list[Group], dropped: list[Group], spare: list[Group], counts: dict[str, int]
    ) -> RolloutBatch:
        """The step's batch from its draws: spare groups back to the queue, the keep rate, the top-up and the
        draw counters."""
        dynamic = self.config.algo.dynamic_sampling
        self.scorer.discard([s for g in spare for s in g.samples])  # streamed to the GenRM, never scored
        back = [g.row for g in spare]
        if back:  # finished, but not needed this step: back to the queue too
            with self.recorder.span("requeue", busy=False):
                self.feed.requeue(back)
        counts["requeued"] += counts["aborted"] + len(back)
        if dynamic != "off" and kept + dropped:  # sizes the next step's draws (an EMA over steps)
            self.keep_rate = 0.5 * self.keep_rate + 0.5 * len(kept) / len(kept + dropped)
        if len(kept) < self.share:
            log.warning(
                "dynamic sampling: %d of %d prompt groups varied after algo.max_draws=%d draws; topping the batch "
                "up with %d uniform groups (raise algo.max_draws, or check the reward)",
                len(kept), self.share, self.config.algo.max_draws, self.share - len(kept),
            )  # fmt: skip
        batch = self._batch(step, top_up(kept, dropped, self.share))
        batch.counters.update({
            "rollout/aborted_prompts": float(counts["aborted"]),  # stopped in the engine
            "rollout/requeued_prompts": float(counts["requeued"]),  # aborted + finished but not needed
        })  # fmt: skip
        if dynamic != "off":
            batch.counters.update({
                "dynamic/draws": float(counts["draws"]),
                "dynamic/drawn_groups": float(len(kept) + len(dropped)),
                "dynamic/dropped_groups": float(len(dropped)),
                "dynamic/batch_full": float(len(kept) >= self.share),
            })  # fmt: skip
        return batch

    # ---- asynchronous rollout (rollout.max_staleness > 0; engine actors) ----------------------------------------
    def _start_ahead(self, step: int) -> None:
        """The look-ahead window, once step `step` is collected and before it trains: steps step+1 .. step+K
        (K = `rollout.max_staleness`, up to `train.steps`) start, so the engines generate them while the
        trainer trains; `collect_started` relies on this schedule for its staleness bound."""
        last = min(step + self.config.rollout.max_staleness, self.config.train.steps)
        with self.timer.phase("rollout"):
            for ahead in range(step + 1, last + 1):
                self.start(ahead)

    def start(self, step: int) -> None:
        """Draw step `step`'s share of prompts and send it to the engine actors now; `collect(step)` gathers it,
        so the engines generate while the trainer trains. The rows stay unconsumed (held in flight) until
        trained: a checkpoint taken meanwhile leaves them to be read and generated again by a resumed run.
        Collective over the controllers (the lockstep read)."""
        if step in self.inflight:
            return
        want = groups_to_finish(self.share, self.keep_rate)  # the share; more with dynamic sampling's filter
        self._lockstep(want, want)
        rows = self.feed.pop(want)
        encoded = [self.prompts.encode(r.row) for r in rows]
        request = GenerateRequest([e.ids for e in encoded], self.sampling(), images=self.images(encoded))
        job = self.inflight[step] = InFlight(rows, encoded, self.engine.submit(request))
        self.scorer.ahead.add(f"{self._ahead_key(step)}/")  # judged ahead: `genrm/ahead` until collected
        if self.streams_to_genrm:  # judged as they finish, while this process trains the steps before
            parts = dict(job.generation.pending)  # {ref: (engine, prompt indices)}, before `wait` takes them
            job.judging = threading.Thread(target=self._judge_ahead, args=(step, job, parts), daemon=True)
            job.judging.start()

    def _judge_ahead(self, step: int, job: InFlight, parts: dict[Any, tuple[int, list[int]]]) -> None:
        """Stream each prompt of `job` to the GenRM as its engine returns it (a thread: the trainer meanwhile
        trains). Reads the engines' answers only: a failed or restarted engine's prompts are left to
        `collect_started`, which sends them again and streams what this did not, and so is a prompt whose
        send to the GenRM failed here (logged)."""
        import ray

        waiting = list(parts)
        while waiting:
            [ref], waiting = ray.wait(waiting, num_returns=1)
            try:
                out = ray.get(ref)
            except Exception:  # noqa: BLE001  (an engine that died: collect_started sends the prompts again)
                continue
            if isinstance(out, tuple):  # anything else: nothing to stream (a restarted engine, ...)
                for i, completions in zip(parts[ref][1], out[0]):
                    if completions is None:
                        continue
                    try:
                        self._stream(step, job, i, completions)
                    except Exception as exc:  # noqa: BLE001  (not marked sent: collect_started sends it)
                        log.warning(
                            "GenRM: prompt %d of step %d could not be sent ahead (%s: %s); it is sent when the "
                            "step is collected", i, step, type(exc).__name__, exc,
                        )  # fmt: skip

    def _stream(self, step: int, job: InFlight, i: int, completions: list) -> None:
        """Prompt `i` of `job` to the GenRM, once: marked sent only once the send succeeded (a failed
        `submit` leaves none of its samples pending, so the prompt can be sent again)."""
        with self.streaming:
            if i not in job.streamed:
                self.scorer.submit(self._ahead_samples(step, job, i, completions))
                job.streamed.add(i)

    def _ahead_key(self, step: int) -> str:
        """The key prefix of step `step`'s samples generated ahead (`<key>/<sample index>`)."""
        return f"{step}/{self.dp_rank}/a"

    def _ahead_samples(self, step: int, job: InFlight, i: int, completions: list) -> list[Sample]:
        return self._samples(self._ahead_key(step), i, job.rows[i].row, job.encoded[i].text, completions)

    def collect_started(self, step: int) -> RolloutBatch:
        """The batch of a step started earlier (or now: a run's first step, the first after a resume): wait for
        its samples (each prompt's streamed to the GenRM as it returns), score, consume, pack. Each sample's
        staleness, the trainer's weight version less the version that generated it, is at most
        K = `rollout.max_staleness` by construction, so nothing is generated again here: `collect` starts
        step s + K after collecting step s (`_start_ahead`), K weight pushes before training it, with the
        weight version the controller holds then; an engine never runs a request on weights older than the version
        it asks for (`EngineActor.generate` waits for them), so a request that waited on a busy engine, or
        was resent after an engine died, runs on newer weights, not older. `async/staleness_max` reports it.
        The samples it streamed to the GenRM before this call count in `genrm/ahead` until now, then in
        `genrm/held` until scored or discarded (0 once the batch is packed)."""
        self.start(step)
        job = self.inflight.pop(step)
        self.scorer.ahead.discard(f"{self._ahead_key(step)}/")  # this step's now: scored or discarded below
        self.step_rows, streamed = [], job.streamed

        def samples(i: int, completions: list) -> list[Sample]:
            return self._ahead_samples(step, job, i, completions)

        def finished(i: int, completions: list) -> None:
            if self.streams_to_genrm:
                self._stream(step, job, i, completions)

        with self.timer.phase("rollout"):
            outs = complete(self.engine.wait(job.generation, finished))
            if job.judging is not None:  # it read the same answers: done, or about to be
                job.judging.join()
        ages = [self.engine.age(v) for v in job.generation.versions]  # <= K (docstring)
        groups = [
            Group(job.rows[i], job.encoded[i].ids, job.encoded[i].clipped, outs[i], samples(i, outs[i]),
                  streamed=i in streamed, pixels=job.encoded[i].pixels)
            for i in range(len(outs))
        ]  # fmt: skip
        # taken in prompt order up to the share; with dynamic sampling, uniform groups are dropped and what is
        # missing is drawn now, synchronously, with the current weights (what was generated ahead is a draw)
        batch = self._finish(step, *self._draw_until_full(step, spare=groups, draws=1))
        batch.counters.update({
            "async/staleness_mean": sum(ages) / max(len(ages), 1),
            "async/staleness_max": float(max(ages, default=0)),
            "async/inflight_steps": float(len(self.inflight)),
            **self._version_counters(outs, ages),
        })  # fmt: skip
        return batch

    def _version_counters(self, outs: list[list], ages: list[int]) -> dict[str, float]:
        """Per sample, from the version of each of its tokens (`Completion.versions`; the prompt's start
        version where an engine does not label tokens): the staleness histogram of samples by their oldest
        token (`async/staleness_hist_<s>`, s = 0 .. eta, summed over controllers) and the mean number of
        weight versions a sample's tokens came from (`async/versions_per_sample_mean`; > 1 where new
        weights arrived while it was generating)."""
        eta = self.config.rollout.max_staleness
        rows = [
            [age] * len(c.token_ids)
            if c.versions is None
            else [max(self.engine.age(v), 0) for v in c.versions]
            for completions, age in zip(outs, ages)
            for c in completions
        ]
        width = max((len(r) for r in rows), default=0)
        token_ages = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width)
        for i, r in enumerate(rows):
            token_ages[i, : len(r)], mask[i, : len(r)] = torch.tensor(r, dtype=torch.long), 1.0
        now = int(token_ages.max()) if rows else 0  # versions as `now - age`: only differences matter
        stats = staleness_stats(now - token_ages, now, mask, bins=eta + 1)
        counters = {
            f"async/staleness_hist_{s}": float(v) for s, v in enumerate(stats["staleness_hist"].tolist())
        }
        counters["async/versions_per_sample_mean"] = float(stats["distinct_versions_mean"])
        return counters

    def _batch(self, step: int, groups: list[Group]) -> RolloutBatch:
        """The step's scored batch of `groups` (with ReMax's greedy baseline) and the counters every step
        reports: the scorer's, the engine actors', the queue, the rows whose images did not load."""
        bad_images = self._drain_rejected()
        greedy = self._greedy_baseline(step, groups) if self.needs_greedy else None
        batch = self._pack(groups)
        batch.greedy_rewards = greedy
        batch.counters = {
            **self.scorer.take_stats(),
            **self.engine.take_stats(),  # engine actors' (resent prompts, queue waits); {} in process
            "data/queued_prompts": float(len(self.feed.queue)),
            **({"data/bad_images": float(bad_images)} if self.prompts.layout is not None else {}),
        }
        return batch

    def _draw_until_full(
        self, step: int, spare: list[Group] | None = None, draws: int = 0
    ) -> tuple[list[Group], list[Group], list[Group], dict[str, int]]:
        """The draws of one step: (kept, dropped, spare: finished past the need, counts). `spare`: groups
        generated already (asynchronous rollout: `draws` = 1 of them), taken first."""
        dynamic = self.config.algo.dynamic_sampling
        max_draws = self.config.algo.max_draws if dynamic != "off" else 1
        kept: list[Group] = []
        dropped: list[Group] = []
        spare = spare or []  # finished past the need: taken first by the next round
        counts = {"draws": draws, "requeued": 0, "aborted": 0}
        self.engine.wake()
        while True:
            need = self.share - len(kept)
            if spare and need > 0:
                taken, spare = spare[:need], spare[need:]
                self._take(taken, kept, dropped)
                continue
            need = need if counts["draws"] < max_draws else 0
            target = groups_to_finish(need, self.keep_rate)
            want = prompts_to_start(target, self.config.rollout.over_sample)
            if not self._lockstep(want, need):
                return kept, dropped, spare, counts
            if need == 0:
                continue  # this group is full; it reads its stream with the others
            counts["draws"] += 1
            rows = self.feed.pop(want)
            with self.timer.phase("rollout"):
                spare, aborted = self._generate(step, counts["draws"], rows, target)
            if aborted:  # the long tail: stopped in the engine, back to the front of the queue unconsumed
                with self.recorder.span("aborted", busy=False):
                    self.feed.requeue(aborted)
            counts["aborted"] += len(aborted)

    def _drain_rejected(self) -> int:
        """Rows whose images did not load (data.on_bad_image=skip), consumed by the feed as it read them (and
        warned about then, `_report_skips`): recorded as this step's, counted (the `data/bad_images` metric)."""
        rows, self.feed.rejected = self.feed.rejected, []
        self.step_rows += rows
        return len(rows)

    def _report_skips(self, rows: list) -> None:
        """Warn about rows rejected by a read as it happens: one line each, or one line for a read that
        rejected more than a few."""
        if len(rows) <= 3:
            for r in rows:
                log.warning("prompt id %r skipped: %s", r.id, r.row[IMAGE_ERROR])
        elif rows:
            log.warning(
                "%d prompts skipped, their images (column data.image_key=%r) did not load: %s (and %d more)",
                len(rows), self.config.data.image_key, describe_rejected(rows, limit=3), len(rows) - 3,
            )  # fmt: skip

    def _take(self, groups: list[Group], kept: list[Group], dropped: list[Group]) -> None:
        """Score `groups`, consume their prompts, and keep the informative ones (all without dynamic sampling)."""
        dynamic = self.config.algo.dynamic_sampling
        with self.timer.phase("reward", busy=False):  # rules run on the host; GenRM on its replicas
            self._score_groups(groups)
        self.feed.consume([g.row for g in groups])
        self.step_rows += [g.row for g in groups]
        for g in groups:
            (kept if dynamic == "off" or is_informative(g.rewards, dynamic) else dropped).append(g)

    def _lockstep(self, want: int, need: int) -> bool:
        """Every controller reads the same number of rows from its stream (the most any needs beyond its queue)
        and learns whether any group still needs prompts; collective over the controllers.

        More than one round only where a read yields fewer usable rows than it read: a resumed epoch's
        consumed rows, rows whose images did not load (warned about as they are read). Every round all
        controllers share their state and take the same decision, so none waits in a collective the others
        left: a DataError when an epoch's rows were all rejected, or some group's stream rejected more than
        `data.max_rejected_in_a_row` rows one after another; `StopRequested` when the run was asked to stop
        (SIGTERM, Ctrl-C) while this waits for usable rows (no step under way)."""
        from yatt_ray import run_control

        feed, rounds = self.feed, 0
        while True:
            short = max(want - len(feed.queue), 0)
            stop = run_control.stop_request() if rounds and short else None  # polled only while waiting
            done = feed.finished
            state = torch.tensor(
                [short, need, stop is not None, feed.longest_rejected_run,
                 -1 if done is None else done.epoch, 0 if done is None else done.usable,
                 0 if done is None else done.rejected],
                dtype=torch.float64,
            )  # fmt: skip
            views = self._gather(state)  # [controllers, 7]: the same on every controller
            self._check_rejected(views)
            rows = int(views[:, 0].max().item())
            if rows == 0:
                return bool(views[:, 1].max().item() > 0)
            if views[:, 2].max().item() > 0:
                raise run_control.StopRequested(
                    f"the run was asked to stop ({stop or 'by another group'}) while waiting for usable prompt "
                    "rows, with no step under way; it ends without a further checkpoint"
                )
            before = len(feed.rejected)
            feed.pull(rows)
            self._report_skips(feed.rejected[before:])
            rounds += 1

    def _gather(self, state: torch.Tensor) -> torch.Tensor:
        """Every controller's `state`, stacked in data-parallel rank order (collective over the controllers)."""
        if self.dp_size == 1:
            return state[None]
        views = [torch.empty_like(state) for _ in range(self.dp_size)]
        dist.all_gather(views, state, group=self.dp_group)
        return torch.stack(views)

    def _check_rejected(self, views: torch.Tensor) -> None:
        """DataError when the last epoch every controller read to its end had only rejected rows, or some
        controller's stream rejected more than `data.max_rejected_in_a_row` rows one after another (at any
        time since it started: a run of them inside one read counts too); naming the image column and a few
        rejected ids (of every controller: collective, taken by all or none)."""
        d = self.config.data
        bound = d.max_rejected_in_a_row
        streak = int(views[:, 3].max().item())
        epochs = views[:, 4]
        same = bool(epochs[0] >= 0 and (epochs == epochs[0]).all())  # every controller finished that epoch
        whole = same and views[:, 5].sum().item() == 0 and views[:, 6].sum().item() > 0
        if not whole and (bound is None or streak <= bound):
            return
        mine = [(r.id, str(r.row[IMAGE_ERROR])) for r in self.feed.recent_rejected]
        if self.dp_size > 1:
            every: list = [None] * self.dp_size
            dist.all_gather_object(every, mine, group=self.dp_group)
            mine = [pair for pairs in every for pair in pairs]
        what = (
            f"all {int(views[:, 6].sum().item())} rows of epoch {int(epochs[0].item())} were rejected"
            if whole
            else f"a group's stream rejected {streak} rows one after another, more than "
            f"data.max_rejected_in_a_row={bound}"
        )
        raise DataError(
            f"{what}: their images (column data.image_key={d.image_key!r}) did not load. For example "
            f"{describe_rejected(mine)}. Fix the image paths in that column (a relative path resolves in the Ray "
            "Data worker that decodes it: give absolute paths or URLs) or data.image_key, or drop the rows"
            + ("" if whole else "; or raise data.max_rejected_in_a_row (null: no bound)")
        )

    def _generate(self, step: int, draw: int, rows: list, need: int) -> tuple[list[Group], list]:
        """Start `rows`; the engine aborts the rest once `need` have finished, and the prompts aborted
        `rollout.max_aborts` times already (those are waited for). (finished groups, pinned first then in finish
        order; aborted rows). In partial and disaggregated placement the first `need` stream to the GenRM as they
        finish."""
        cfg = self.config
        stream_to_genrm = self.streams_to_genrm
        encoded = [self.prompts.encode(r.row) for r in rows]
        spec = self.sampling()
        order: list[int] = []
        streamed: set[int] = set()

        def samples_of(i: int, completions: list) -> list[Sample]:
            return self._samples(
                f"{step}/{self.dp_rank}/{draw}", i, rows[i].row, encoded[i].text, completions
            )

        def finished(i: int, completions: list) -> None:
            order.append(i)
            if stream_to_genrm and (len(order) <= need or i in pinned):
                streamed.add(i)
                self.scorer.submit(samples_of(i, completions))

        limit = cfg.rollout.max_aborts
        pinned = frozenset(
            i for i, r in enumerate(rows) if limit is not None and r.aborts >= limit
        )  # waited for
        abort = need < len(rows)
        callback = abort or stream_to_genrm
        request = GenerateRequest(
            [e.ids for e in encoded],
            spec,
            images=self.images(encoded),
            finish_after=need if abort else None,
            wait_for=pinned if abort else frozenset(),
        )
        results = self.engine.generate(request, finished if callback else None)
        done, aborted = split_finished(order if callback else list(range(len(rows))), len(rows), pinned)
        completions = {i: c for i in done if (c := results[i]) is not None}  # all of `done`: finished
        groups = [
            Group(rows[i], encoded[i].ids, encoded[i].clipped, completions[i], samples_of(i, completions[i]),
                  streamed=i in streamed, pixels=encoded[i].pixels)
            for i in done
        ]  # fmt: skip
        return groups, [rows[i] for i in aborted]

    def _samples(self, key: str, i: int, row: dict, prompt: str, completions: list) -> list[Sample]:
        """Prompt `i`'s samples for the scorer, keyed `<key>/<sample index>`."""
        n = len(completions)
        return [
            Sample(
                key=f"{key}/{i * n + j}",
                prompt=prompt,
                response=self.decode(c.token_ids),
                ground_truth=str(row["ground_truth"]),
                data_source=str(row["data_source"]),
            )
            for j, c in enumerate(completions)
        ]

    def _score_groups(self, groups: list[Group]) -> None:
        """Rewards of every sample: rules here, GenRM verdicts from the Serve deployment (already judging the
        streamed samples in partial and disaggregated placement)."""
        samples = [s for g in groups for s in g.samples]
        self.scorer.submit([s for g in groups if not g.streamed for s in g.samples])
        scores = iter(self.scorer.scores(samples))
        for g in groups:
            g.rewards = [next(scores) for _ in g.samples]

    def _greedy_baseline(self, step: int, groups: list[Group]) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy response per prompt, [len(groups)]."""
        with self.timer.phase("rollout"):
            greedy = replace(self.sampling(), n=1, temperature=0.0)
            request = GenerateRequest([g.prompt_ids for g in groups], greedy, images=self.images(groups))
            outs = complete(self.engine.generate(request))
        samples = [
            replace(g.samples[0], key=f"{step}/{self.dp_rank}/g{i}", response=self.decode(out[0].token_ids))
            for i, (g, out) in enumerate(zip(groups, outs))
        ]
        with self.timer.phase("reward", busy=False):
            self.scorer.submit(samples)
            return torch.tensor(self.scorer.scores(samples), dtype=torch.float32)

    def _pack(self, groups: list[Group]) -> RolloutBatch:
        """The padded batch of the groups' samples, with their rewards (and their prompts' images, once)."""
        n = self.config.rollout.n
        flat = [c for g in groups for c in g.completions]
        prompts = [g.prompt_ids for g in groups for _ in range(n)]
        batch = pack(prompts, [c.token_ids for c in flat], [c.logprobs for c in flat], self.pad_id, n)
        batch.rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
        if self.prompts.layout is not None:
            batch.images, batch.image_prompt = prompt_images([g.pixels for g in groups], n)
        batch.truncated = sum(c.finish_reason == "length" for c in flat)
        batch.prompts_clipped = sum(g.clipped for g in groups)
        return batch

    # ---- shared with evaluation -----------------------------------------------------------------------------
    def images(self, prompts: list) -> Images | None:
        """A `GenerateRequest`'s `images` for `prompts` (each with `.pixels`): None for a text policy. An
        engine that takes image features (vLLM) gets the policy's own, computed here once a prompt."""
        if self.prompts.layout is None:
            return None
        pixels = [p.pixels for p in prompts]
        if self.engine.takes_image_features:
            if self.image_features is None:
                raise RuntimeError(
                    "the engine takes image features, but the collector was given no policy for them"
                )
            features = self.image_features(pixels)
            pixels = [replace(p, features=f) for p, f in zip(pixels, features)]
        return pixels

    def sampling(self) -> SamplingSpec:
        r = self.config.rollout
        return SamplingSpec(
            n=r.n,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            stop_token_ids=self.stop_ids,
            ignore_eos=r.ignore_eos,
        )

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def evaluate(self, eval_shard: Any) -> torch.Tensor:
        """Greedy answers to this group's share of the eval rows (`EvalRows`), scored by the rule function:
        [reward sum, correct count, sample count] float64 (the caller sums over groups)."""
        sums = torch.zeros(3, dtype=torch.float64)
        spec = SamplingSpec(
            n=1,
            max_new_tokens=self.config.rollout.max_new_tokens,
            temperature=0.0,
            stop_token_ids=self.stop_ids,
        )
        self.engine.wake()
        for batch in eval_shard.batches():  # this group's share, read here (data/eval_rows.py)
            rows = [{c: v[i] for c, v in batch.items()} for i in range(len(batch["prompt"]))]
            rows = [r for r in rows if not r.get(IMAGE_ERROR)]  # images that did not load: not scored
            encoded = [self.prompts.encode(r) for r in rows]
            request = GenerateRequest([e.ids for e in encoded], spec, images=self.images(encoded))
            outs = complete(self.engine.generate(request))
            items = [
                (self.decode(group[0].token_ids), str(r["ground_truth"]), str(r["data_source"]))
                for group, r in zip(outs, rows)
            ]
            r = self.config.reward
            for reward in score_with_rule(self.reward_fn, items, r.function, r.on_error):
                sums += torch.tensor([reward, float(reward >= 1.0), 1.0], dtype=torch.float64)
        return sums
