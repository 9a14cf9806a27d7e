"""Config loading, overrides and validation errors (no cluster)."""

from pathlib import Path

import pytest

from yatt_ray import ConfigError, load_config
from yatt_ray.config import Config

EXAMPLE = "examples/configs/grpo.yaml"


def test_yaml_and_overrides_are_typed():
    cfg = load_config(
        EXAMPLE,
        ["train.steps=3", "algo.kl_coef=0", "train.lr=1e-4", "data.train_files=[a.parquet, b.parquet]"],
    )
    assert cfg.train.steps == 3
    assert cfg.algo.kl_coef == 0.0 and isinstance(cfg.algo.kl_coef, float)
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.train.lr == 1e-4
    assert cfg.rollout.n == 8  # from the YAML, not the dataclass default
    assert cfg.cluster.address is None


def test_round_trip_through_dict():
    cfg = load_config(EXAMPLE, ["train.lr=0.01"])
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("algo.kl_estimator=k9", "algo.kl_estimator='k9' is unknown; valid: k1, k2, k3"),
        ("algo.advantage=gea", "algo.advantage='gea' is unknown; valid: gae, grpo"),
        ("algo.name=dpo", "algo.name='dpo' is unknown; valid: grpo, ppo, reinforce_pp, remax, rloo"),
        ("algo.name=ppo", "algo.advantage='gae' needs a value model; set critic.enable=true"),
        ("algo.name=rloo rollout.n=1", "rollout.n=1: rloo compares samples within a prompt's group"),
        ("algo.dual_clip=1.1", "algo.dual_clip=1.1 must exceed 1 + algo.clip_high = 1.2"),
        ("algo.kl_target=0.1", "adaptive KL) acts on the KL reward penalty: set algo.kl_in_reward=true"),
        (
            "algo.policy_loss=gspo algo.dual_clip=3",
            "algo.dual_clip applies to algo.policy_loss=ppo_clip only",
        ),
        ("algo.clip_low=1", "algo.clip_low must be in [0, 1) (1, no lower bound, suits cispo only), got 1.0"),
        ("critic.enable=true", "critic.enable=true but algo.advantage='grpo' uses no value model"),
        ("critic.warmup_steps=3", "critic.warmup_steps=3 freezes the policy to train a critic"),
        ("algo.ppo_mini_batches=1000", "algo.ppo_mini_batches=1000 must be in [1, 128]"),
        ("rollout.n=1", "set rollout.n >= 2"),
        ("train.prompts_per_step=15", "multiple of train.dp_size=2"),
        ("algo.kl_coef=-0.1", "algo.kl_coef=-0.1 must be >= 0"),
        ("train.steps=two", "train.steps='two' must be of type int"),
        ("train.stepz=3", "unknown config key(s) ['train.stepz']"),
        ("reward.function=no_such_module:fn", "reward.function='no_such_module:fn' cannot be imported"),
        ("steps", "is not of the form key.sub=value"),
        ("train.lr=fast", "train.lr='fast' must be of type float"),
        ("rollout.engine=vllm train.tp_size=2", "the colocated vLLM engine needs tp_size=1"),
        ("cluster.cpus_per_worker=0", "cluster.cpus_per_worker=0 must be >= 1 (or null"),
        ("cluster.peak_flops=0", "cluster.peak_flops=0.0 must be > 0"),
        (
            "checkpoint.enable=false checkpoint.resume=/ckpt",
            "checkpoint.resume='/ckpt' starts from a checkpoint",
        ),
        ("checkpoint.enable=false checkpoint.export_hf_every=5", "unset them or set checkpoint.enable=true"),
        ("checkpoint.enable=false checkpoint.log_prompt_ids=true", "checkpoint.log_prompt_ids writes under"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, override.split(" "))
    assert fragment in str(info.value)


def test_all_errors_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.steps=0", "train.lr=-1"])
    assert "train.steps=0" in str(info.value) and "train.lr=-1" in str(info.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope.yaml")


def test_user_reward_function_by_dotted_path():
    cfg = load_config(None, ["reward.function=yatt_ray.reward.rules:exact_match"])
    assert cfg.reward.function.endswith("exact_match")


def test_fit_resolves_a_copy_and_leaves_the_callers_config_alone():
    from yatt_ray.fit import _resolve_config

    mine = load_config(EXAMPLE)
    resolved = _resolve_config(mine, ["train.steps=3"])
    resolved.model.path = "/somewhere"
    assert resolved.train.steps == 3 and mine.train.steps == 80 and mine.model.path == ""


def test_zero_data_parallel_groups_is_a_config_error_not_a_division():
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, ["train.dp_size=0"])
    assert "train.dp_size=0 must be >= 1" in str(info.value)


def test_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: 3\n lr: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert f"config file {str(path)!r} is not valid YAML" in message
    assert "at line 3, column 2" in message and "expected <block end>" in message


def test_yaml_syntax_error_in_an_override():
    with pytest.raises(ConfigError, match=r"override 'data.train_files=\[a' is not valid YAML: .* line 1"):
        load_config(EXAMPLE, ["data.train_files=[a"])


