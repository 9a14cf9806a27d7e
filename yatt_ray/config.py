"""Typed configuration: dataclass sections, YAML loading, `key.sub=value` overrides and validation.

A config is a tree of small dataclasses. `load_config(path, overrides)` reads a YAML file (optional),
applies `section.key=value` overrides (values parsed as YAML scalars), and validates the whole. Every
error names the key, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from yatt_ray.errors import ConfigError

# The valid names of each mode: one source (validate and the code that branches on them read these types).
EngineKind = Literal["auto", "vllm", "hf"]  # auto: vllm when installed and the model suits it, else hf
RewardMode = Literal["rule", "genrm", "mix"]
ParseErrorPolicy = Literal["zero", "rule", "raise"]
RewardErrorPolicy = Literal["raise", "zero"]
PlacementMode = Literal["full", "partial", "disaggregated"]
WeightTransport = Literal["auto", "object_store", "broadcast"]
PlacementStrategy = Literal["PACK", "SPREAD"]
AlgoName = Literal["grpo", "ppo", "rloo", "reinforce_pp", "remax"]  # each names its estimator; ppo: gae
WandbMode = Literal["", "online", "offline", "disabled"]
DynamicSampling = Literal[
    "off", "reward", "accuracy"
]  # DAPO's group filter: the value that must vary in a group
BalanceMode = Literal["off", "tokens", "flops"]  # data-parallel load balancing of the train phase
DemoTask = Literal["arithmetic", "longtail", "vision"]
VisionDemoModel = Literal["llava", "qwen2_5_vl"]
BadImagePolicy = Literal["skip", "raise"]  # a corrupt image or missing path: count and skip the row, or stop
TrainVision = Literal["none", "projector", "all"]  # which parts of a vision-language policy's encoder train
TrainDtype = Literal[
    "fp32", "bf16"
]  # the trainer's weights and compute (bf16: fp32 main weights in the optimizer)
# the correction between the policy that sampled and the one that trains (yatt_ray/algos/off_policy.py)
OffPolicy = Literal["none", "tis", "mis", "icepop", "decoupled"]


class _Section:
    """Base of every config section: mutable until `Config.freeze()`, read-only after it (the driver resolves
    the config once, freezes it, and ships that to the workers and GenRM replicas)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise ConfigError(
                f"the config is frozen (the driver resolved it for this run): {type(self).__name__}.{name} "
                "cannot change now; set it before fit(), or pass an override"
            )
        super().__setattr__(name, value)


@dataclass
class ModelConfig(_Section):
    """The policy: a Hugging Face directory (`path`; empty builds the demo model) and, for a vision-language
    policy, which parts of its vision encoder train."""

    # a Hugging Face model (config.json, weights, tokenizer) of a supported architecture: Llama, Mistral, Qwen2
    # / Qwen2.5, Qwen3, LLaVA with a Llama language model, Qwen2-VL / Qwen2.5-VL. A local directory, an fsspec
    # URL (s3://bucket/models/qwen) or a hub id (Qwen/Qwen2.5-7B-Instruct): a remote one is fetched once per
    # node into a cache before the run starts ($YATT_RAY_MODEL_CACHE, else ~/.cache/yatt_ray/models; hub ids
    # into $HF_HOME). "" (with data.train_files empty too) builds the demo model (demo.*)
    path: str = ""
    # LLaVA policies: none = the vision tower and projector stay frozen, projector = the projector trains,
    # all = the tower too; the language model always trains
    train_vision: TrainVision = "none"


@dataclass
class DataConfig(_Section):
    """Prompt data: parquet or jsonl files (local paths, globs or fsspec URLs); empty generates the demo task."""

    # the training prompts: parquet or jsonl files, local paths, globs or fsspec URLs (s3://...), each with
    # the columns the *_key settings name; [] (with model.path empty too) generates the demo task
    train_files: list[str] = field(default_factory=list)
    # greedy accuracy at the start and the end; None: the demo's eval set in the demo, none with your own
    # data; [] = no evaluation
    eval_files: list[str] | None = None
    # the columns read as each row's prompt (a string or a list of chat messages), answer, source and id; a
    # dotted key names a field of a struct column (parquet) or a nested object (jsonl), a column whose own
    # name is the whole key winning. A verl-format parquet (verl's GSM8K / MATH preprocessing: prompt,
    # data_source, reward_model {ground_truth}, extra_info {index}) is used as it is with
    # `data.answer_key=reward_model.ground_truth data.id_key=extra_info.index reward.function=math`
    prompt_key: str = "prompt"
    # the column of each row's answer, passed to the reward function as its ground truth (dotted keys as for
    # prompt_key)
    answer_key: str = "ground_truth"
    # the column of each row's data source, passed to the reward function (a file without it reads "default")
    source_key: str = "data_source"
    # the column of each row's id, unique within its file: a checkpoint's data position records ids; a row
    # without one (no column, a null, -1) is trained again in its epoch after a resume (warned)
    id_key: str = "id"
    # a system message for every prompt ("" = none): a chat prompt without a system message gets it first; a
    # string prompt becomes [system, user] rendered by the tokenizer's chat template (no template: the two
    # joined by a newline)
    system_prompt: str = ""
    # the longest prompt in tokens (after the chat template): a longer one keeps its last tokens (counted in
    # prompts_clipped) unless that cuts an image's tokens (a DataError); this plus rollout.max_new_tokens must
    # fit the model's max_position_embeddings
    max_prompt_tokens: int = 64
    # the seed of Ray Data's shuffle of the training rows; null: no shuffle, rows in file order
    shuffle_seed: int | None = 0
    # images (vision-language policies): a column holding, per row, a list of {"bytes": ...} or {"path": ...}
    # entries (verl's layout); the prompt holds one <image> placeholder per image
    image_key: str = "images"
    on_bad_image: BadImagePolicy = "skip"  # skip: counted (data/bad_images), warned, consumed; raise: stop
    # on_bad_image=skip: the run stops (DataError naming the column and a few rejected ids) once a group's
    # stream rejected more than this many rows one after another, with no usable row between them (a wrong
    # image folder, paths relative to another machine), or once every row of an epoch was rejected, whatever
    # this bound; null: no bound (a whole epoch rejected still stops it); 0: the first rejected row stops it
    max_rejected_in_a_row: int | None = 1000
    # image limits. Qwen2-VL / 2.5-VL: each image is resized (aspect kept, sides multiples of 28 px) so that
    # min_pixels <= H x W <= max_pixels, one token per 28 x 28 px (null: the model directory's
    # preprocessor_config.json). LLaVA resizes every image to its tower's size, so these do not apply to it.
    min_pixels: int | None = None
    # Qwen VL only: the largest image area in pixels (see min_pixels); null: the model's
    # preprocessor_config.json
    max_pixels: int | None = None
    # a row with more images is bad: skipped and counted (on_bad_image=skip) or the run stops (raise); null = any
    max_images: int | None = None


