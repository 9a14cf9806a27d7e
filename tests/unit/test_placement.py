"""The placement plans (full, partial, disaggregated) and their resource checks (no cluster: resources are
given; GPUs as Ray counts them, so fake GPU resources test the placement logic on CPU)."""

import pytest

from yatt_ray import PlacementError, load_config
from yatt_ray.placement import plan_placement


def cfg(*over):
    return load_config(None, list(over))


def test_cpu_plan_counts_workers_and_data_cpu():
    plan = plan_placement(cfg("train.dp_size=2", "train.tp_size=2", "train.prompts_per_step=4"), {"CPU": 5.0})
    assert (plan.num_workers, plan.gpus_per_worker, plan.mode) == (4, 0, "full")
    assert "dp 2 x tp 2" in plan.describe()


def test_gpus_are_used_when_the_cluster_has_them():
    plan = plan_placement(cfg("train.dp_size=4", "train.prompts_per_step=8"), {"CPU": 64.0, "GPU": 8.0})
    assert plan.gpus_per_worker == 1


def test_too_many_workers_for_the_cpus():
    with pytest.raises(PlacementError, match=r"needs 9 CPUs .* cluster has 8\. Lower train.dp_size"):
        plan_placement(cfg("train.dp_size=8", "train.prompts_per_step=8"), {"CPU": 8.0})


def test_unresolved_cpus_per_worker_shares_the_clusters_cpus():
    # 9 CPUs less 1 for the data tasks, over 2 workers: 4 each (the driver resolves it from the nodes first)
    plan = plan_placement(cfg("train.dp_size=2", "train.prompts_per_step=4"), {"CPU": 9.0})
    assert plan.cpus_per_worker == 4 and plan.trainer_resources() == {"CPU": 4.0}
    assert "each worker: 4 CPU" in plan.describe()
    set_explicitly = plan_placement(
        cfg("cluster.cpus_per_worker=2", "train.prompts_per_step=4"), {"CPU": 9.0}
    )
    assert set_explicitly.cpus_per_worker == 2


def test_the_plan_lists_the_models_each_worker_builds():
    with_kl = plan_placement(cfg("algo.kl_coef=0.01"), {"CPU": 4.0}).describe()
    assert "policy + reference + optimizer" in with_kl
    without = plan_placement(cfg("algo.kl_coef=0"), {"CPU": 4.0}).describe()
    assert "policy + optimizer" in without and "reference" not in without
    ppo = cfg("algo.name=ppo", "critic.enable=true", "algo.kl_coef=0")
    assert "policy + critic + optimizer" in plan_placement(ppo, {"CPU": 4.0}).describe()


def test_too_many_workers_for_the_gpus():
    config = cfg("train.dp_size=4", "train.tp_size=4", "train.prompts_per_step=8", "cluster.use_gpu=true")
    with pytest.raises(PlacementError, match="needs 16 GPUs .* has 8"):
        plan_placement(config, {"CPU": 128.0, "GPU": 8.0})


GENRM = ("reward.mode=genrm", "train.dp_size=2", "train.prompts_per_step=4", "cluster.cpus_per_worker=1")


def test_full_coexistence_puts_one_judge_beside_each_trainer():
    plan = plan_placement(cfg(*GENRM, "placement.genrm_share=0.2"), {"CPU": 16.0, "GPU": 2.0})
    assert plan.trainer_resources() == {"CPU": 1.0, "GPU": 0.8}
    assert plan.genrm is not None and (plan.genrm.replicas, plan.genrm.max_replicas) == (2, 2)
    assert plan.genrm.bundles() == [{"CPU": 1.0, "GPU": 0.2}] and plan.genrm.release_when_idle
    assert plan.accelerators_needed() == 2
    assert "2 Serve replica(s) sharing the training accelerators" in plan.describe()


def test_disaggregated_gives_the_judge_its_own_slice():
    config = cfg(
        *GENRM, "placement.mode=disaggregated", "reward.genrm.replicas=2", "reward.genrm.max_replicas=3"
    )
    plan = plan_placement(config, {"CPU": 16.0, "GPU": 5.0})
    assert plan.trainer_resources() == {"CPU": 1.0, "GPU": 1.0}
    assert plan.genrm is not None and (plan.genrm.replicas, plan.genrm.max_replicas) == (2, 3)
    assert plan.genrm.bundles() == [{"CPU": 1.0, "GPU": 1.0}] and not plan.genrm.release_when_idle
    assert plan.accelerators_needed() == 5 and "2..3 Serve replica(s) on their own slice" in plan.describe()
    assert "train: trainers on 2 training accelerator(s) (3 GenRM accelerator(s) idle)" in plan.describe()