@pytest.mark.parametrize(
    ("override", "shown"),
    [
        ("algo.kl_coef=.inf", "algo.kl_coef=inf"),
        ("algo.kl_coef=nan", "algo.kl_coef=nan"),
        ("algo.kl_coef=.nan", "algo.kl_coef=nan"),
        ("train.lr=-.inf", "train.lr=-inf"),
        ("reward.genrm.timeout_s=.inf", "reward.genrm.timeout_s=inf"),
        ("algo.tis_cap=.inf", "algo.tis_cap=inf"),  # optional floats too
    ],
)
def test_non_finite_floats_are_rejected(override, shown):
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, [override])
    assert f"{shown} must be a finite number" in str(info.value)


@pytest.mark.parametrize(
    ("template", "fragment"),
    [
        ("Grade {prompt} against {ground_truth}", "has no {response} field, so the judge would never see"),
        ("Grade the answer", "is neither a template string (it has none of the fields"),
        ("Grade {response", "is not a valid template"),
    ],
)
def test_genrm_template_errors_name_the_key(template, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["reward.mode=genrm", f"reward.genrm.template={template}"])
    message = str(info.value)
    assert f"reward.genrm.template={template!r}" in message and fragment in message
    assert "cannot be imported" not in message


def test_eval_files_default_is_unset_and_an_empty_list_is_kept():
    assert load_config(None).data.eval_files is None
    assert load_config(EXAMPLE, ["data.eval_files=[]"]).data.eval_files == []


def test_modes_are_checked_from_their_literal_types_also_when_set_in_code():
    """One source of valid names: the field's Literal type (set in code after loading, not only from YAML)."""
    from yatt_ray.config import Config, validate

    config = Config()
    config.placement.mode = "half"  # type: ignore[assignment]
    config.rollout.engine = "sglang"  # type: ignore[assignment]
    with pytest.raises(ConfigError) as info:
        validate(config)
    assert "placement.mode='half' is unknown; valid: disaggregated, full, partial" in str(info.value)
    assert "rollout.engine='sglang' is unknown; valid: auto, hf, vllm" in str(info.value)


def test_a_frozen_config_refuses_changes_and_survives_pickling():
    import pickle

    from yatt_ray.config import Config

    config = Config().freeze()
    with pytest.raises(ConfigError, match="the config is frozen.*RolloutConfig.engine cannot change now"):
        config.rollout.engine = "hf"
    genrm = pickle.loads(pickle.dumps(config.reward.genrm))  # what a GenRM replica receives
    with pytest.raises(ConfigError, match="GenRMConfig.path"):
        genrm.path = "/elsewhere"
    thawed = Config.from_dict(config.to_dict())  # a copy is mutable again (fit() resolves its own copy)
    thawed.rollout.engine = "hf"
    assert thawed.rollout.engine == "hf" and config.rollout.engine == "auto"


def test_new_keys_and_their_defaults():
    config = load_config(None, [])
    assert config.cluster.cpus_per_worker is None and config.cluster.peak_flops is None
    assert config.checkpoint.enable and not config.rollout.ignore_eos and not config.output.verbose
    set_ = load_config(None, ["cluster.cpus_per_worker=2", "cluster.peak_flops=312e12", "checkpoint.enable=false",
                              "rollout.ignore_eos=true", "output.verbose=true"])  # fmt: skip
    assert (set_.cluster.cpus_per_worker, set_.cluster.peak_flops) == (2, 312e12)
    assert not set_.checkpoint.enable and set_.rollout.ignore_eos and set_.output.verbose


def test_long_tail_keys_validate_and_a_bare_off_reads_as_off():
    config = load_config(None, ["train.balance=off", "algo.dynamic_sampling=off", "rollout.over_sample=1.5"])
    assert (config.train.balance, config.algo.dynamic_sampling, config.rollout.over_sample) == (
        "off",
        "off",
        1.5,
    )
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.over_sample=0.9", "algo.max_draws=0", "train.balance=fast"])
    message = str(err.value)
    assert "rollout.over_sample=0.9 must be >= 1" in message and "algo.max_draws=0 must be >= 1" in message
    assert "train.balance='fast' is unknown; valid: flops, off, tokens" in message
    with pytest.raises(ConfigError, match="rollout.n >= 2 or algo.dynamic_sampling=off"):
        load_config(None, ["algo.dynamic_sampling=reward", "rollout.n=1", "algo.name=reinforce_pp"])


@pytest.mark.parametrize("name", sorted(p.name for p in Path("examples/configs").glob("*.yaml")))
def test_every_example_config_loads_and_validates(name):
    cfg = load_config(Path("examples/configs") / name)
    assert cfg.train.steps >= 1 and cfg.rollout.n >= 1


def test_the_gsm8k_recipe_reads_verl_files_as_they_are():
    cfg = load_config("examples/configs/grpo_qwen_gsm8k.yaml")
    assert (cfg.data.answer_key, cfg.data.id_key, cfg.reward.function) == (
        "reward_model.ground_truth", "extra_info.index", "math")  # fmt: skip
    assert (cfg.train.dtype, cfg.train.distributed_optimizer) == ("bf16", True)