@dataclass
class RolloutConfig(_Section):
    """Generation: engine kind, samples per prompt and sampling parameters."""

    # the generation engine: vllm, hf (Hugging Face generate) or auto: on GPUs vLLM when installed and it
    # serves the model; on CPUs the faster of the two, timed once per machine, model and rollout shape
    # (cached); hf when train.tp_size > 1
    engine: EngineKind = "auto"
    n: int = 8  # samples per prompt (a prompt's group); the group estimators (grpo, rloo, ...) need >= 2
    # the longest completion in tokens (a sample cut there ends with finish_reason "length")
    max_new_tokens: int = 6
    temperature: float = 1.0  # sampling temperature, >= 0 (0 = greedy); evaluation always decodes greedily
    # nucleus sampling: draw from the most likely tokens whose probabilities sum to top_p, in (0, 1] (1 = off)
    top_p: float = 1.0
    weight_sync_bucket_mb: float = 64  # MiB a bucket of a weight push (a larger tensor: a bucket of its own)
    # engine actors (placement.rollout_engines): how weights reach them; auto = the object store on the
    # pusher's node, a broadcast group to other nodes (NCCL between GPUs, gloo over host copies otherwise)
    weight_transport: WeightTransport = "auto"
    # vLLM's KV cache per engine in GiB (on a CPU, resident host memory); the hf engine ignores it. null: on GPUs
    # vLLM sizes it from gpu_memory_utilization (what is left of that part of the GPU after the weights), on
    # CPUs 1 GiB
    kv_cache_gb: float | None = None
    # vLLM on GPUs: the part of each GPU an engine may take (weights, KV cache, activations); with full
    # coexistence the trainer's state is in host memory while the engine generates
    gpu_memory_utilization: float = 0.5
    # fixed-length generation for throughput runs: no stop at EOS (or any stop token), every completion runs
    # to max_new_tokens (finish_reason "length"); the tokens after an EOS are scored and trained on as they are
    ignore_eos: bool = False
    # long-tail control: start ceil(over_sample x share) prompts, keep the first `share` whose samples all
    # finish, abort the rest in the engine and serve them first next step (1.0 = off)
    over_sample: float = 1.0
    # a prompt aborted this often is waited for the next time it starts (its step pays its tail), so none stays
    # in the queue for ever; null never waits (the longest prompts may then never train)
    max_aborts: int | None = 3
    # asynchronous rollout (needs placement.rollout_engines > 0): the engines generate up to this many steps'
    # prompts ahead while the trainer trains; a sample's weights are at most this many versions older than the
    # trainer's (0 = synchronous)
    max_staleness: int = 0
    # engine actors: every request runs on exactly the weights it asks for (a push waits behind the older
    # requests queued on an engine; no in-flight updates) and prompts go to engines by a fixed rule, not by load,
    # so two runs with one seed produce the same samples, asynchronous ones included; costs up to max_staleness
    # pushes kept in each engine's host memory and the load balance between engines
    ordered: bool = False
    # engine actors: how long a request waits for the weight version it asks for while no engine holds or
    # keeps it (seconds); time queued behind other requests on a busy engine does not count. Past it the
    # controller pushes the weights to that engine itself (train.tp_size=1) or sends the prompts elsewhere
    weight_timeout_s: float = 600.0
    # engine actors: the requests queued on an engine (from every controller, K steps ahead) run together in
    # one engine call when their sampling matches and none aborts its long tail (rollout.over_sample); false:
    # one call a request, in arrival order (as rollout.ordered does)
    join_requests: bool = True


@dataclass
class GenRMConfig(_Section):
    """The generative reward model (judge), served by Ray Serve when `reward.mode` is genrm or mix.

    `template`: a string with {prompt}, {response}, {ground_truth}, or `pkg.mod:fn` returning the judge
    prompt; `parser`: yes_no | score | `pkg.mod:fn` (text -> score in [0, 1] or None). An unparsable verdict
    is counted (`genrm/parse_failures`) and handled by `on_parse_error`: zero (score 0), rule (the rule
    reward of that sample) or raise (stop the run).
    """

    path: str = ""  # Hugging Face directory of the judge; "" with the demo builds the tiny judge
    # the judge prompt: a string with {prompt}, {response}, {ground_truth}, or pkg.mod:fn returning it;
    # "default" = yatt_ray.reward.genrm.DEFAULT_TEMPLATE
    template: str = "default"
    # the judge's text -> a score in [0, 1]: yes_no (first word yes / no), score (first number, in [0, 1] or
    # out of 10) or pkg.mod:fn (None = unparsable)
    parser: str = "yes_no"
    # an unparsable verdict (counted in genrm/parse_failures): zero (score 0), rule (the sample's rule reward)
    # or raise (stop the run)
    on_parse_error: ParseErrorPolicy = "zero"
    # the judge's engine: vllm, hf or auto (decided on the driver: vLLM on GPUs and for a judge split over
    # accelerators; on CPUs the faster of the two timed at a judge call's shape, cached per machine; hf where
    # vLLM cannot run the judge)
    engine: EngineKind = "auto"
    dtype: TrainDtype = "fp32"  # the judge's weights and compute (frozen: bf16 halves its memory on a GPU)
    max_new_tokens: int = 4  # the longest verdict in tokens (the judge decodes greedily)
    max_prompt_tokens: int = 512  # the rendered judge prompt keeps its last tokens
    kv_cache_gb: float = 0.5  # vLLM's KV cache per replica in GiB; the hf engine ignores it
    # full: one replica per training accelerator (its group of accelerators_per_replica); partial: `replicas`
    # at start, up to one per training accelerator with the judging load; disaggregated: `replicas` at start,
    # up to `max_replicas` (None = fixed), each on accelerators_per_replica accelerators of its own
    replicas: int = 1
    max_replicas: int | None = None  # disaggregated: autoscale up to this many with the load (None = fixed)
    # accelerators of one replica; > 1 splits the judge with vLLM's tensor parallelism (engine=vllm, a divisor
    # of the judge's attention heads)
    accelerators_per_replica: int = 1
    # the most verdicts a replica generates in one batch (serve.batch); also the autoscaler's target of
    # requests per replica
    batch_size: int = 64
    # seconds a replica waits for a batch to fill before it generates a smaller one
    batch_wait_s: float = 0.01
    timeout_s: float = 60.0  # seconds a request attempt may take before it is retried
    max_retries: int = 3  # attempts after the first when a replica fails or times out
    idle_release_s: float = (
        0.5  # full: a replica sleeps (releases memory) after this many seconds without a batch
    )
    http_port: int | None = None  # serve HTTP on 127.0.0.1:<port> too (off by default: handles only)