def test_partial_coexistence_shares_every_accelerator_and_follows_the_judging_load():
    """The seed's partial coexistence: no accelerator of its own for the judge; replicas beside the trainers,
    1 at start, up to one per training accelerator as the judging load asks; released for training."""
    config = cfg(*GENRM, "placement.mode=partial", "placement.genrm_share=0.25")
    plan = plan_placement(config, {"CPU": 16.0, "GPU": 2.0})
    assert plan.trainer_resources() == {"CPU": 1.0, "GPU": 0.75} and plan.accelerators_needed() == 2
    assert plan.genrm is not None and (plan.genrm.replicas, plan.genrm.max_replicas) == (1, 2)
    assert plan.genrm.bundles() == [{"CPU": 1.0, "GPU": 0.25}] and plan.genrm.release_when_idle
    text = plan.describe()
    assert "1..2 Serve replica(s) sharing the training accelerators" in text
    assert "rollout + reward: engines and GenRM replicas together on 2 training accelerator(s)" in text
    full = plan_placement(cfg(*GENRM), {"CPU": 16.0, "GPU": 2.0}).describe()
    assert "(phases in series)" in full


def test_partial_coexistence_refuses_a_config_sized_for_a_judge_slice():
    """A config written when `partial` meant a GenRM slice of its own (sized by max_replicas, or more replicas
    than training accelerators): refused before any work, naming the mode to choose."""
    for over in ("reward.genrm.max_replicas=3", "reward.genrm.replicas=3"):
        with pytest.raises(PlacementError, match=r"meant before\), choose placement.mode=disaggregated"):
            plan_placement(cfg(*GENRM, "placement.mode=partial", over), {"CPU": 16.0, "GPU": 5.0})
    ok = plan_placement(
        cfg(*GENRM, "placement.mode=partial", "reward.genrm.replicas=2"), {"CPU": 16.0, "GPU": 4.0}
    )
    assert ok.genrm is not None and (ok.genrm.replicas, ok.genrm.max_replicas) == (2, 2)


def test_disaggregated_without_room_for_the_judge():
    config = cfg(
        *GENRM,
        "placement.mode=disaggregated",
        "reward.genrm.accelerators_per_replica=2",
        "reward.genrm.engine=vllm",
    )
    with pytest.raises(
        PlacementError, match=r"disaggregated placement needs 4 GPUs: .* 1 x 2, but the cluster has 3"
    ):
        plan_placement(config, {"CPU": 16.0, "GPU": 3.0})


def test_disaggregated_rollout_engines_get_accelerators_of_their_own():
    """Engine actors: one accelerator each beside the trainers' (and the judges' slice when there is one);
    the plan says which engines the controllers use; too few GPUs is refused with the numbers."""
    engines = (
        "placement.mode=disaggregated",
        "placement.rollout_engines=3",
        "train.dp_size=2",
        "cluster.cpus_per_worker=1",
    )
    plan = plan_placement(cfg(*engines, "train.prompts_per_step=4"), {"CPU": 16.0, "GPU": 5.0})
    assert plan.engines is not None and plan.engines.resources() == {"CPU": 1.0, "GPU": 1.0}
    assert plan.accelerators_needed() == 5 and plan.cpus_needed() == 2 + 3 + 1
    text = plan.describe()
    assert "reaching 3 rollout engine actor(s) on 3 accelerator(s) of their own through one router" in text
    assert "rollout: engines on 3 engine accelerator(s); train: trainers on 2 training accelerator(s)" in text
    with pytest.raises(
        PlacementError, match=r"needs 6 GPUs: .*rollout_engines = 3 and the GenRM slice 1 x 1"
    ):
        plan_placement(cfg(*engines, *GENRM[:1], "train.prompts_per_step=4"), {"CPU": 16.0, "GPU": 5.0})
    cpu = plan_placement(
        cfg(*engines, "train.prompts_per_step=4", "placement.cpus_per_engine=2"), {"CPU": 16.0}
    )
    assert (
        cpu.engines is not None and cpu.engines.resources() == {"CPU": 2.0} and cpu.cpus_needed() == 2 + 6 + 1
    )
    colocated = plan_placement(cfg(*GENRM), {"CPU": 16.0, "GPU": 2.0})
    assert colocated.engines is None and "rollout engine in its own process" in colocated.describe()