def test_the_geo3k_recipe_reads_verl_files_as_they_are():
    cfg = load_config("examples/configs/grpo_qwen_vl_geo3k.yaml")
    assert (cfg.data.answer_key, cfg.data.id_key, cfg.data.image_key, cfg.reward.function) == (
        "reward_model.ground_truth", "extra_info.index", "images", "math")  # fmt: skip
    assert (
        cfg.data.max_pixels // 784 + 64 <= cfg.data.max_prompt_tokens
    )  # an image's tokens fit beside the text
    assert (
        cfg.train.dp_size * cfg.train.tp_size == 8 and cfg.algo.name == "grpo" and cfg.critic.enable is False
    )


def test_image_limits_are_checked():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.min_pixels=1000000", "data.max_pixels=3136", "data.max_images=0"])
    message = str(err.value)
    assert "data.min_pixels=1000000 is above data.max_pixels=3136" in message
    assert "data.max_images=0 must be >= 1" in message
    with pytest.raises(ConfigError, match="data.max_pixels=100 must be >= 784"):
        load_config(None, ["data.max_pixels=100"])


def test_off_policy_and_overlong_keys_default_off_and_validate():
    config = load_config(None, [])
    assert (config.algo.off_policy, config.algo.is_band_low, config.algo.is_band_high) == ("none", 0.5, 2.0)
    assert (config.algo.overlong_buffer, config.algo.overlong_penalty) == (0, 1.0)
    set_ = load_config(None, ["algo.off_policy=icepop", "algo.is_band_low=0.25", "algo.is_band_high=4",
                              "rollout.max_new_tokens=16", "algo.overlong_buffer=4", "algo.overlong_penalty=0.5"])  # fmt: skip
    assert (set_.algo.off_policy, set_.algo.is_band_low, set_.algo.is_band_high) == ("icepop", 0.25, 4.0)
    assert (set_.algo.overlong_buffer, set_.algo.overlong_penalty) == (4, 0.5)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algo.off_policy=pop", "algo.is_band_high=1", "rollout.max_new_tokens=8",
                           "algo.overlong_buffer=8", "algo.overlong_penalty=-1"])  # fmt: skip
    message = str(err.value)
    assert "algo.off_policy='pop' is unknown; valid: decoupled, icepop, mis, none, tis" in message
    assert "algo.is_band_low=0.5 and algo.is_band_high=1.0 must satisfy 0 <= low < 1 < high" in message
    assert "algo.overlong_buffer=8 must be in [0, rollout.max_new_tokens=8)" in message
    assert "algo.overlong_penalty=-1.0 must be >= 0" in message
    with pytest.raises(ConfigError, match="algo.overlong_buffer=-1 must be in"):
        load_config(None, ["algo.overlong_buffer=-1"])
    for mode in ("tis", "decoupled"):
        with pytest.raises(
            ConfigError, match=f"algo.off_policy={mode} truncates its importance weight at algo.tis_cap"
        ):
            load_config(None, [f"algo.off_policy={mode}", "algo.tis_cap=null"])
    mis = load_config(
        None, ["algo.off_policy=mis", "algo.tis_cap=null"]
    )  # the band bounds mis: no cap needed
    assert mis.algo.tis_cap is None


def test_asynchronous_rollout_is_refused_where_it_cannot_work():
    """rollout.max_staleness > 0 needs engine actors and no over-sampling: each refusal names the key
    to change; with engine actors and the defaults it loads."""
    engines = ["placement.mode=disaggregated", "placement.rollout_engines=1"]
    with pytest.raises(
        ConfigError, match=r"max_staleness=2 generates while the trainer trains.*rollout_engines >= 1"
    ):
        load_config(None, ["rollout.max_staleness=2"])
    dapo = load_config(None, [*engines, "rollout.max_staleness=1", "algo.dynamic_sampling=reward"])
    assert dapo.algo.dynamic_sampling == "reward"  # the filter applies to the groups generated ahead
    with pytest.raises(ConfigError, match=r"rollout.over_sample=1.5 is not supported"):
        load_config(None, [*engines, "rollout.max_staleness=1", "rollout.over_sample=1.5"])
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=-1 must be >= 0"):
        load_config(None, ["rollout.max_staleness=-1"])
    assert load_config(None, [*engines, "rollout.max_staleness=2"]).rollout.max_staleness == 2


def test_engine_actor_keys_are_checked():
    """The engine actors' weight wait and push buckets must be positive; fractions of a MiB are fine."""
    with pytest.raises(ConfigError, match=r"rollout.weight_timeout_s=0.0 must be > 0"):
        load_config(None, ["rollout.weight_timeout_s=0"])
    with pytest.raises(ConfigError, match=r"rollout.weight_sync_bucket_mb=0.0 must be > 0"):
        load_config(None, ["rollout.weight_sync_bucket_mb=0"])
    config = load_config(None, ["rollout.weight_sync_bucket_mb=0.5", "rollout.join_requests=false"])
    assert config.rollout.weight_sync_bucket_mb == 0.5 and config.rollout.join_requests is False
