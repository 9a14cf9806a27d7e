"""The per-group loop, run inside every Ray Train worker.

Each data-parallel group has one controller: its tensor-parallel rank 0. The controller pulls prompts from
its own Ray Data stream, drives its colocated rollout engine, scores the samples, and hands the group's
batch to the other ranks of its group. Every rank then runs the same trainer phases. One step:

    rollout -> reward -> log-probs (old, reference, values) -> advantages -> train -> weight sync

Groups meet only in collectives: gradient all-reduce, the global token count for loss normalisation, and
metric reduction. Only scalar metrics leave the workers (through the MetricsHub actor).
"""

from __future__ import annotations

import os
import tempfile
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from yatt_ray.algos import (
    AdaptiveKLController,
    FixedKLController,
    masked_whiten,
    tis_weights,
)
from yatt_ray.batch import RolloutBatch
from yatt_ray.checkpoint.training import Resumed
from yatt_ray.collector import RolloutCollector
from yatt_ray.config import Config
from yatt_ray.metrics.history import RowKind
from yatt_ray.metrics.timeline import SpanRecorder, local_accelerator, to_wire
from yatt_ray.metrics.timers import PhaseTimer
from yatt_ray.roles import Layout, Roles, build_roles, start_engine
from yatt_ray.rollout.base import RolloutEngine
from yatt_ray.step import (
    compute_advantages,
    is_on_policy,
    policy_loss_fn,
    reduce_metrics,
    value_loss_fn,
    zero_gradient_rows,
)
from yatt_ray.train.micro_batches import keep_one_group, mini_batch_rows


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train entry point: build the group's roles, run the steps, report the final checkpoint."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read when vLLM is imported
    from yatt_ray.run_control import run_guarded

    def train() -> None:
        import ray.train

        from yatt_ray.metrics.hub import HubLink

        config = Config.from_dict(loop_config["config"]).freeze()  # the driver's resolved config, read-only
        hub = HubLink(loop_config["hub"], config.cluster.timeout_s)
        first = ray.train.get_context().get_world_rank() == 0
        mark = hub.mark if first else (lambda stage: None)  # start-up stages (metrics.startup): rank 0's
        mark("worker_started")
        layout, roles = build_roles(config, loop_config, hub, mark)
        controller = GroupController(config, layout, roles)
        controller.open_checkpoints(loop_config)  # the prompt streams start reading here ...
        mark("data_opened")
        handles = loop_config.get("engines")  # the engine actors' (None: each controller's engine in process)
        engine = controller.start_engine(handles) if layout.is_controller else None
        controller.attach_engine(engine, engine_actors=handles is not None)
        mark("engine_started")  # ... while the engine loads
        controller.run()

    run_guarded(loop_config.get("control"), train)