@dataclass
class RewardConfig(_Section):
    """How responses are scored: `mode` rule (the rule function), genrm (the judge) or mix
    (`(1 - genrm_weight) * rule + genrm_weight * genrm`). `function` is a built-in rule name or a user
    function as `package.module:function` (sync or async). `on_error`: when the function raises on a sample,
    raise (stop the run with a RewardError naming the sample) or zero (reward 0, counted in `reward/errors`);
    a return that is not a finite number always raises."""

    # rule: the rule function scores each sample; genrm: the judge (reward.genrm); mix: both, weighted by
    # genrm_weight
    mode: RewardMode = "rule"
    # the rule: a built-in (exact_match, prefix_match, repeat_match, gsm8k, math, math_verify) or your
    # fn(response, ground_truth, data_source) -> float as package.module:function (sync or async)
    function: str = "exact_match"
    # when the rule function raises on a sample: raise (a RewardError naming the sample) or zero (reward 0,
    # counted in reward/errors)
    on_error: RewardErrorPolicy = "raise"
    genrm_weight: float = 0.5  # mix: the judge's weight w in (1 - w) x rule + w x judge, in [0, 1]
    genrm: GenRMConfig = field(default_factory=GenRMConfig)


@dataclass
class PlacementConfig(_Section):
    """Where the roles run (yatt_ray/placement.py, docs/placement.md):

    - full: every role on every accelerator in turn (rollout, then judging, then training);
    - partial (the seed system's partial coexistence): training takes every accelerator; during rollout the
      rollout engines and the GenRM replicas share them and work at the same time (samples judged as they
      finish), the replicas following the judging load between `reward.genrm.replicas` and one per training
      accelerator; then both release memory and every accelerator trains;
    - disaggregated: GenRM replicas on accelerators of their own that never train (`reward.genrm.replicas` ..
      `max_replicas` x `accelerators_per_replica`), judging while rollouts generate; and/or, with
      `rollout_engines` > 0, the rollout engines as actors on accelerators of their own (one each; on CPUs
      `cpus_per_engine` CPUs each) that every controller reaches through one router (rollout/pool.py).

    Elsewhere (and with rollout_engines = 0) each controller's engine lives in its own process, beside its
    trainer: the fastest form when the two share an accelerator (weights move in memory)."""

    mode: PlacementMode = "full"  # full, partial or disaggregated: see above
    rollout_engines: int = 0  # disaggregated: engine actors on accelerators of their own (0: in-process)
    cpus_per_engine: int = 1  # an engine actor's CPUs (its torch threads on a CPU-only cluster)
    genrm_share: float = (
        0.1  # full, partial: the part of each GPU's Ray resource a GenRM replica claims (a token)
    )
    # GiB of memory of one GPU: the plan's memory estimate per accelerator is checked against it; null: read from
    # a GPU of the cluster (no check on logical GPUs without CUDA)
    gpu_memory_gb: float | None = None


@dataclass
class AlgoConfig(_Section):
    """The RL algorithm: advantage estimator, policy loss, KL to the reference and aggregation.

    `name` picks the algorithm (grpo, ppo, rloo, reinforce_pp, remax) and with it the advantage estimator;
    `advantage` overrides the estimator by its registry name. KL to the reference model enters either the
    loss (`kl_in_reward: false`, GRPO style) or the reward (`kl_in_reward: true`, PPO/RLHF style, with an
    adaptive coefficient when `kl_target` is set).
    """

    # the algorithm and its advantage estimator: grpo, rloo, reinforce_pp, remax (no critic) or ppo (GAE;
    # needs critic.enable=true)
    name: AlgoName = "grpo"
    # the advantage estimator by its registry name (gae, grpo, grpo_no_std, rloo, reinforce_pp,
    # reinforce_pp_baseline, remax); "" = the estimator of `name`
    advantage: str = ""
    policy_loss: str = "ppo_clip"  # ppo_clip | gspo (set clip_low/high ~3e-4/4e-4) | cispo (clip_low 1)
    # the importance ratio is clipped to [1 - clip_low, 1 + clip_high]; in [0, 1) (cispo also takes 1: no
    # lower bound)
    clip_low: float = 0.2
    # the upper side of the clip, > 0 (a larger value than clip_low is DAPO's clip-higher)
    clip_high: float = 0.2
    dual_clip: float | None = None  # > 1 + clip_high: caps the loss of negative-advantage tokens
    # the weight of KL(policy || reference), >= 0; 0 turns it off and no reference model is loaded
    kl_coef: float = 0.001
    kl_estimator: str = "k3"  # the per-token KL estimator: k1, k2, k3, or low_var_kl (k3 capped at 10)
    # false: the KL term is in the loss (GRPO); true: a per-token penalty on the reward (PPO / RLHF)
    kl_in_reward: bool = False
    kl_target: float | None = None  # adaptive coefficient: target KL per response (summed over tokens)
    # kl_target: the adaptive coefficient changes by at most 20% per this many samples
    kl_horizon: int = 10000
    entropy_coef: float = 0.0  # the weight of an entropy bonus in the loss (0 = none)
    # per-token losses -> one number: token-mean (every token of the global batch alike), seq-mean-token-mean
    # (each sequence alike; original GRPO), seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO's constant
    # normaliser)
    loss_agg: str = "token-mean"
    ppo_epochs: int = 1  # passes over each step's samples (each pass: ppo_mini_batches optimizer steps)
    ppo_mini_batches: int = 1  # optimizer steps per epoch; > 1 lets the PPO clip bind
    gamma: float = 1.0  # GAE discount
    lam: float = 1.0  # GAE lambda
    tis_cap: float | None = 2.0  # truncated importance sampling for rollout/trainer mismatch; None disables
    # off-policy correction (yatt_ray/algos/off_policy.py): none = the truncated IS above, as always; tis = the same
    # weight (needs tis_cap); mis = weight inside [is_band_low, is_band_high], tokens outside masked: this is
    # IcePop as published (Ring-1T), which keeps the ratio in the band; icepop = the band mask alone (weight 1
    # inside, no reweighting: token-level rejection sampling, not the published IcePop); decoupled = AReaL's
    # decoupled PPO (clip against old_logp) with the weight truncated to min(rho, tis_cap), where AReaL drops
    # the tokens above its cap (weight 0)
    off_policy: OffPolicy = "none"
    # mis / icepop: tokens whose ratio pi_old / pi_rollout leaves [is_band_low, is_band_high] are masked
    is_band_low: float = 0.5
    is_band_high: float = 2.0  # the band's upper bound, > 1 (see is_band_low)
    # DAPO's overlong reward shaping: 0 up to rollout.max_new_tokens - overlong_buffer tokens, then linearly down to
    # -overlong_penalty at rollout.max_new_tokens, added to the reward before the advantages (0 = off)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # the penalty at rollout.max_new_tokens, >= 0 (see overlong_buffer)
    # DAPO's dynamic sampling: drop prompt groups whose rewards ("reward") or correctness ("accuracy": reward
    # >= 1) are all equal, and draw more prompts until the group's share is informative, at most max_draws
    # draws a step (then the batch is topped up with dropped groups, with a warning and a counter)
    dynamic_sampling: DynamicSampling = "off"
    max_draws: int = 4  # dynamic_sampling: the most draws of prompts in one step, >= 1

    @property
    def estimator(self) -> str:
        """The advantage estimator's registry name: `advantage`, else the one `name` stands for."""
        return self.advantage or ("gae" if self.name == "ppo" else self.name)


