"""Where the roles run: a placement plan computed from the config and the cluster's resources.

Training workers = dp_size x tp_size. Each hosts the policy (+ reference, + critic) and, on the controller
rank of its data-parallel group, the rollout engine; those share the worker's accelerator in series. The
generative reward model (GenRM, a Ray Serve deployment) is placed by `placement.mode`:

* full coexistence: one GenRM replica per training accelerator, on that same accelerator. Ray counts a GPU
  as 1.0, so a trainer claims `1 - genrm_share` and its replica `genrm_share` (a scheduling token, not a
  memory split: the phases run in series and each sleeps while the others work).
* partial coexistence (the seed system's): training takes every accelerator; during rollout the rollout
  engines and GenRM replicas share them and work at the same time, each finished sample judged at once. The
  replicas sit on the training accelerators as in full coexistence (`genrm_share` each), their number
  following the measured judging load (Serve autoscaling on ongoing requests) between
  `reward.genrm.replicas` and one per training accelerator's group of `accelerators_per_replica`; idle ones
  release their memory, so every accelerator trains. No accelerator is held by a role that never trains.
* disaggregated: GenRM replicas on their own slice, `accelerators_per_replica` whole accelerators each
  (a placement-group bundle per accelerator behind each Serve replica); up to `max_replicas` of them when
  the deployment autoscales. The trainers keep their slice for rollout and training; the GenRM slice never
  trains.
  With `placement.rollout_engines = E > 0` the rollout engines leave the trainers too: E engine actors, one
  accelerator each (on CPUs `cpus_per_engine` CPUs each), reached by every controller through one router
  (`rollout/pool.py`); the trainers then only train. Elsewhere each controller's engine lives in its own
  process beside its trainer (weights move in memory: the fastest form on a shared accelerator).

Memory is checked on real GPUs (their memory read from a device by the driver, or `placement.gpu_memory_gb`
when set: then also on logical GPUs) and estimated per accelerator from the parameter counts. Per TP-local
parameter a trainer holds (`trainer_bytes_per_param`) weights w = 4 (train.dtype=fp32) or 2 (bf16), fp32
gradients 4 (Megatron's main_grad) and the optimizer state: Adam moments 8, plus fp32 main weights 4 for bf16
only (fp32 weights are their own main copy), divided by d = train.dp_size under train.distributed_optimizer
(ZeRO-1). In bytes per parameter:

    dtype   replicated   distributed optimizer
    fp32    16           8 + 8 / d
    bf16    18           6 + 12 / d

The trainer term is that x P / tp, + w P / tp for a reference model, + that x P_critic / tp for a critic;
rollout w P + KV cache (the engine generates in train.dtype; with rollout.kv_cache_gb null, vLLM's
rollout.gpu_memory_utilization of the GPU); the trainer's activations at its largest micro-batch are added
when the policy's shape is known (`activation_bytes`); GenRM w_judge J / accelerators_per_replica
(w_judge from reward.genrm.dtype) + KV cache. Full coexistence needs the largest phase; partial needs
max(trainer, rollout + GenRM) (engine and judge resident together while rolling out); disaggregated needs
max(trainer, rollout) on the trainer slice and the GenRM term on the GenRM slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from yatt_ray.config import Config
from yatt_ray.errors import PlacementError

RESERVED_GB = 2.0  # of each GPU, kept out of the memory check: the CUDA context, NCCL buffers, fragmentation
DATA_CPUS = 1  # kept free for Ray Data's read tasks; without one the prompt streams would stall
GIB = 2**30


@dataclass(frozen=True)
class GenRMSlice:
    """The GenRM deployment's replicas and what each claims."""

    replicas: int
    max_replicas: int
    accelerators_per_replica: int
    gpus_per_accelerator: float  # 1 (disaggregated), genrm_share (full, partial) or 0 (no GPUs)
    cpus: int
    release_when_idle: bool  # full, partial: release memory between judging phases (the trainers need it)

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per accelerator of a replica; the replica's CPUs go in the first."""
        gpu = {"GPU": self.gpus_per_accelerator} if self.gpus_per_accelerator else {}
        rest = [{"CPU": 0.01, **gpu} for _ in range(self.accelerators_per_replica - 1)]
        return [{"CPU": float(self.cpus), **gpu}, *rest]