class GroupController:
    """One worker's loop over its injected roles (`yatt_ray.roles`); the rollout engine, the scorer and the
    prompt feed exist on controller ranks only. Megatron's parallel state must be initialised (the real
    policy does it; tests call `init_parallel_state`)."""

    def __init__(self, config: Config, layout: Layout, roles: Roles) -> None:
        from megatron.core import parallel_state

        self.config, self.layout, self.roles = config, layout, roles
        self.policy, self.critic, self.hub = roles.policy, roles.critic, roles.hub
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_src = parallel_state.get_tensor_model_parallel_src_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        a, t = config.algo, config.train
        self.kl_ctl = (
            AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
            if a.kl_target is not None
            else FixedKLController(a.kl_coef)
        )  # every rank updates it from the same all-reduced KL, so all ranks agree
        offload = t.offload_during_rollout
        self.offload = torch.cuda.is_available() if offload is None else offload
        # how trainer passes split a batch; a prompt's samples are packed together (shared prompt)
        self.batching: dict = {"micro_batch_size": t.micro_batch_size, "group_size": config.rollout.n}
        if t.max_tokens_per_micro_batch:
            self.batching["max_tokens_per_micro_batch"] = t.max_tokens_per_micro_batch
        worker = f"rank{layout.rank}"
        self.recorder = SpanRecorder("trainer", worker, local_accelerator(worker))
        self.timer = PhaseTimer(recorder=self.recorder)
        for trainer in (self.policy, self.critic):
            if trainer is not None:  # a train step's parts (compute, grad-sync wait) become spans
                trainer.recorder = self.recorder
        self.memory: dict[str, float] = {}  # bytes released between phases this step (full coexistence)
        self.prompts_per_group = t.prompts_per_step // t.dp_size
        self.resumed: Resumed | None = None
        self.eval_shard = roles.eval_shard
        # the rollout phase (controller ranks): feed, draws, engine, scorer, keep rate
        self.collector: RolloutCollector | None = None
        if layout.is_controller:
            assert roles.scorer is not None and roles.tokenizer is not None and roles.reward_fn is not None
            self.collector = RolloutCollector(
                config, layout.dp_rank, layout.dp_size, scorer=roles.scorer, tokenizer=roles.tokenizer,
                reward_fn=roles.reward_fn, timer=self.timer, recorder=self.recorder, dp_group=self.dp_group,
                image_features=getattr(self.policy, "image_features", None),
            )  # fmt: skip
            if roles.engine is not None:
                self.collector.attach_engine(roles.engine)
        self.engine_actors = False  # the rollout engines are actors of their own (`attach_engine`)

    def open_checkpoints(self, loop_config: dict) -> None:
        """Resume from the newest valid checkpoint (or start fresh), then open the prompt streams there."""
        from yatt_ray.checkpoint.training import TrainingCheckpoints, TrainState
        from yatt_ray.data.feed import PromptFeed, open_splits, share_splits

        control, rank0 = loop_config["control"], self.layout.rank == 0
        self.checkpoints = TrainingCheckpoints(self.config, self.layout, control, self.hub)
        self.state = TrainState(
            self.policy, self.critic, kl_coef=lambda: self.kl_ctl.value, rollout=self.collector
        )
        self.attempt = self.checkpoints.attempt_number()
        self.resumed = self.checkpoints.resume(self.state, restart=self.attempt > 1)
        if self.resumed is not None:
            self.apply_resumed(self.resumed)
        epoch, position = (self.resumed.epoch, self.resumed.position) if self.resumed else (0, {})
        dataset = loop_config["train_dataset"]
        splits = share_splits(open_splits(dataset, self.layout.dp_size, epoch, position) if rank0 else None)
        if self.layout.is_controller:
            dp = self.layout.dp_rank
            rest = [(e, rest_splits[dp]) for e, rest_splits in splits["rest"]]
            carried = position if dp == 0 else {}  # the checkpoint's union, kept by one group
            assert self.collector is not None
            self.collector.feed = PromptFeed(splits["full"][dp], rest, self.prompts_per_group, epoch, carried)

    def apply_resumed(self, resumed: Resumed) -> None:
        """The loop's own state from a checkpoint: the KL coefficient, and the rollout phase's (`collector`)."""
        self.kl_ctl.value = resumed.kl_coef
        if self.collector is not None:
            self.collector.load_state_dict({"keep_rate": resumed.keep_rate})

    def start_engine(self, handles: Any) -> RolloutEngine:
        """This controller's rollout engine (`roles.start_engine`; `handles`: the engine actors', or None). In
        full coexistence (`self.offload`) an engine in this process starts while the trainers' state is in host
        memory, then sleeps before it comes back: vLLM takes rollout.gpu_memory_utilization of the GPU as it
        starts, and refuses to start where less is free (a 7B trainer's state alone is ~60 GiB)."""
        beside = self.offload and handles is None
        if beside:
            self._move_trainers("offload")
        engine = start_engine(self.config, self.layout, self.policy, handles, self.attempt)
        if beside:
            engine.sleep()
            self._move_trainers("onload")
        return engine

    def attach_engine(self, engine: RolloutEngine | None, engine_actors: bool = False) -> None:
        """The controller's rollout engine (None on other ranks), started once the prompt streams opened; a
        resumed run's policy weights and sampling stream go into it. `engine_actors`: the engines are actors
        of their own (`rollout/pool.py`; the same on every rank). Collective over the tensor-parallel group
        (the weight sync)."""
        self.engine_actors = engine_actors
        if engine is not None and self.collector is not None:
            saved = None if self.resumed is None else self.resumed.engine_rng
            self.collector.attach_engine(engine, saved)
        # engine actors outlive a restart of the workers: they hold the failed attempt's weights
        if self.resumed is not None or (engine_actors and self.attempt > 1):
            self.sync_weights()  # the rollout engine generates with the restored policy

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.config
        start = step = self.resumed.step if self.resumed else 0
        if self.resumed is not None and self.layout.rank == 0:
            self.checkpoints.announce(self.resumed)
        first_eval = self.evaluate() if self.resumed is None else {}
        if first_eval:
            self._push("eval", {"step": 0, **first_eval})
            self._mark("first_eval_done")
        feed = None if self.collector is None else self.collector.feed
        if feed is not None:  # the stream read on while the engine loaded and the eval ran
            feed.prime()
            self._mark("first_batch")
        last: dict[str, float] = {}
        for step in range(start + 1, cfg.train.steps + 1):
            last = self.step(step)
            if step == start + 1 and feed is not None:
                self._mark("first_step_done")
            self._push("train", {**last, **self.checkpoints.metrics()})
            if self.collector is not None:
                rows = self.collector.step_rows
                self.checkpoints.log_prompts(
                    step, self.attempt, [r.id for r in rows], [r.epoch for r in rows]
                )
            if self.checkpoints.after_step(step, self.state):
                break  # asked to stop: the checkpoint of this step is committed
        final_eval = self.evaluate() if self.checkpoints.stop_reason is None else {}
        if final_eval:
            self._push("eval", {"step": cfg.train.steps, **final_eval})
        self.checkpoints.finish(step, self.state)
        self._report_final({**last, **final_eval})

    def step(self, step: int) -> dict[str, float]:
        """One RL step for this group; returns the step's metrics reduced over all groups."""
        cfg, timer = self.config, self.timer
        timer.reset()
        self.recorder.step = step
        self.memory = {}
        start = time.perf_counter()
        if self.offload:
            with timer.phase("offload"):
                self._move_trainers("offload")
        scored = self._collect(step) if self.collector is not None else None  # (and starts the steps ahead)
        if not self.layout.is_controller:  # the group's controller generates; this rank waits for its batch
            with timer.phase("rollout", busy=False), timer.phase("reward", busy=False):
                pass
        if self.offload:
            with timer.phase("offload"):
                self._move_trainers("onload")
        batch = self._broadcast_in_group(scored)
        with timer.phase("logprobs"):
            self._old_log_probs_and_values(batch, step)
        whiten = partial(masked_whiten, all_reduce=lambda t: dist.all_reduce(t, group=self.dp_group))
        compute_advantages(
            batch, cfg.algo, self.kl_ctl.value, whiten=whiten, max_new_tokens=cfg.rollout.max_new_tokens
        )
        train_batch, restore, balance_stats = self._balance(batch)
        with timer.phase(
            "train", busy=False
        ):  # the trainers record its parts: compute, and the grad-sync wait
            train_stats = self._update(train_batch, step)
        if batch.old_logp is None:  # on-policy: recorded by the training forward, back in this rank's order
            batch.old_logp = restore(train_batch.old_logp)
        with timer.phase("weight_sync"):
            if self._policy_moves(step):
                self.sync_weights()
        times = timer.totals()
        wall = time.perf_counter() - start
        compute = sum(times[p] for p in ("rollout", "reward", "logprobs", "train"))
        times.update(step=wall, other=max(wall - sum(times.values()), 0.0), orchestration=wall - compute)
        metrics = reduce_metrics(step, batch, train_stats, times, self.layout.is_controller, cfg.algo)
        metrics["kl_coef"] = self.kl_ctl.value
        metrics.update({**balance_stats, **self._train_compute_per_rank()})
        if "kl_per_sequence" in metrics and self._policy_moves(step):  # no KL to track while frozen
            self.kl_ctl.update(metrics["kl_per_sequence"], n_steps=int(metrics["samples"]))
        self._push_spans()
        return metrics

    def _collect(self, step: int) -> RolloutBatch:
        """The collector's scored batch (with asynchronous rollout, the collector then starts the steps ahead);
        in full coexistence the engine then sleeps, its memory going to the trainer while it trains (the bytes
        freed join the batch's counters)."""
        assert self.collector is not None
        batch = self.collector.collect(step)
        if self.offload:
            self._count_freed("rollout_released", self.collector.engine.sleep())
        batch.counters.update(self.memory)
        return batch

    def _balance(self, batch: RolloutBatch) -> tuple[RolloutBatch, Any, dict[str, float]]:
        """`train.balance`: (the batch this rank trains, a function bringing a per-row [N, R] tensor of it back
        to `batch`'s rows, stats). Prompt groups (sliced when whole ones are too coarse) move worker to worker so that every data-parallel rank's cost
        (tokens, or FLOPs) is as even as Karmarkar-Karp makes it; loss normalisation stays global."""
        mode = self.config.train.balance
        if mode == "off" or self.layout.dp_size == 1:
            return batch, lambda tensor: tensor, {}
        from yatt_ray.metrics.flops import registered_perf_model
        from yatt_ray.train.balance import exchange

        # rows the policy skips cost nothing, unless a critic trains them
        policy_only = self.critic is None and self._policy_moves(self.recorder.step)
        skipped = self._zero_gradient_rows(batch) if policy_only else None
        with self.timer.phase("balance", busy=False):  # the exchange: network, no compute
            moved, restore, stats = exchange(
                batch, mode, self.dp_group, registered_perf_model(), skipped=skipped
            )
        return moved, restore.restore, stats

    def _train_compute_per_rank(self) -> dict[str, float]:
        """Seconds each data-parallel rank computed in this step's train phase (forward, backward, optimizer;
        not the wait in the gradient all-reduce), `time/train_compute/dp<r>`, and `balance/train_wait_s`: the
        seconds the ranks together waited for the slowest one."""
        seconds = 0.0
        for trainer in (self.policy, self.critic):
            if trainer is not None:
                seconds, trainer.compute_s = seconds + trainer.compute_s, 0.0
        per_rank = [torch.zeros(1, dtype=torch.float64) for _ in range(self.layout.dp_size)]
        dist.all_gather(per_rank, torch.tensor([seconds], dtype=torch.float64), group=self.dp_group)
        values = [float(t.item()) for t in per_rank]
        out = {f"time/train_compute/dp{r}": v for r, v in enumerate(values)}
        out["balance/train_wait_s"] = sum(max(values) - v for v in values)
        return out

    def _push_spans(self) -> None:
        """Every rank's busy intervals of the step, for the driver's timeline (names and times only)."""
        spans = to_wire(self.recorder.drain())
        self.hub.push_spans(spans)

    def _move_trainers(self, direction: str) -> None:
        """Full coexistence: "offload" gives the accelerator to the rollout engine (trainer weights, grads and
        optimizer state to host memory); "onload" brings them back for the log-prob and train phases."""
        for trainer in (self.policy, self.critic):
            if trainer is None:
                continue
            if direction == "offload":
                self._count_freed("trainer_offloaded", trainer.offload())
            else:
                trainer.onload()

    def _count_freed(self, what: str, nbytes: int) -> None:
        key = f"memory/{what}_gb"
        self.memory[key] = self.memory.get(key, 0.0) + nbytes / 2**30

    def _policy_moves(self, step: int) -> bool:
        """False during the critic's warm-up steps, when only the value model trains."""
        return step > self.config.critic.warmup_steps

    def _old_log_probs_and_values(self, batch: RolloutBatch, step: int) -> None:
        """old_logp, ref_logp, values and truncated-IS weights, each [N, R] over the response tokens.
        On-policy (`step.is_on_policy`) old_logp and the IS weights come out of the training forward (when the
        policy trains this step: not during the critic's warm-up)."""
        cfg, batching = self.config, self.batching
        ids, mask = batch.input_ids, batch.attention_mask
        images = batch.image_inputs() or None
        if is_on_policy(cfg.algo, self.kl_ctl.value) and self._policy_moves(step):
            batch.old_logp = None
        else:
            batch.old_logp = batch.response(self.policy.log_probs(ids, mask, images=images, **batching)[0])
        if cfg.algo.kl_coef > 0:
            ref = self.policy.log_probs(ids, mask, reference=True, images=images, **batching)[0]
            batch.ref_logp = batch.response(ref)
        if self.critic is not None:
            batch.values = batch.response(self.critic.values(ids, mask, **batching))
        if cfg.algo.tis_cap is not None and batch.old_logp is not None:
            batch.tis_weights = tis_weights(batch.old_logp, batch.rollout_logp, cfg.algo.tis_cap)

    def _update(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """Critic step (when there is one), then the policy: `algo.ppo_epochs` passes over the batch, each
        in `algo.ppo_mini_batches` optimizer steps (after the first, the importance ratio moves away from 1
        and the PPO clip binds). Metrics are averaged over the optimizer steps."""
        cfg, width = self.config, batch.prompt_width
        batching = {**self.batching, "group_size": batch.group_size}  # balancing may have sliced the groups
        stats: dict[str, float] = {}
        if self.critic is not None:
            global_tokens = self._dp_sum(batch.response_mask.sum())
            critic_loss = value_loss_fn(cfg.critic.value_clip, width, global_tokens)
            critic_stats = self.critic.train_step(batch.tensors(), critic_loss, **batching)
            stats.update({k if k.startswith("value") else f"critic/{k}": v for k, v in critic_stats.items()})
        if not self._policy_moves(step):
            return stats
        steps: list[dict[str, float]] = []
        record = None
        # on-policy: the training forward fills it (NaN where a row is skipped), on the device, read back once after
        # the steps (not a wait for the device in every micro-batch)
        if batch.old_logp is None:
            record = torch.full_like(batch.rollout_logp, float("nan"), device=self.policy.device)
        skip = self._zero_gradient_rows(batch)
        left_out = 0
        for _ in range(cfg.algo.ppo_epochs):
            for chunk in mini_batch_rows(batch.size, batch.group_size, cfg.algo.ppo_mini_batches):
                mini = batch.rows(chunk)
                global_tokens = self._dp_sum(mini.response_mask.sum())
                global_seqs = self._dp_sum(torch.tensor(float(mini.size)))
                if skip is not None:  # the normalisers above stay the whole mini-batch's
                    kept = chunk[keep_one_group(~skip[chunk], batch.group_size, mini.attention_mask)]
                    left_out += len(chunk) - len(kept)
                    chunk, mini = kept, batch.rows(kept)
                loss_fn = policy_loss_fn(
                    cfg.algo, width, global_tokens, global_seqs, self.kl_ctl.value, cfg.rollout.max_new_tokens,
                    record_old_logp=record,
                    metric_tokens=None if skip is None else self._dp_sum(mini.response_mask.sum()),
                )  # fmt: skip
                tensors = {**mini.tensors(), **mini.image_inputs()}
                if record is not None:
                    tensors["row"] = chunk
                steps.append(self.policy.train_step(tensors, loss_fn, **batching))
        stats.update({k: sum(s[k] for s in steps) / len(steps) for k in steps[0]})
        if record is not None:
            batch.old_logp = record.cpu()
        if skip is not None:  # of the samples the optimizer steps saw, the share left out
            passes = cfg.algo.ppo_epochs * batch.size
            stats["train/skipped_fraction"] = self._dp_sum(torch.tensor(float(left_out))) / max(
                self._dp_sum(torch.tensor(float(passes))), 1.0
            )
        return stats

    def _zero_gradient_rows(self, batch: RolloutBatch) -> torch.Tensor | None:
        """[N] bool: the rows the policy's train step leaves out (`step.zero_gradient_rows`), or None."""
        if not self.config.train.skip_zero_advantage:
            return None
        return zero_gradient_rows(batch, self.config.algo, self.kl_ctl.value)

    # ---- collectives ------------------------------------------------------------------------------
    def _broadcast_in_group(self, batch: RolloutBatch | None) -> RolloutBatch:
        if self.layout.tp_size > 1:
            box = [batch]
            dist.broadcast_object_list(box, src=self.tp_src, group=self.tp_group)
            batch = box[0]
        assert batch is not None, "the group's controller always sends a batch"
        return batch

    def _dp_sum(self, value: torch.Tensor) -> float:
        total = value.detach().to(torch.float64).reshape(1).clone()
        dist.all_reduce(total, group=self.dp_group)
        return float(total.item())

    def sync_weights(self) -> None:
        """Trainer -> engine, in buckets; non-controller ranks join the TP gather only. In-process engines take
        them in memory. Engine actors (`rollout/pool.py`) get them from group 0 alone, which sends them before
        any controller asks for the new version (the engines apply them between requests)."""
        bucket_bytes = int(self.config.rollout.weight_sync_bucket_mb * 2**20)
        engine = None if self.collector is None else self.collector.engine
        pooled = self.engine_actors
        if not pooled or self.layout.dp_rank == 0:
            for bucket in self.policy.iter_hf_buckets(bucket_bytes):
                if engine is not None:
                    engine.load_weights(bucket)
        if engine is not None:
            engine.finish_weight_sync()  # engine actors: group 0's pushes the version, the others move to it
        if pooled:
            dist.barrier()  # the push is sent before any controller asks an engine for its version

    # ---- evaluation and reporting -------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy and mean reward on the eval split (summed over groups; each group scores its share of
        the rows, `EvalRows`); {} without eval data."""
        if not self.config.data.eval_files:
            return {}
        sums = torch.zeros(3, dtype=torch.float64)  # reward sum, correct count, sample count
        if self.offload:
            self._move_trainers("offload")
        if self.collector is not None and self.eval_shard is not None:
            sums = self.collector.evaluate(self.eval_shard)
            if self.offload:
                self.collector.engine.sleep()
        if self.offload:
            self._move_trainers("onload")
        dist.all_reduce(sums)
        count = max(sums[2].item(), 1.0)
        return {"eval/reward_mean": sums[0].item() / count, "eval/accuracy": sums[1].item() / count}

    def _mark(self, stage: str, at: float | None = None) -> None:
        """Rank 0: a start-up stage reached (now, or at `at`), for the driver's start-up table."""
        if self.layout.rank == 0:
            self.hub.mark(stage, at)

    def _push(self, kind: RowKind, row: dict[str, float]) -> None:
        if self.layout.rank == 0:
            self.hub.push(kind, row)

    def _report_final(self, metrics: dict[str, float]) -> None:
        import ray.train

        with tempfile.TemporaryDirectory() as tmp:
            export = os.path.join(tmp, "policy_hf")
            self.policy.save_hf(export)  # collective over the TP group; writes on TP rank 0
            if self.critic is not None:
                self.critic.save(os.path.join(tmp, "critic"))  # a HF LlamaForTokenClassification directory
            checkpoint = ray.train.Checkpoint.from_directory(tmp) if self.layout.rank == 0 else None
            ray.train.report(metrics, checkpoint=checkpoint)
