import pickle

import pytest

from yatt_ray.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    DuplicateNameError,
    Registry,
    grpo_advantages,
)
from yatt_ray.errors import ConfigError, UnknownNameError, YattError


def test_register_get_names_contains():
    reg: Registry = Registry("widget")

    @reg.register("b")
    def b():
        return "b"

    @reg.register("a")
    def a():
        return "a"

    assert reg.get("a") is a and reg.get("b") is b
    assert reg.names() == ["a", "b"]  # sorted, not insertion order
    assert "a" in reg and "c" not in reg and 3 not in reg
    assert len(reg) == 2 and list(reg) == ["a", "b"]


def test_duplicate_name_raises_and_keeps_the_first():
    reg: Registry = Registry("widget")
    reg.register("x")(len)
    with pytest.raises(DuplicateNameError, match="widget 'x' is already registered"):
        reg.register("x")(abs)
    assert reg.get("x") is len
    assert issubclass(DuplicateNameError, YattError) and issubclass(DuplicateNameError, ValueError)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_names_rejected(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        Registry("widget").register(bad)


def test_unknown_name_lists_valid_names_sorted():
    with pytest.raises(UnknownNameError) as info:
        ADVANTAGE_ESTIMATORS.get("grpoo")
    assert (
        str(info.value)
        == "unknown advantage estimator 'grpoo'; valid: gae, grpo, grpo_no_std, reinforce_pp, "
        "reinforce_pp_baseline, remax, rloo (did you mean 'grpo'?)"
    )
    assert isinstance(info.value, KeyError) and isinstance(info.value, ConfigError)
    # survives a Ray boundary (pickle) with its message
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is UnknownNameError and str(again) == str(info.value)


def test_unknown_name_without_close_match_and_empty_registry():
    with pytest.raises(
        UnknownNameError, match=r"^unknown KL estimator 'zzz'; valid: k1, k2, k3, low_var_kl$"
    ):
        KL_ESTIMATORS.get("zzz")
    with pytest.raises(UnknownNameError, match=r"valid: \(none registered\)"):
        Registry("widget").get("a")
    with pytest.raises(UnknownNameError):  # unhashable names are unknown, not a TypeError
        Registry("widget").get(["a"])


def test_library_registries_are_filled():
    assert ADVANTAGE_ESTIMATORS.names() == [
        "gae",
        "grpo",
        "grpo_no_std",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "remax",
        "rloo",
    ]
    assert ADVANTAGE_ESTIMATORS.get("grpo").fn is grpo_advantages
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3", "low_var_kl"]
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "ppo_clip"]
    assert LOSS_AGGREGATIONS.names() == [
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-mean",
    ]


def test_describe_table():
    reg: Registry = Registry("widget")

    @reg.register("long_name")
    def f():
        """First line.

        More."""

    reg.register("x")(lambda: None)
    assert reg.describe() == "long_name  First line.\nx"
    table = ADVANTAGE_ESTIMATORS.describe().splitlines()
    assert (
        len(table) == 7 and table[0].startswith("gae  ") and table[0].endswith("[needs critic, token-level]")
    )
    assert Registry("widget").describe() == ""


def test_advantage_estimator_names_are_checked_for_duplicates():
    with pytest.raises(DuplicateNameError, match="advantage estimator 'grpo' is already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo")