@dataclass
class CriticConfig(_Section):
    """The value model for PPO: a Megatron trunk with a scalar head, colocated with the policy."""

    # train a value model beside the policy: algo.name=ppo (GAE) needs it, the other estimators refuse it
    enable: bool = False
    path: str = ""  # "" = initialise the trunk from model.path; or a directory saved by a previous run
    lr: float = 1e-3  # the critic's AdamW learning rate
    value_clip: float | None = 0.2  # PPO value clipping around the old values; None disables
    warmup_steps: int = 0  # steps that train only the critic before the policy starts to move


@dataclass
class TrainConfig(_Section):
    """Optimisation and parallelism. `prompts_per_step` counts prompts over all data-parallel groups."""

    steps: int = 80  # training steps (each: rollout, rewards, advantages, the update, the weight sync)
    # prompts per step over all data-parallel groups, a multiple of dp_size; each gives rollout.n samples
    prompts_per_step: int = 32
    # samples in one forward / backward on a rank, rounded down to whole groups of rollout.n (at least one
    # group); see max_tokens_per_micro_batch
    micro_batch_size: int = 128
    lr: float = 5e-4  # the policy's AdamW learning rate (constant)
    weight_decay: float = 0.0  # AdamW's weight decay (none on 1-D parameters: norm weights, biases)
    # the largest global gradient norm, larger ones scaled down to it; <= 0: no clipping (grad_norm is
    # reported either way)
    grad_clip: float = 1.0
    # data-parallel groups, each with its own controller, prompt stream and rollout engine; training workers =
    # dp_size x tp_size
    dp_size: int = 1
    # Megatron tensor parallelism: the workers of one group that split its model (a divisor of the attention
    # heads; the colocated vLLM engine needs 1)
    tp_size: int = 1
    # the trainers' random state and the sampling seed (each group's engine: seed + its data-parallel rank);
    # the demo's data
    seed: int = 0
    max_tokens_per_micro_batch: int | None = None  # dynamic batching by token budget; None = micro_batch_size
    # trainer state to host memory while generating, the engine's KV cache released while training (full
    # coexistence); None = on GPU only (on the CPU a release and re-allocation costs ~0.3 s a step for 1 GiB)
    offload_during_rollout: bool | None = None
    # after advantages, prompt groups move between data-parallel ranks (Karmarkar-Karp, equal counts) so each
    # rank's train cost is even: "tokens" (real tokens) or "flops" (forward+backward with the attention term)
    balance: BalanceMode = "tokens"
    # prompt groups whose advantages are all 0 (a GRPO group that scored alike) skip the policy's forward and
    # backward when they add nothing to the gradient: no KL in the loss, entropy_coef 0 (`step.zero_gradient_rows`;
    # the normalisers stay the whole batch's, so the update is the same); at least one group a rank still runs
    skip_zero_advantage: bool = True
    # weights and compute: fp32, or bf16 with fp32 gradients and fp32 main weights in the optimizer (Megatron's
    # mixed precision); the rollout engine generates in the same dtype (`rollout_logp_diff` shows the mismatch)
    dtype: TrainDtype = "fp32"
    # ZeRO-1 (Megatron's distributed optimizer): the optimizer state (main weights, Adam moments) is sharded over
    # the data-parallel ranks, gradients are reduce-scattered and the updated weights all-gathered
    distributed_optimizer: bool = False
    # activation recomputation: each decoder layer keeps only its input for the backward and runs its forward
    # again there (~1/3 more train compute; a 7B layer's saved activations 4.6 MB a token -> 0.37 MB in bf16)
    recompute_activations: bool = False


@dataclass
class ClusterConfig(_Section):
    """Where to run. `address` None starts (or joins, under `ray job submit`) a cluster; `use_gpu` None = auto."""

    # the Ray cluster to join ("auto": a `ray start` cluster on this machine, or ray://host:10001); null:
    # $RAY_ADDRESS when set (as under ray job submit), else a local cluster
    address: str | None = None
    # CPUs (Ray resource and torch / vLLM threads) of each training worker; None = the CPUs of its node shared
    # among the training workers there (`yatt_ray.cluster.resolve_cpus_per_worker`; the plan prints the value)
    cpus_per_worker: int | None = None
    # train on GPUs; null: when the cluster has one; false trains on CPUs where GPUs exist too
    use_gpu: bool | None = None
    # seconds the driver and the workers wait on a cluster call (metrics, the GenRM service starting, the
    # trainers taking their GPUs) before giving up
    timeout_s: float = 600.0
    # how Ray Train places the training workers over the nodes: PACK (as few nodes as possible) or SPREAD (as
    # many as possible); checked in placement.plan_placement
    placement_strategy: PlacementStrategy = "PACK"
    # peak FLOP/s of one accelerator for the MFU metrics (perf/mfu_*); None = the table in
    # yatt_ray/metrics/flops.py for GPUs, a measured fp32 matmul rate on CPUs
    peak_flops: float | None = None