@dataclass(frozen=True)
class EngineSlice:
    """Rollout engine actors on resources of their own (disaggregated placement)."""

    count: int
    gpus: float  # 1 each on GPUs, 0 on CPUs
    cpus: int

    def resources(self) -> dict[str, float]:
        return {"CPU": float(self.cpus), **({"GPU": self.gpus} if self.gpus else {})}


@dataclass(frozen=True)
class PlacementPlan:
    mode: str
    dp_size: int
    tp_size: int
    cpus_per_worker: int
    gpus_per_worker: float  # 1, 1 - genrm_share (full / partial coexistence with a GenRM), or 0 (CPU only)
    genrm: GenRMSlice | None = None
    engines: EngineSlice | None = None  # None: each controller's engine in its own process
    with_reference: bool = True  # a frozen reference model beside the policy (algo.kl_coef > 0)
    with_critic: bool = False  # a value model beside the policy (critic.enable)

    @property
    def num_workers(self) -> int:
        return self.dp_size * self.tp_size

    @property
    def uses_gpus(self) -> bool:
        return self.gpus_per_worker > 0

    def trainer_resources(self) -> dict[str, float]:
        """Ray resources of one training worker (the GPU part goes to ScalingConfig via use_gpu)."""
        gpu = {"GPU": self.gpus_per_worker} if self.uses_gpus else {}
        return {"CPU": float(self.cpus_per_worker), **gpu}

    def accelerators_needed(self) -> int:
        if not self.uses_gpus:
            return 0
        engines = self.engines.count if self.engines else 0
        if self.mode != "disaggregated" or self.genrm is None:
            return self.num_workers + engines
        return self.num_workers + engines + self.genrm.max_replicas * self.genrm.accelerators_per_replica

    def cpus_needed(self) -> int:
        genrm = self.genrm.max_replicas * self.genrm.cpus if self.genrm else 0
        engines = self.engines.count * self.engines.cpus if self.engines else 0
        return self.num_workers * self.cpus_per_worker + genrm + engines + DATA_CPUS

    def roles(self) -> str:
        """What each training worker holds: "policy + reference + critic + optimizer" as built."""
        held = ["policy"] + ["reference"] * self.with_reference + ["critic"] * self.with_critic
        return " + ".join([*held, "optimizer"])

    def describe(self) -> str:
        device = f"{self.gpus_per_worker:g} GPU" if self.uses_gpus else "CPU only"
        lines = [
            f"placement: {self.mode} coexistence, {self.num_workers} training worker(s) = dp {self.dp_size} x tp "
            f"{self.tp_size}, {self.accelerators_needed()} accelerator(s), {self.cpus_needed()} CPUs",
            f"  each worker: {self.cpus_per_worker} CPU, {device}; {self.roles()}",
            f"  controllers: {self.dp_size} (tp rank 0 of each group), " + self._engines_line(),
        ]
        g = self.genrm
        if g is not None:
            where = (
                "on their own slice" if self.mode == "disaggregated" else "sharing the training accelerators"
            )
            scale = f"{g.replicas}" if g.max_replicas == g.replicas else f"{g.replicas}..{g.max_replicas}"
            lines.append(
                f"  GenRM: {scale} Serve replica(s) {where}, bundles {g.bundles()} each"
                + ("; released between judging phases" if g.release_when_idle else "")
            )
        lines.append("  per phase: " + self.phases())
        return "\n".join(lines)

    def _engines_line(self) -> str:
        e = self.engines
        if e is None:
            return "each with its rollout engine in its own process (weights in memory)"
        where = f"{e.count} accelerator(s) of their own" if self.uses_gpus else f"{e.cpus} CPU(s) each"
        return (
            f"reaching {e.count} rollout engine actor(s) on {where} through one router (least-loaded; a "
            "prompt's samples on one engine); weights pushed by group 0's controller"
        )

    def phases(self) -> str:
        """Which roles hold the accelerators in each phase of a step."""
        trainers = f"{self.num_workers} training accelerator(s)" if self.uses_gpus else "the training workers"
        if self.engines is not None:
            own = (
                f"{self.engines.count} engine accelerator(s)" if self.uses_gpus else "the engine actors' CPUs"
            )
            judging = "" if self.genrm is None else " while GenRM replicas judge on their own slice"
            return f"rollout: engines on {own}{judging}; train: trainers on {trainers} ({own} idle)"
        if self.genrm is None:
            return f"rollout: engines on {trainers}; train: trainers on {trainers}"
        if self.mode == "full":
            return (
                f"rollout: engines on {trainers}; reward: GenRM replicas on {trainers}; train: trainers on "
                f"{trainers} (phases in series)"
            )
        if self.mode == "partial":
            return (
                f"rollout + reward: engines and GenRM replicas together on {trainers}, samples judged as they "
                f"finish; train: trainers on {trainers}"
            )
        judges = self.genrm.max_replicas * self.genrm.accelerators_per_replica
        slice_ = f"{judges} GenRM accelerator(s)" if self.uses_gpus else "the GenRM replicas' CPUs"
        return (
            f"rollout: engines on {trainers} while GenRM replicas judge on {slice_}; train: trainers on "
            f"{trainers} ({slice_} idle)"
        )

    def check(self, cluster: dict[str, float]) -> None:
        """Raise PlacementError when the cluster's total resources cannot hold the plan."""
        have_cpu, have_gpu = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
        if have_cpu < self.cpus_needed():
            raise PlacementError(
                f"the plan needs {self.cpus_needed()} CPUs ({self.num_workers} workers x {self.cpus_per_worker}"
                + (f" + GenRM {self.genrm.max_replicas} x {self.genrm.cpus}" if self.genrm else "")
                + (f" + engines {self.engines.count} x {self.engines.cpus}" if self.engines else "")
                + f" + {DATA_CPUS} for data) but the cluster has {have_cpu:g}. Lower train.dp_size / "
                "train.tp_size or cluster.cpus_per_worker, or add nodes; for a demo on a small machine, logical CPUs "
                f"may exceed the cores: `ray start --head --num-cpus={self.cpus_needed()}`."
            )
        need = self.accelerators_needed()
        if have_gpu >= need:
            return
        if self.engines is not None:
            raise PlacementError(
                f"disaggregated placement needs {need} GPUs: the trainer slice dp x tp = {self.num_workers}, "
                f"placement.rollout_engines = {self.engines.count}"
                + (
                    f" and the GenRM slice {self.genrm.max_replicas} x {self.genrm.accelerators_per_replica}"
                    if self.genrm
                    else ""
                )
                + f", but the cluster has {have_gpu:g}. Lower placement.rollout_engines or train.dp_size, or set "
                "placement.rollout_engines=0 (each controller's engine beside its trainer)."
            )
        if self.mode == "disaggregated" and self.genrm is not None:
            g = self.genrm
            raise PlacementError(
                f"disaggregated placement needs {need} GPUs: the trainer slice dp x tp = {self.num_workers} plus "
                f"the GenRM slice reward.genrm.max_replicas x accelerators_per_replica = {g.max_replicas} x "
                f"{g.accelerators_per_replica}, but the cluster has {have_gpu:g}. Lower reward.genrm.replicas / "
                "max_replicas or train.dp_size, or use placement.mode=partial (GenRM shares the trainers' GPUs "
                "during rollout)."
            )
        raise PlacementError(
            f"the plan needs {need} GPUs ({self.num_workers} workers) but the cluster has {have_gpu:g}. "
            "Lower train.dp_size x train.tp_size, or set cluster.use_gpu=false to train on CPUs."
        )


