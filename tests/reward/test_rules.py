"""Rule rewards without a cluster: what a reward is, the driver's dry call, and `reward.on_error`."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch

from yatt_ray import ConfigError, RewardError, YattError, load_config
from yatt_ray.config import RewardConfig
from yatt_ray.reward.rules import as_reward, check_reward_fn, exact_match, resolve_reward_fn, rule_rewards
from yatt_ray.reward.scorer import RewardScorer, Sample

FAILS = "tests.reward.rule_fns:fails_on_empty"
ASYNC_FAILS = "tests.reward.rule_fns:async_fails_on_empty"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1.0),
        (0.5, 0.5),
        (True, 1.0),
        (np.float32(0.25), 0.25),
        (np.int64(2), 2.0),
        (torch.tensor(0.75), 0.75),
    ],
)
def test_numbers_are_rewards(value, expected):
    assert as_reward(value) == expected


@pytest.mark.parametrize(
    "value", ["1.0", b"1", None, float("nan"), float("inf"), [1.0], np.array([1.0]), torch.ones(1), 1j]
)
def test_non_numbers_are_not_rewards(value):
    assert as_reward(value) is None


def test_dry_call_of_a_good_function():
    assert check_reward_fn(exact_match, "exact_match", "42", "math") == (1.0, 0.0)


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("tests.reward.rule_fns:returns_text", "returned '1.0' of type str"),
        ("tests.reward.rule_fns:returns_nan", "returned nan of type float"),
    ],
)
@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_dry_call_rejects_non_numbers_whatever_on_error(name, shown, on_error):
    with pytest.raises(ConfigError) as info:
        check_reward_fn(resolve_reward_fn(name), name, "42", "math", on_error)
    message = str(info.value)
    assert f"reward.function={name!r}" in message and shown in message
    assert "(tests.reward.rule_fns:returns_" in message  # the function itself
    assert "ground truth as the response" in message and "finite number" in message


def test_dry_call_of_a_function_that_fails_on_an_empty_response(caplog):
    fn = resolve_reward_fn(FAILS)
    with pytest.raises(ConfigError) as info:
        check_reward_fn(fn, FAILS, "42", "math")
    message = str(info.value)
    assert f"reward.function={FAILS!r}" in message and "an empty response" in message
    assert "raised IndexError: string index out of range" in message and "rule_fns.py:" in message
    assert "set reward.on_error=zero" in message
    with caplog.at_level(logging.WARNING, logger="yatt_ray.reward.rules"):
        assert check_reward_fn(fn, FAILS, "42", "math", "zero") == (1.0, None)
    assert "IndexError" in caplog.text and "score 0" in caplog.text


@pytest.mark.parametrize("name", [FAILS, ASYNC_FAILS])
def test_a_failing_sample_raises_naming_it(name):
    items = [("7", "7", "a"), ("", "ground-9", "arith"), ("8", "7", "a")]  # the empty response fails
    with pytest.raises(RewardError) as info:
        rule_rewards(resolve_reward_fn(name), items, name)
    message = str(info.value)
    assert (
        f"reward.function={name!r}" in message and "raised IndexError: string index out of range" in message
    )
    assert "data_source='arith'" in message and "ground_truth='ground-9'" in message
    assert "response (first 200 characters) ''" in message and "reward.on_error=zero" in message


def test_the_response_is_cut_to_200_characters():
    def boom(response, truth, source):
        raise ValueError("cannot parse")

    with pytest.raises(RewardError) as info:
        rule_rewards(boom, [("x" * 300, "1", "s")], "my.mod:boom")
    assert repr("x" * 200) in str(info.value) and "x" * 201 not in str(info.value)
    assert "raised ValueError: cannot parse" in str(info.value)


@pytest.mark.parametrize("name", [FAILS, ASYNC_FAILS])
def test_on_error_zero_scores_the_failing_sample_zero_and_keeps_the_others(name):
    items = [("7", "7", "a"), ("", "7", "a"), ("8", "7", "a"), ("", "8", "a"), ("8", "8", "a")]
    assert rule_rewards(resolve_reward_fn(name), items, name, "zero") == ([1.0, 0.0, 0.0, 0.0, 1.0], 2)


@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_non_numbers_during_training_always_raise(on_error):
    async def returns_none(response, truth, source):
        return None

    with pytest.raises(RewardError) as info:
        rule_rewards(returns_none, [("1", "1", "s")], "my.mod:returns_none", on_error)
    message = str(info.value)
    assert "reward.function='my.mod:returns_none'" in message and "returned None of type NoneType" in message
    assert "whatever reward.on_error says" in message


def test_reward_error_pickles_with_its_message():
    error = RewardError("reward.function='f' raised KeyError: 'x'")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is RewardError and str(again) == str(error) and isinstance(again, YattError)


def samples(*pairs):
    return [Sample(f"k{i}", "p", response, truth, "src") for i, (response, truth) in enumerate(pairs)]


@pytest.mark.parametrize("name", [FAILS, ASYNC_FAILS])
def test_scorer_raises_with_on_error_raise(name):
    scorer = RewardScorer(RewardConfig(function=name), connect_timeout_s=1.0)
    assert scorer.scores(samples(("3", "3"))) == [1.0]
    with pytest.raises(RewardError, match=r"reward.function=.*raised IndexError.*ground_truth='4'"):
        scorer.scores(samples(("3", "3"), ("", "4")))
    assert scorer.take_stats() == {}  # no counter under raise: the run stops instead


@pytest.mark.parametrize("name", [FAILS, ASYNC_FAILS])
def test_scorer_counts_errors_with_on_error_zero(name):
    scorer = RewardScorer(RewardConfig(function=name, on_error="zero"), connect_timeout_s=1.0)
    assert scorer.scores(samples(("3", "3"), ("", "4"), ("", "5"))) == [1.0, 0.0, 0.0]
    assert scorer.scores(samples(("", "3"))) == [0.0]
    assert scorer.take_stats() == {"reward/errors": 3.0}
    assert scorer.take_stats() == {"reward/errors": 0.0}  # counted per step


def test_on_error_is_validated():
    assert load_config(None, ["reward.on_error=zero"]).reward.on_error == "zero"
    with pytest.raises(ConfigError, match="reward.on_error='skip' is unknown; valid: raise, zero"):
        load_config(None, ["reward.on_error=skip"])