@dataclass
class OutputConfig(_Section):
    """Where results go: metrics.jsonl, TensorBoard events, the reward plot and checkpoints.

    `mlflow` / `wandb` also send every metric row and the config (as params) to MLflow / Weights & Biases
    (`yatt_ray.metrics.sinks.MlflowSink`, `WandbSink`; `pip install mlflow-skinny` / `pip install wandb`).
    `mlflow_tracking_uri` "" = $MLFLOW_TRACKING_URI, else the file store `file:<output.dir>/mlruns`.
    `wandb_mode` "" = W&B's own default ($WANDB_MODE, else "online", which needs `wandb login`); "offline"
    writes `<run output folder>/wandb/offline-run-*` for a later `wandb sync`; "disabled" logs nothing.
    """

    # each run writes a fresh timestamped folder under it: config.yaml, metrics.jsonl, TensorBoard events,
    # plots, startup.json, the final policy (final_hf), and checkpoints (checkpoint.dir empty). A local path or
    # an fsspec URL (s3://bucket/runs): then the driver writes a local mirror ($YATT_RAY_RUN_CACHE, default
    # ~/.cache/yatt_ray/runs), uploaded when the run ends, and the checkpoints go to the URL directly
    dir: str = "runs/grpo"
    # the run's folder inside dir: "" = a fresh timestamped one per run; a name (letters, digits, . _ -) =
    # <dir>/<name>, which the same command with the same name finds again: it continues from the folder's
    # newest checkpoint (checkpoint.dir "" and checkpoint.resume auto), the curve's earlier file kept beside it
    name: str = ""
    tensorboard: bool = True  # write TensorBoard events to <run folder>/tensorboard
    # draw reward.png (reward and accuracy against step) and timeline.png (phases per accelerator) in the run
    # folder
    plot: bool = True
    progress: bool = True  # a progress bar of the steps on the driver's console
    mlflow: bool = False  # also log the metrics and the config to MLflow (pip install mlflow-skinny)
    # "" = $MLFLOW_TRACKING_URI, else the file store file:<output.dir>/mlruns that the runs under output.dir
    # share
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = "yatt_ray"  # the MLflow experiment; each run is named after its folder
    wandb: bool = False  # also log the metrics and the config to Weights & Biases (pip install wandb)
    wandb_project: str = "yatt_ray"  # the W&B project; each run is named after its folder
    wandb_entity: str = ""  # "" = the logged-in user's default entity
    wandb_mode: WandbMode = ""  # "": W&B's own default ($WANDB_MODE, else online)
    # false: the console shows the plan, the progress bar, the final report, warnings and errors (Ray's, Ray
    # Data's, Megatron's and vLLM's start-up notes are off: yatt_ray/console.py); true: everything
    verbose: bool = False


@dataclass
class CheckpointConfig(_Section):
    """Checkpoints: where, how often, what to keep, and how a run resumes (docs/checkpoints.md).

    `dir` is a local path or any fsspec URL ("" = `<run output folder>/checkpoints`). A save is due every
    `every_steps` steps or every `every_minutes` minutes (null turns a rule off), on SIGTERM to the driver or a
    Ray Train preemption notice (`on_sigterm`, `on_preemption`), and after the last step (`at_end`). `resume`
    decides the first start only: "auto" (the newest valid checkpoint in `dir`, if any), "never" (a fresh start;
    refused when `dir` already holds checkpoints), or a checkpoint folder / URL of an earlier run to start from.
    Once `dir` holds a valid checkpoint, every start (a restart after a worker failure, the same command run
    again) continues from its newest one.
    `enable: false` turns checkpoints off entirely: no test write to `dir`, no saves (not on SIGTERM either: the
    run still stops cleanly), no resume lookup, and a worker failure restarts the run from step 1. The final
    policy (`Result.checkpoint_path`) is still written.
    """

    enable: bool = True  # false: no checkpoints at all (see above); the final policy is still written
    dir: str = ""  # a local path or an fsspec URL (s3://, gs://, ...); "" = <run folder>/checkpoints
    every_steps: int | None = 50  # save when the step crosses a multiple of this; null: by time only
    # save once this many minutes passed since the last save; null: by steps only
    every_minutes: float | None = 30.0
    # the newest checkpoints kept, >= 1; older ones are deleted unless keep_every keeps them
    keep_last: int = 3
    # also keep every checkpoint whose step is a multiple of this; null: no such rule
    keep_every: int | None = None
    # SIGTERM or Ctrl-C to the driver: save after this step and stop (a second Ctrl-C aborts at once)
    on_sigterm: bool = True
    # Ray Train's notice that a node will be reclaimed: one save after this step, to restart from
    on_preemption: bool = True
    at_end: bool = True  # save after the last step (or a stop), unless that step was just saved
    # the first start: auto, never, or a checkpoint folder / URL of an earlier run (see above)
    resume: str = "auto"
    export_hf_every: int | None = None  # also write the policy as a HF directory every N steps
    export_hf_steps: list[int] = field(default_factory=list)  # also write it at these steps
    max_failures: int = 3  # Ray Train restarts after a worker failure (resuming from the latest checkpoint)
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options (S3 endpoint, keys, ...)
    log_prompt_ids: bool = False  # write each step's prompt ids under `dir`/prompt_ids (audits, drills)


@dataclass
class DemoConfig(_Section):
    """The embedded default task: supervised warm-up steps for the tiny model and the task's size."""

    # arithmetic: a + b; longtail: copy strings of heavy-tailed length (yatt_ray.tasks.longtail); vision: add
    # the numbers drawn in the prompt's image, for a vision-language policy (yatt_ray.tasks.visual)
    task: DemoTask = "arithmetic"
    vision_model: VisionDemoModel = "llava"  # task=vision: the tiny LLaVA, or the tiny Qwen2.5-VL
    # supervised warm-up steps of the demo policy before RL (cached per demo.* values in $YATT_RAY_CACHE,
    # default ~/.cache/yatt_ray)
    sft_steps: int = 250
    judge_sft_steps: int = (
        800  # supervised steps of the demo judge (built only when reward.mode uses a GenRM)
    )
    # arithmetic: operands are drawn from 0 .. max_operand (the demo judge learns the same range)
    max_operand: int = 19
    train_prompts: int = 4096  # rows of the demo's training file
    eval_prompts: int = 128  # rows of the demo's eval set (used when data.eval_files is null)


@dataclass
class Config(_Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def freeze(self) -> Config:
        """Make this config and every section read-only (an assignment raises `ConfigError`); returns self."""

        def walk(node: Any) -> None:
            for f in dataclasses.fields(node):
                value = getattr(node, f.name)
                if dataclasses.is_dataclass(value):
                    walk(value)
            object.__setattr__(node, "_frozen", True)

        walk(self)
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        return _build(cls, data, prefix="")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read `path` (YAML, optional), apply `key.sub=value` overrides, validate, and return a Config."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file {str(path)!r} does not exist; pass an existing YAML file (see examples/configs/)"
            )
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(_yaml_error_message(f"config file {str(path)!r}", exc)) from exc
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}"
            )
    for item in overrides or []:
        try:
            apply_override(data, item)
        except yaml.YAMLError as exc:
            raise ConfigError(_yaml_error_message(f"override {item!r}", exc)) from exc
    config = Config.from_dict(data)
    validate(config)
    return config