@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts for the memory check (policy, critic or 0, judge or 0), and the policy's decoder shape
    (`LlamaShape`; None: activations are not counted)."""

    policy: int
    critic: int = 0
    judge: int = 0
    shape: Any = None


def plan_placement(
    config: Config, cluster: dict[str, float], sizes: ModelSizes | None = None
) -> PlacementPlan:
    """The plan for `config` on a cluster with `cluster` total resources, checked (resources, divisibility,
    and memory when `placement.gpu_memory_gb` and `sizes` are given).

    `cluster.cpus_per_worker` is the driver's resolved value (`cluster.resolve_cpus_per_worker`); left None
    (a plan computed without a connected cluster), it is the cluster's CPUs less the data tasks' share, shared
    among the training workers and GenRM replicas (`shared_cpus`)."""
    use_gpu = config.cluster.use_gpu
    if use_gpu is None:
        use_gpu = cluster.get("GPU", 0.0) >= 1
    mode, with_genrm = config.placement.mode, config.reward.mode != "rule"
    engines = config.placement.rollout_engines
    if mode != "full" and not with_genrm and not engines:
        raise PlacementError(
            f"placement.mode={mode} places the GenRM beside the rollout engines, but reward.mode='rule' uses no "
            "GenRM; set reward.mode=genrm (or mix), or use placement.mode=full"
            + (
                " (or disaggregated rollout engines: placement.rollout_engines > 0)"
                if mode != "partial"
                else ""
            )
        )
    if mode == "partial" and with_genrm:
        _check_partial(config)
    share = config.placement.genrm_share if (use_gpu and with_genrm and mode != "disaggregated") else 0.0
    cpus = config.cluster.cpus_per_worker
    if cpus is None:
        replicas = genrm_replica_count(config, use_gpu) if with_genrm else 0
        free = cluster.get("CPU", 0.0) - DATA_CPUS - engines * config.placement.cpus_per_engine
        cpus = shared_cpus(free, config.train.dp_size * config.train.tp_size + replicas)
    plan = PlacementPlan(
        mode=mode,
        dp_size=config.train.dp_size,
        tp_size=config.train.tp_size,
        cpus_per_worker=cpus,
        gpus_per_worker=(1.0 - share) if use_gpu else 0.0,
        genrm=_genrm_slice(config, use_gpu, cpus) if with_genrm else None,
        engines=EngineSlice(engines, 1.0 if use_gpu else 0.0, config.placement.cpus_per_engine)
        if engines
        else None,
        with_reference=config.algo.kl_coef > 0,  # as roles.build_roles builds the policy
        with_critic=config.critic.enable,
    )
    plan.check(cluster)
    if sizes is not None and config.placement.gpu_memory_gb is not None and use_gpu:
        check_memory(plan, config, sizes, config.placement.gpu_memory_gb)
    return plan


def _check_partial(config: Config) -> None:
    """A config written when `partial` meant a GenRM slice of its own sizes that slice with
    reward.genrm.max_replicas: refused with the choice to make (the seed's partial coexistence has no slice:
    its replicas follow the judging load up to one per training accelerator)."""
    g = config.reward.genrm
    workers = config.train.dp_size * config.train.tp_size
    if g.max_replicas is not None or g.replicas > workers:
        raise PlacementError(
            f"placement.mode=partial with reward.genrm.replicas={g.replicas}, max_replicas={g.max_replicas}: "
            "partial is the seed system's partial coexistence (training takes every accelerator; during "
            f"rollout the engines and up to one GenRM replica per training accelerator, here {workers}, share "
            "them, following the judging load). To keep GenRM replicas on accelerators of their own, sized by "
            "max_replicas (what placement.mode=partial meant before), choose placement.mode=disaggregated; "
            f"else drop max_replicas and keep replicas <= {workers}."
        )


def genrm_replica_count(config: Config, use_gpu: bool) -> int:
    """The most GenRM replicas the plan holds: one per training accelerator's share in full and partial
    coexistence on GPUs, else `reward.genrm.max_replicas` (or `replicas`)."""
    g, workers = config.reward.genrm, config.train.dp_size * config.train.tp_size
    if config.placement.mode != "disaggregated" and use_gpu:
        return max(workers // g.accelerators_per_replica, 1)
    return g.max_replicas or g.replicas


def _genrm_slice(config: Config, use_gpu: bool, cpus: int) -> GenRMSlice:
    g, workers, mode = config.reward.genrm, config.train.dp_size * config.train.tp_size, config.placement.mode
    apr = g.accelerators_per_replica
    if mode != "disaggregated" and use_gpu:
        if workers % apr:
            raise PlacementError(
                f"{mode} coexistence puts GenRM replicas on the {workers} training accelerators, which "
                f"reward.genrm.accelerators_per_replica={apr} does not divide; pick a divisor of {workers}"
            )
        max_replicas = genrm_replica_count(config, use_gpu)
        # full: one beside every trainer (the judging phase has them all); partial: as many as the load needs
        replicas = max_replicas if mode == "full" else min(g.replicas, max_replicas)
    else:
        replicas, max_replicas = g.replicas, genrm_replica_count(config, use_gpu)
    gpus = (config.placement.genrm_share if mode != "disaggregated" else 1.0) if use_gpu else 0.0
    return GenRMSlice(
        replicas=replicas,
        max_replicas=max_replicas,
        accelerators_per_replica=apr,
        gpus_per_accelerator=gpus,
        cpus=cpus,
        release_when_idle=mode != "disaggregated",
    )


def weight_bytes(dtype: str) -> int:
    """Bytes of one weight in `dtype` ("fp32" | "bf16": `train.dtype`, `reward.genrm.dtype`)."""
    return 2 if dtype == "bf16" else 4


def trainer_bytes_per_param(dtype: str, distributed_optimizer: bool, dp_size: int) -> float:
    """Bytes per TP-local parameter of a trainer: weights, fp32 gradients and the optimizer state (Adam
    moments, plus fp32 main weights for bf16), the latter sharded over `dp_size` ranks under ZeRO-1."""
    optimizer = 8 + (4 if dtype == "bf16" else 0)  # Adam moments (+ fp32 main weights)
    shards = dp_size if distributed_optimizer else 1
    return weight_bytes(dtype) + 4 + optimizer / shards


def micro_batch_tokens(config: Config) -> int:
    """The most tokens one trainer forward holds: `train.max_tokens_per_micro_batch`, else micro_batch_size
    whole samples of max_prompt_tokens + max_new_tokens."""
    t = config.train
    longest = config.data.max_prompt_tokens + config.rollout.max_new_tokens
    return t.max_tokens_per_micro_batch or t.micro_batch_size * longest


def activation_bytes(shape: Any, tokens: int, tp: int, dtype: str, recompute: bool) -> float:
    """Bytes a training forward of `tokens` tokens keeps for its backward on one TP rank, at the peak.

    Per token and layer a decoder layer saves about (6 h + (3 F + q + 2 kv) / tp) values in the weights'
    dtype (norm inputs and outputs, the attention's q, k, v and output, the residuals, the SwiGLU's two
    halves and product; no s^2 term: attention is fused), h hidden, F the MLP's width, q and kv the query
    and key/value widths. With recomputation (`train.recompute_activations`) a layer keeps only its input h,
    and one layer's full set exists while it is recomputed. The log-probs add `logprob_bytes` (no logits: they
    are taken from the hidden states in chunks of the vocabulary, `train/logprobs.py`)."""
    w = weight_bytes(dtype)
    h, layers = shape.hidden_size, shape.num_layers
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    layer = 6 * h + (3 * shape.ffn_hidden_size + q + 2 * kv) / tp
    kept = h * layers + layer if recompute else layer * layers
    return tokens * w * kept + logprob_bytes(tokens, h)


LOGPROB_CHUNK_ELEMENTS = 1 << 25  # float32 values of one vocabulary chunk on a GPU (train/logprobs.py's)


def logprob_bytes(tokens: int, hidden: int) -> float:
    """The log-probs' and entropy's peak beyond their inputs and gradients: six float32 chunks of
    LOGPROB_CHUNK_ELEMENTS (a chunk's logits and the backward's temporaries) and the [T, H] float32 gradient
    of the hidden states (measured: 753 MiB at 16,384 tokens x 151,936 ids x 1,536, against 864 here;
    `release/bench_gpu_ready.py`)."""
    return 6 * LOGPROB_CHUNK_ELEMENTS * 4 + tokens * hidden * 4


def memory_estimate_gb(
    plan: PlacementPlan, config: Config, sizes: ModelSizes, have_gb: float | None = None
) -> dict[str, float]:
    """Per-accelerator GiB of each role (see the module docstring for the byte counts); the trainer's
    activations when `sizes.shape` is known (`activation_bytes`). With rollout.kv_cache_gb null the engine
    takes rollout.gpu_memory_utilization of `have_gb` (its weights alone when `have_gb` is unknown)."""
    t, tp = config.train, plan.tp_size
    w = weight_bytes(t.dtype)
    per_param = trainer_bytes_per_param(t.dtype, t.distributed_optimizer, plan.dp_size)
    reference = w * sizes.policy if config.algo.kl_coef > 0 else 0
    trainer = (per_param * (sizes.policy + sizes.critic) + reference) / tp
    if sizes.shape is not None:
        tokens = micro_batch_tokens(config)
        trainer += activation_bytes(sizes.shape, tokens, tp, t.dtype, t.recompute_activations)
    r = config.rollout
    rollout = w * sizes.policy + (r.kv_cache_gb or 0) * GIB
    if r.kv_cache_gb is None and have_gb is not None:
        rollout = max(rollout, r.gpu_memory_utilization * have_gb * GIB)
    out = {"trainer": trainer / GIB, "rollout": rollout / GIB}
    if plan.genrm is not None:
        g = config.reward.genrm
        judge = weight_bytes(g.dtype) * sizes.judge / g.accelerators_per_replica
        out["genrm"] = (judge + g.kv_cache_gb * GIB) / GIB
    return out


def check_memory(plan: PlacementPlan, config: Config, sizes: ModelSizes, have_gb: float) -> dict[str, float]:
    """Raise PlacementError when a phase needs more than `have_gb` GiB per accelerator; returns the estimates."""
    est = memory_estimate_gb(plan, config, sizes, have_gb)
    r, weights_gb = config.rollout, weight_bytes(config.train.dtype) * sizes.policy / GIB
    if r.kv_cache_gb is None and weights_gb > 0.9 * r.gpu_memory_utilization * have_gb:
        raise PlacementError(
            f"the rollout engine's part of each GPU, rollout.gpu_memory_utilization={r.gpu_memory_utilization:g} "
            f"of {have_gb:g} GiB, leaves no room for a KV cache beside the policy's {weights_gb:.1f} GiB of "
            "weights. Raise rollout.gpu_memory_utilization, or set rollout.kv_cache_gb."
        )
    if plan.mode == "full":
        needs = {"the largest phase (" + max(est, key=est.__getitem__) + ")": max(est.values())}
    elif plan.mode == "partial":
        together = est["rollout"] + est.get("genrm", 0)
        needs = {"training, or rollout and judging together": max(est["trainer"], together)}
    else:
        needs = {
            "the trainer slice": max(est["trainer"], est["rollout"]),
            "the GenRM slice": est.get("genrm", 0),
        }
    for where, gb in needs.items():
        if gb > have_gb - RESERVED_GB:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in est.items())
            raise PlacementError(
                f"{plan.mode} coexistence needs about {gb:.1f} GiB per accelerator for {where} (estimates in "
                f"GiB: {parts}) but each has {have_gb:g} ({RESERVED_GB:g} of it kept free). Raise train.tp_size or "
                "reward.genrm.accelerators_per_replica, set train.recompute_activations=true or lower "
                "train.max_tokens_per_micro_batch, lower rollout.kv_cache_gb / gpu_memory_utilization or "
                "reward.genrm.kv_cache_gb, set train.distributed_optimizer=true or train.dtype=bf16, or use a "
                "larger accelerator."
            )
    return est


def shared_cpus(cpus: float, workers: int) -> int:
    """floor(cpus / workers), at least 1."""
    return max(1, int(cpus // max(workers, 1)))


def param_count(model_dir: str) -> int:
    """Parameters of the Llama-style model in `model_dir`, from its config.json (no weights read)."""
    from yatt_ray.model_shape import LlamaShape

    s = LlamaShape.from_hf_dir(model_dir)
    kv = 2 * s.num_kv_heads * s.head_dim * s.hidden_size
    attn = s.num_heads * s.head_dim * s.hidden_size * 2 + kv
    layer = attn + 3 * s.hidden_size * s.ffn_hidden_size + 2 * s.hidden_size
    embed = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    return s.num_layers * layer + embed + s.hidden_size