def test_rollout_engines_outside_disaggregated_are_refused():
    from yatt_ray import ConfigError

    for mode in ("full", "partial"):
        with pytest.raises(ConfigError, match=f"only placement.mode=disaggregated has \\(mode='{mode}'"):
            cfg(f"placement.mode={mode}", "placement.rollout_engines=1")


def test_partial_coexistence_needs_a_judge():
    with pytest.raises(PlacementError, match="reward.mode='rule' uses no GenRM; set reward.mode=genrm"):
        plan_placement(cfg("placement.mode=partial"), {"CPU": 16.0, "GPU": 3.0})


def test_judge_accelerators_must_divide_the_training_accelerators():
    config = cfg(
        "reward.mode=genrm",
        "train.dp_size=3",
        "train.prompts_per_step=3",
        "reward.genrm.accelerators_per_replica=2",
        "reward.genrm.engine=vllm",
    )
    with pytest.raises(PlacementError, match="accelerators_per_replica=2 does not divide"):
        plan_placement(config, {"CPU": 16.0, "GPU": 3.0})


def test_memory_check_names_the_phase_and_the_fix():
    from yatt_ray.placement import ModelSizes, memory_estimate_gb

    sizes = ModelSizes(policy=7_000_000_000, judge=7_000_000_000)
    config = cfg(*GENRM, "placement.gpu_memory_gb=80")
    with pytest.raises(
        PlacementError, match=r"needs about 1.*GiB per accelerator for the largest phase \(trainer\)"
    ):
        plan_placement(config, {"CPU": 16.0, "GPU": 2.0}, sizes)
    plan = plan_placement(cfg(*GENRM, "train.tp_size=8", "train.prompts_per_step=4", "placement.gpu_memory_gb=80"),
                          {"CPU": 64.0, "GPU": 16.0}, sizes)  # fmt: skip
    est = memory_estimate_gb(plan, config, sizes)
    # fp32 (the default): trainer 16 + reference 4 bytes per parameter, over tp 8
    assert est["trainer"] == pytest.approx(20 * 7e9 / 8 / 2**30) and est["genrm"] == pytest.approx(
        28e9 / 2**30 + 0.5  # the judge in fp32 (reward.genrm.dtype's default)
    )
    bf16_judge = cfg(*GENRM, "placement.gpu_memory_gb=80", "reward.genrm.dtype=bf16")
    assert memory_estimate_gb(plan, bf16_judge, sizes)["genrm"] == pytest.approx(14e9 / 2**30 + 0.5)