def _yaml_error_message(where: str, exc: yaml.YAMLError) -> str:
    """'<where> is not valid YAML: <problem> at line L, column C (...)', lines and columns 1-based."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    detail = f" ({context})" if context else ""
    return (
        f"{where} is not valid YAML: {problem}{at}{detail}; fix the syntax there (check the indentation, "
        "the colons after keys and that quotes and brackets are closed)"
    )


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set `data[a][b] = value` for the override "a.b=value" (value parsed as a YAML scalar or list)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.sub=value (for example train.steps=10)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(
            f"config section {prefix.rstrip('.') or '<root>'!r} must be a mapping, got {data!r}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {[prefix + k for k in unknown]}; valid keys in "
            f"{prefix.rstrip('.') or 'the root'}: {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, key)
    if origin is typing.Literal:  # membership is checked by validate, with every other problem
        return "off" if value is False and "off" in args else value  # YAML 1.1 reads a bare off as false
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping (for example {key}.endpoint_url=...)")
        return dict(value)
    if origin is list:
        items = value if isinstance(value, list) else [value]
        return [_coerce(args[0], v, key) for v in items]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key}={value!r} must be of type {hint.__name__}")
    return value


def validate(config: Config) -> None:
    """Check values that need no cluster or files: each section on its own, then what spans sections."""
    errors = _field_errors(config)
    errors += _train_errors(config.train) + _data_errors(config.data) + _rollout_errors(config.rollout)
    errors += _algo_errors(config.algo) + _critic_errors(config.critic) + _reward_errors(config.reward)
    errors += _placement_errors(config.placement) + _checkpoint_errors(config.checkpoint)
    errors += _cluster_errors(config.cluster) + _cross_section_errors(config) + _async_errors(config)
    errors += _output_errors(config.output)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def _failed(checks: list[tuple[bool, str]]) -> list[str]:
    """The messages of the checks that fail."""
    return [message for ok, message in checks if not ok]


def _field_errors(node: Any, prefix: str = "") -> list[str]:
    """What the field types say, over the whole tree: a mode outside its `Literal` (one source for each list of
    valid names), a float that is inf or nan (no key takes those: null turns options off)."""
    errors = []
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), prefix + f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            errors += _field_errors(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            errors.append(
                f"{key}={value} must be a finite number; give a real value (or null where the key allows it, "
                "to turn the option off)"
            )
        elif typing.get_origin(hints[f.name]) is typing.Literal and value not in typing.get_args(
            hints[f.name]
        ):
            errors.append(_unknown_choice(key, value, typing.get_args(hints[f.name])))
    return errors


def _unknown_choice(key: str, value: Any, choices: tuple) -> str:
    return f"{key}={value!r} is unknown; valid: {', '.join(repr(c) if c == '' else str(c) for c in sorted(choices))}"


def _train_errors(t: TrainConfig) -> list[str]:
    return _failed([
        (t.steps >= 1, f"train.steps={t.steps} must be >= 1"),
        (t.dp_size >= 1, f"train.dp_size={t.dp_size} must be >= 1 (the number of data-parallel groups)"),
        (t.tp_size >= 1, f"train.tp_size={t.tp_size} must be >= 1"),
        (t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size} must be >= 1"),
        (t.lr > 0, f"train.lr={t.lr} must be > 0"),
        (t.max_tokens_per_micro_batch is None or t.max_tokens_per_micro_batch >= 1,
         f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} must be >= 1 (or null)"),
    ])  # fmt: skip


def _data_errors(d: DataConfig) -> list[str]:
    low, high = d.min_pixels, d.max_pixels
    return _failed([
        (d.max_prompt_tokens >= 1, f"data.max_prompt_tokens={d.max_prompt_tokens} must be >= 1"),
        (low is None or low >= 28 * 28, f"data.min_pixels={low} must be >= 784 (one 28 x 28 px token), or null"),
        (high is None or high >= 28 * 28, f"data.max_pixels={high} must be >= 784 (one 28 x 28 px token), or null"),
        (low is None or high is None or low <= high,
         f"data.min_pixels={low} is above data.max_pixels={high}; swap them or raise max_pixels"),
        (d.max_images is None or d.max_images >= 1, f"data.max_images={d.max_images} must be >= 1, or null"),
        (d.max_rejected_in_a_row is None or d.max_rejected_in_a_row >= 0,
         f"data.max_rejected_in_a_row={d.max_rejected_in_a_row} must be >= 0 (rows rejected one after another "
         "before the run stops), or null: no bound"),
    ])  # fmt: skip


def _rollout_errors(r: RolloutConfig) -> list[str]:
    return _failed([
        (
            r.kv_cache_gb is None or r.kv_cache_gb > 0,
            f"rollout.kv_cache_gb={r.kv_cache_gb} must be > 0 (GiB), or null (sized by vLLM on GPUs)",
        ),
        (
            0 < r.gpu_memory_utilization <= 1,
            f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1]",
        ),
        (r.n >= 1, f"rollout.n={r.n} must be >= 1"),
        (r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1"),
        (r.temperature >= 0, f"rollout.temperature={r.temperature} must be >= 0"),
        (0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]"),
        (r.over_sample >= 1, f"rollout.over_sample={r.over_sample} must be >= 1 (1 = generate exactly the "
         "share; 1.25 starts 25% more prompts and aborts the slowest)"),
        (r.max_aborts is None or r.max_aborts >= 1,
         f"rollout.max_aborts={r.max_aborts} must be >= 1 (or null: never wait for an aborted prompt)"),
        (r.max_staleness >= 0, f"rollout.max_staleness={r.max_staleness} must be >= 0 (0 = synchronous)"),
        (r.weight_sync_bucket_mb > 0,
         f"rollout.weight_sync_bucket_mb={r.weight_sync_bucket_mb} must be > 0 (MiB a bucket of a weight push)"),
        (r.weight_timeout_s > 0,
         f"rollout.weight_timeout_s={r.weight_timeout_s} must be > 0 (seconds a request waits for missing weights)"),
    ])  # fmt: skip


def _async_errors(config: Config) -> list[str]:
    """Asynchronous rollout needs engines that are not inside the trainers, and no over-sampling (it answers the
    long tail by generating ahead)."""
    eta, r = config.rollout.max_staleness, config.rollout
    if eta == 0:
        return []
    return _failed([
        (config.placement.rollout_engines > 0,
         f"rollout.max_staleness={eta} generates while the trainer trains, which needs rollout engines of their "
         "own: set placement.mode=disaggregated and placement.rollout_engines >= 1 (or max_staleness=0)"),
        (r.over_sample == 1.0,
         f"rollout.max_staleness={eta} with rollout.over_sample={r.over_sample} is not supported: asynchronous "
         "rollout answers the long tail by generating ahead; set rollout.over_sample=1.0"),
    ])  # fmt: skip


def _algo_errors(a: AlgoConfig) -> list[str]:
    from yatt_ray.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
    from yatt_ray.algos.losses import check_clip

    errors = []
    try:
        check_clip(a.clip_low, a.clip_high, a.policy_loss)  # the losses' own domain: one source of the bounds
    except ValueError as exc:
        errors.append(f"algo.{exc} (policy_loss={a.policy_loss})")
    errors += _failed([
        (a.dual_clip is None or a.dual_clip > 1 + a.clip_high,
         f"algo.dual_clip={a.dual_clip} must exceed 1 + algo.clip_high = {1 + a.clip_high} (clip ranges out of "
         "order: the dual clip bounds the loss above the upper clip)"),
        (a.dual_clip is None or a.policy_loss == "ppo_clip",
         f"algo.dual_clip applies to algo.policy_loss=ppo_clip only, not {a.policy_loss!r}; unset it"),
        (a.kl_coef >= 0, f"algo.kl_coef={a.kl_coef} must be >= 0 (0 disables the KL term)"),
        (a.kl_target is None or a.kl_in_reward,
         "algo.kl_target (adaptive KL) acts on the KL reward penalty: set algo.kl_in_reward=true"),
        (a.kl_target is None or (a.kl_target > 0 and a.kl_horizon > 0),
         "algo.kl_target and algo.kl_horizon must be > 0"),
        (a.kl_target is None or a.kl_coef > 0,
         "algo.kl_target adapts algo.kl_coef from its initial value: set algo.kl_coef > 0"),
        (a.ppo_epochs >= 1, f"algo.ppo_epochs={a.ppo_epochs} must be >= 1"),
        (0 <= a.gamma <= 1 and 0 <= a.lam <= 1, f"algo.gamma={a.gamma} and algo.lam={a.lam} must be in [0, 1]"),
        (a.tis_cap is None or a.tis_cap >= 1, f"algo.tis_cap={a.tis_cap} must be >= 1 (or null to disable)"),
        (a.off_policy not in ("tis", "decoupled") or a.tis_cap is not None,
         f"algo.off_policy={a.off_policy} truncates its importance weight at algo.tis_cap, which is null; set "
         "algo.tis_cap (e.g. 2)"),
        (a.is_band_low < 1 < a.is_band_high and a.is_band_low >= 0,
         f"algo.is_band_low={a.is_band_low} and algo.is_band_high={a.is_band_high} must satisfy 0 <= low < 1 < high "
         "(the band of importance ratios mis / icepop keep; the usual is 0.5 and 2)"),
        (a.overlong_penalty >= 0, f"algo.overlong_penalty={a.overlong_penalty} must be >= 0 (DAPO uses 1)"),
        (a.max_draws >= 1, f"algo.max_draws={a.max_draws} must be >= 1 (draws of prompts per step with "
         "algo.dynamic_sampling)"),
    ])  # fmt: skip
    for key, value, registry in (
        ("algo.advantage", a.estimator, ADVANTAGE_ESTIMATORS),
        ("algo.policy_loss", a.policy_loss, POLICY_LOSSES),
        ("algo.kl_estimator", a.kl_estimator, KL_ESTIMATORS),
        ("algo.loss_agg", a.loss_agg, LOSS_AGGREGATIONS),
    ):
        if value not in registry:
            errors.append(f"{key}={value!r} is unknown; valid: {', '.join(sorted(registry.names()))}")
    return errors


def _critic_errors(c: CriticConfig) -> list[str]:
    return _failed([
        (c.warmup_steps == 0 or c.enable,
         f"critic.warmup_steps={c.warmup_steps} freezes the policy to train a critic, but critic.enable=false"),
        (c.lr > 0, f"critic.lr={c.lr} must be > 0"),
        (c.value_clip is None or c.value_clip > 0, f"critic.value_clip={c.value_clip} must be > 0 (or null)"),
    ])  # fmt: skip


def _reward_errors(rw: RewardConfig) -> list[str]:
    g = rw.genrm
    errors = _failed([
        (0 <= rw.genrm_weight <= 1, f"reward.genrm_weight={rw.genrm_weight} must be in [0, 1]"),
        (g.accelerators_per_replica == 1 or g.engine == "vllm",
         f"reward.genrm.accelerators_per_replica={g.accelerators_per_replica} spreads the judge with vLLM's "
         "tensor parallelism: set reward.genrm.engine=vllm"),
        (g.max_retries >= 0, f"reward.genrm.max_retries={g.max_retries} must be >= 0"),
        (g.max_replicas is None or g.max_replicas >= g.replicas,
         f"reward.genrm.max_replicas={g.max_replicas} must be >= reward.genrm.replicas={g.replicas} (or null)"),
    ])  # fmt: skip
    for key in ("max_new_tokens", "max_prompt_tokens", "replicas", "accelerators_per_replica", "batch_size"):
        if getattr(g, key) < 1:
            errors.append(f"reward.genrm.{key}={getattr(g, key)} must be >= 1")
    for key in ("timeout_s", "idle_release_s", "kv_cache_gb"):
        if not getattr(g, key) > 0:
            errors.append(f"reward.genrm.{key}={getattr(g, key)} must be > 0")
    return errors


def _placement_errors(p: PlacementConfig) -> list[str]:
    engines = p.rollout_engines
    return _failed([
        (0 < p.genrm_share < 1, f"placement.genrm_share={p.genrm_share} must be in (0, 1)"),
        (engines >= 0, f"placement.rollout_engines={engines} must be >= 0 (0: in-process engines)"),
        (p.cpus_per_engine >= 1, f"placement.cpus_per_engine={p.cpus_per_engine} must be >= 1"),
        (not engines or p.mode == "disaggregated",
         f"placement.rollout_engines={engines} puts the rollout engines on accelerators of their own, which "
         f"only placement.mode=disaggregated has (mode={p.mode!r} shares the training accelerators, where each "
         "controller's engine lives in its own process); set placement.mode=disaggregated or rollout_engines=0"),
    ])  # fmt: skip


def _cluster_errors(c: ClusterConfig) -> list[str]:
    return _failed([
        (c.cpus_per_worker is None or c.cpus_per_worker >= 1,
         f"cluster.cpus_per_worker={c.cpus_per_worker} must be >= 1 (or null: the node's CPUs shared among its "
         "workers)"),
        (c.timeout_s > 0, f"cluster.timeout_s={c.timeout_s} must be > 0"),
        (c.peak_flops is None or c.peak_flops > 0,
         f"cluster.peak_flops={c.peak_flops} must be > 0 (FLOP/s of one accelerator, e.g. 312e12) or null"),
    ])  # fmt: skip


RUN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")  # one folder name: no separator, not . or ..


def _output_errors(o: OutputConfig) -> list[str]:
    """The `output` section's problems, each naming the key, the value and the fix."""
    return _failed([
        (not o.name or bool(RUN_NAME.match(o.name)),
         f"output.name={o.name!r} must be one folder name (letters, digits, '.', '_', '-'; not starting with "
         "'.' or '-'), e.g. output.name=qwen7b-gsm8k; it names the run's folder inside output.dir"),
    ])  # fmt: skip


