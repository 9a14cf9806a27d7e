"""GenRM pieces without a cluster: verdict parsers, templates, reward combination, parse-error policy."""

from __future__ import annotations

import asyncio

import pytest

from yatt_ray import ConfigError, load_config
from yatt_ray.reward.client import GenRMError
from yatt_ray.reward.genrm import (
    DEFAULT_TEMPLATE,
    Verdict,
    parse_score,
    parse_yes_no,
    resolve_parser,
    resolve_template,
)
from yatt_ray.reward.rules import score_with_rule
from yatt_ray.reward.scorer import combine, resolve_verdict


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("Yes", 1.0),
        (" y.", 1.0),
        ("Correct!", 1.0),
        ("no, because", 0.0),
        ("N", 0.0),
        ("maybe", None),
        ("", None),
    ],
)
def test_yes_no_parser(text, score):
    assert parse_yes_no(text) == score


@pytest.mark.parametrize(
    ("text", "score"), [("0.75", 0.75), ("7/10", 0.7), ("score: 1", 1.0), ("3", None), ("x", None)]
)
def test_score_parser(text, score):
    assert parse_score(text) == pytest.approx(score) if score is not None else parse_score(text) is None


def test_templates_string_default_and_dotted_path():
    assert resolve_template("{response}|{ground_truth}?")("1+2=", "3", "3") == "3|3?"
    assert resolve_template("default")("Q", "R", "G") == DEFAULT_TEMPLATE.format(
        prompt="Q", response="R", ground_truth="G"
    )
    assert resolve_template("tests.reward.user_fns:short_template")("a", "b", "c") == "a b c"
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['answer'\]"):
        resolve_template("{answer}")


def test_parsers_by_name_or_path_and_unknown_names():
    assert resolve_parser("yes_no") is parse_yes_no
    assert resolve_parser("tests.reward.user_fns:always_half")("anything") == 0.5
    with pytest.raises(ConfigError, match=r"valid: score, yes_no \(did you mean .yes_no.\?\)"):
        resolve_parser("yesno")


def test_combine_modes():
    assert combine(1.0, None, "rule", 0.3) == 1.0
    assert combine(None, 0.25, "genrm", 0.3) == 0.25
    assert combine(1.0, 0.0, "mix", 0.25) == pytest.approx(0.75)


def test_parse_error_policies():
    bad, good = Verdict("k", None, "???"), Verdict("k", 1.0, "yes")
    assert resolve_verdict(good, 0.0, "raise") == (1.0, False)
    assert resolve_verdict(bad, 0.0, "zero") == (0.0, True)
    assert resolve_verdict(bad, 1.0, "rule") == (1.0, True)
    with pytest.raises(GenRMError, match=r"verdict '\?\?\?' for sample 'k' could not be parsed"):
        resolve_verdict(bad, 1.0, "raise")


def test_async_user_reward_functions_run_concurrently():
    async def slow_match(response, truth, source):
        await asyncio.sleep(0.2)
        return float(response == truth)

    import time

    start = time.perf_counter()
    scores = score_with_rule(slow_match, [("1", "1", ""), ("2", "3", "")] * 10)
    assert scores == [1.0, 0.0] * 10 and time.perf_counter() - start < 1.5


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("reward.mode=judge", "reward.mode='judge' is unknown; valid: genrm, mix, rule"),
        ("reward.genrm_weight=1.5", "reward.genrm_weight=1.5 must be in [0, 1]"),
        ("placement.mode=half", "placement.mode='half' is unknown; valid: disaggregated, full, partial"),
        ("reward.genrm.on_parse_error=skip", "on_parse_error='skip' is unknown; valid: raise, rule, zero"),
        ("reward.genrm.max_replicas=0", "reward.genrm.max_replicas=0 must be >= reward.genrm.replicas=1"),
    ],
)
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(
            None, ["reward.mode=genrm", override] if not override.startswith("reward.mode") else [override]
        )
    assert message in str(info.value)