def test_param_count_of_the_tiny_model(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from yatt_ray.models.tiny import build_tiny_model
    from yatt_ray.placement import param_count

    build_tiny_model(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert param_count(str(tmp_path)) == sum(p.numel() for p in model.parameters())


def test_judge_replicas_follow_the_load_between_replicas_and_max_replicas():
    from yatt_ray.reward.service import deployment_options

    config = cfg(
        *GENRM,
        "placement.mode=disaggregated",
        "reward.genrm.max_replicas=4",
        "reward.genrm.accelerators_per_replica=2",
        "reward.genrm.engine=vllm",
    )
    plan = plan_placement(config, {"CPU": 16.0, "GPU": 10.0})
    options = deployment_options(plan.genrm, config.reward.genrm)
    assert (
        options["autoscaling_config"]["min_replicas"] == 1
        and options["autoscaling_config"]["max_replicas"] == 4
    )
    assert options["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 0.01, "GPU": 1.0}]
    assert options["placement_group_strategy"] == "STRICT_PACK" and "num_replicas" not in options
    fixed = deployment_options(
        plan_placement(cfg(*GENRM), {"CPU": 16.0, "GPU": 2.0}).genrm, config.reward.genrm
    )
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed


@pytest.mark.parametrize(
    ("dtype", "distributed", "dp", "expected"),
    [
        ("fp32", False, 1, 16),  # weights 4 + grads 4 + Adam 8
        ("fp32", False, 8, 16),  # dp_size alone shards nothing
        ("bf16", False, 4, 18),  # weights 2 + grads 4 + main weights 4 + Adam 8
        ("bf16", True, 4, 9.0),  # 2 + 4 + 12 / 4
        ("fp32", True, 2, 12),  # 4 + 4 + 8 / 2
        ("bf16", True, 1, 18),  # one rank: nothing to shard over
    ],
)
def test_trainer_bytes_per_param(dtype, distributed, dp, expected):
    from yatt_ray.placement import trainer_bytes_per_param

    assert trainer_bytes_per_param(dtype, distributed, dp) == pytest.approx(expected)


MEM = (
    "cluster.use_gpu=true",
    "cluster.cpus_per_worker=1",
    "train.prompts_per_step=8",
    "rollout.kv_cache_gb=1",
)


def mem_cfg(dtype="fp32", distributed=False, *over):
    return cfg(*MEM, f"train.dtype={dtype}", f"train.distributed_optimizer={str(distributed).lower()}", *over)


@pytest.mark.parametrize(
    ("dtype", "distributed", "per_param"),
    [("fp32", False, 16), ("fp32", True, 8 + 8 / 4), ("bf16", False, 18), ("bf16", True, 6 + 12 / 4)],
)
def test_trainer_estimate_follows_dtype_and_distributed_optimizer(dtype, distributed, per_param):
    from yatt_ray.placement import ModelSizes, memory_estimate_gb

    config = mem_cfg(dtype, distributed, "train.dp_size=4", "train.tp_size=2", "algo.kl_coef=0")
    plan = plan_placement(config, {"CPU": 64.0, "GPU": 8.0})
    p, critic, tp = 3_000_000_000, 1_000_000_000, 2
    est = memory_estimate_gb(plan, config, ModelSizes(policy=p))
    assert est["trainer"] == pytest.approx(per_param * p / tp / 2**30)
    # a critic costs the same bytes per parameter; a reference model (kl_coef > 0) its weights only
    with_critic = memory_estimate_gb(plan, config, ModelSizes(policy=p, critic=critic))
    assert with_critic["trainer"] == pytest.approx(per_param * (p + critic) / tp / 2**30)
    with_kl = mem_cfg(dtype, distributed, "train.dp_size=4", "train.tp_size=2", "algo.kl_coef=0.01")
    weights = 2 if dtype == "bf16" else 4
    with_ref = memory_estimate_gb(plan, with_kl, ModelSizes(policy=p))
    assert with_ref["trainer"] == pytest.approx((per_param + weights) * p / tp / 2**30)


def test_rollout_weights_halve_in_bf16():
    from yatt_ray.placement import ModelSizes, memory_estimate_gb

    sizes, fp32, bf16 = ModelSizes(policy=7_000_000_000), mem_cfg("fp32"), mem_cfg("bf16")
    plan = plan_placement(fp32, {"CPU": 16.0, "GPU": 1.0})
    kv = 1  # rollout.kv_cache_gb
    fp32_weights = memory_estimate_gb(plan, fp32, sizes)["rollout"] - kv
    bf16_weights = memory_estimate_gb(plan, bf16, sizes)["rollout"] - kv
    assert fp32_weights == pytest.approx(4 * 7e9 / 2**30) and bf16_weights == pytest.approx(fp32_weights / 2)


# 7e9 parameters on 80 GiB accelerators, dp 8, with the reference model (default kl_coef > 0), per parameter:
# fp32 16 + 4 = 20 bytes (130 GiB), fp32 + ZeRO 9 + 4 = 13 (85 GiB), bf16 18 + 2 = 20 (130 GiB),
# bf16 + ZeRO 7.5 + 2 = 9.5 (62 GiB): only the last fits
FIT = ("train.dp_size=8", "placement.gpu_memory_gb=80")


@pytest.mark.parametrize(("dtype", "distributed"), [("fp32", False), ("fp32", True), ("bf16", False)])
def test_a_7b_trainer_does_not_fit_80_gib_without_both(dtype, distributed):
    from yatt_ray.placement import ModelSizes

    with pytest.raises(PlacementError, match=r"largest phase \(trainer\).*train.distributed_optimizer=true"):
        plan_placement(
            mem_cfg(dtype, distributed, *FIT), {"CPU": 64.0, "GPU": 8.0}, ModelSizes(7_000_000_000)
        )


def test_bf16_with_a_distributed_optimizer_fits_where_fp32_does_not():
    from yatt_ray.placement import ModelSizes, check_memory, memory_estimate_gb

    sizes, cluster = ModelSizes(policy=7_000_000_000), {"CPU": 64.0, "GPU": 8.0}
    fp32, zero = mem_cfg("fp32", False, *FIT), mem_cfg("bf16", True, *FIT)
    plan = plan_placement(zero, cluster, sizes)  # the memory check passes
    assert memory_estimate_gb(plan, zero, sizes)["trainer"] == pytest.approx(9.5 * 7e9 / 2**30)
    with pytest.raises(PlacementError, match=r"needs about 130\.4 GiB"):
        check_memory(plan, fp32, sizes, 80)