def _checkpoint_errors(c: CheckpointConfig) -> list[str]:
    """The `checkpoint` section's problems, each naming the key, the value and the fix."""
    return _failed([
        (c.every_steps is None or c.every_steps >= 1,
         f"checkpoint.every_steps={c.every_steps} must be >= 1 (or null to save by time only)"),
        (c.every_minutes is None or c.every_minutes > 0,
         f"checkpoint.every_minutes={c.every_minutes} must be > 0 (or null to save by steps only)"),
        (c.keep_last >= 1, f"checkpoint.keep_last={c.keep_last} must be >= 1 (the newest checkpoint is always kept)"),
        (c.keep_every is None or c.keep_every >= 1, f"checkpoint.keep_every={c.keep_every} must be >= 1 (or null)"),
        (c.export_hf_every is None or c.export_hf_every >= 1,
         f"checkpoint.export_hf_every={c.export_hf_every} must be >= 1 (or null)"),
        (c.max_failures >= -1, f"checkpoint.max_failures={c.max_failures} must be >= 0 (or -1: retry without limit)"),
        (bool(c.resume), "checkpoint.resume is empty; use auto, never, or a checkpoint folder / URL"),
    ]) + ([] if c.enable else _disabled_checkpoint_errors(c))  # fmt: skip


def _disabled_checkpoint_errors(c: CheckpointConfig) -> list[str]:
    """With `checkpoint.enable=false` nothing is written under `checkpoint.dir` and nothing is read from it: the
    keys that would do either are contradictions, named with the fix."""
    return _failed([
        (c.resume in ("auto", "never"),
         f"checkpoint.resume={c.resume!r} starts from a checkpoint, but checkpoint.enable=false turns checkpoints "
         "off; set checkpoint.enable=true (or checkpoint.resume=auto)"),
        (c.export_hf_every is None and not c.export_hf_steps,
         "checkpoint.export_hf_every / export_hf_steps write Hugging Face exports under checkpoint.dir, but "
         "checkpoint.enable=false; unset them or set checkpoint.enable=true"),
        (not c.log_prompt_ids,
         "checkpoint.log_prompt_ids writes under checkpoint.dir, but checkpoint.enable=false; unset it or set "
         "checkpoint.enable=true"),
    ])  # fmt: skip


def _cross_section_errors(config: Config) -> list[str]:
    """What spans sections: sizes that must divide, an estimator's needs, steps named elsewhere, the functions
    named by path (reward function, GenRM template and parser)."""
    from yatt_ray.algos import ADVANTAGE_ESTIMATORS
    from yatt_ray.reward import resolve_reward_fn
    from yatt_ray.reward.genrm import resolve_parser, resolve_template

    t, r, a, c = config.train, config.rollout, config.algo, config.critic
    rows = t.prompts_per_step // max(t.dp_size, 1) * r.n
    bad_exports = [s for s in config.checkpoint.export_hf_steps if not 1 <= s <= t.steps]
    errors = _failed([
        (t.dp_size < 1 or (t.prompts_per_step >= t.dp_size and t.prompts_per_step % t.dp_size == 0),
         f"train.prompts_per_step={t.prompts_per_step} must be a positive multiple of train.dp_size={t.dp_size} "
         "(each data-parallel group takes the same number of prompts)"),
        (not (r.engine == "vllm" and t.tp_size > 1),
         f"rollout.engine='vllm' with train.tp_size={t.tp_size}: the colocated vLLM engine needs tp_size=1 for "
         "now (vLLM creates its process groups over all training ranks); use rollout.engine=auto (Hugging Face "
         "generate on the controller) or train.tp_size=1"),
        (1 <= a.ppo_mini_batches <= rows,
         f"algo.ppo_mini_batches={a.ppo_mini_batches} must be in [1, {rows}] (the samples of one group's step)"),
        (0 <= c.warmup_steps < t.steps,
         f"critic.warmup_steps={c.warmup_steps} must be in [0, train.steps={t.steps}): lower "
         "critic.warmup_steps or raise train.steps"),
        (a.dynamic_sampling == "off" or r.n >= 2,
         f"algo.dynamic_sampling={a.dynamic_sampling!r} filters groups whose samples all score the same, which "
         f"every group of rollout.n={r.n} does; set rollout.n >= 2 or algo.dynamic_sampling=off"),
        (not bad_exports, f"checkpoint.export_hf_steps={bad_exports} must be steps in [1, train.steps={t.steps}]"),
        (0 <= a.overlong_buffer < r.max_new_tokens,
         f"algo.overlong_buffer={a.overlong_buffer} must be in [0, rollout.max_new_tokens={r.max_new_tokens}): the "
         "penalty ramps over the last overlong_buffer tokens before the limit (0 turns it off)"),
    ])  # fmt: skip
    if a.estimator in ADVANTAGE_ESTIMATORS:
        estimator = ADVANTAGE_ESTIMATORS.get(a.estimator)
        errors += _failed([
            (not estimator.needs_critic or c.enable,
             f"algo.advantage={a.estimator!r} needs a value model; set critic.enable=true (PPO) or pick an "
             "estimator without a critic (grpo, rloo, reinforce_pp, remax)"),
            (not estimator.needs_group or r.n >= 2,
             f"rollout.n={r.n}: {a.estimator} compares samples within a prompt's group; set rollout.n >= 2"),
            (not c.enable or estimator.needs_critic,
             f"critic.enable=true but algo.advantage={a.estimator!r} uses no value model; use algo.name=ppo "
             "(GAE) or set critic.enable=false"),
        ])  # fmt: skip
    checks: list[Callable[[], object]] = [lambda: resolve_reward_fn(config.reward.function)]
    if config.reward.mode != "rule":
        g = config.reward.genrm
        checks += [lambda: resolve_template(g.template), lambda: resolve_parser(g.parser)]
    for check in checks:
        try:
            check()
        except ConfigError as exc:
            errors.append(str(exc))
    return errors


if __name__ == "__main__":  # python -m yatt_ray.config --reference: the Markdown of docs/configuration.md
    import sys

    from yatt_ray.config_reference import main

    sys.exit(main(sys.argv[1:]))
