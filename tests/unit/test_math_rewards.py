"""Math rule rewards (yatt_ray.reward.math): gsm8k, math_verify and the by-source `math`, on hand cases, on
the main thread and off it (math-verify's own timeouts use signals, which work on the main thread only)."""

from __future__ import annotations

import threading
import time

import pytest

from yatt_ray import load_config
from yatt_ray.reward import REWARD_FUNCTIONS, exact_match, resolve_reward_fn
from yatt_ray.reward import math as math_rewards
from yatt_ray.reward.math import (
    call_with_timeout,
    gsm8k,
    gsm8k_answer,
    last_boxed,
    math_reward,
    math_verify,
    reward_for_source,
)


def in_thread(fn, *args):
    """`fn(*args)` called on a fresh (non-main) thread; its exception is raised here."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the reward did not return within 60 s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_registered_and_resolved_by_name():
    for name, fn in (("gsm8k", gsm8k), ("math_verify", math_verify), ("math", math_reward)):
        assert name in REWARD_FUNCTIONS.names() and resolve_reward_fn(name) is fn
    config = load_config(overrides=["reward.function=math"])
    assert resolve_reward_fn(config.reward.function) is math_reward


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("3 + 4 = 7 eggs.\n#### 1,234", "1234", 1.0),  # commas removed
        ("#### $1,234.00", "1,234", 1.0),  # "$" and trailing zeros
        ("first #### 5 then, correcting myself, #### 7", "7", 1.0),  # the last "####" answer
        ("#### 7 and then 9 more words 12", "7", 1.0),  # "####" wins over later numbers
        ("She has 20 - 2 = 18 dollars left.", "18", 1.0),  # no "####": the last number
        ("so the answer is \\boxed{18}", "18", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### 17", "18", 0.0),
        ("#### 1,234", "123", 0.0),
        ("I do not know", "18", 0.0),  # no number at all
        ("", "18", 0.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),  # a whole GSM8K solution as truth
    ],
)
def test_gsm8k(response, truth, expected):
    assert gsm8k(response, truth, "openai/gsm8k") == expected


def test_gsm8k_answer_extraction():
    assert gsm8k_answer("#### 1,234") == "1234" and gsm8k_answer("costs $5.50.") == "5.50"
    assert gsm8k_answer("no number") is None


def test_last_boxed():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("$\\boxed{\\{1, 2\\}}$") == "\\{1, 2\\}"  # escaped braces still pair up
    assert last_boxed("\\fbox{x^{2}}") == "x^{2}" and last_boxed("so \\boxed 5$") == "5"
    assert last_boxed("no box") is None and last_boxed("\\boxed{unclosed") is None


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("So the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),  # numeric equality across forms
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{2}{4}}", "\\frac12", 1.0),
        ("\\boxed{(x+1)^2}", "x^2 + 2x + 1", 1.0),  # symbolic equality
        ("first \\boxed{3}, no wait: \\boxed{4}", "4", 1.0),  # the last box
        ("\\boxed{0.6}", "\\frac{1}{2}", 0.0),
        ("\\boxed{3}", "4", 0.0),
        ("The answer is 1/2", "\\frac{1}{2}", 0.0),  # no boxed answer
        ("", "\\frac{1}{2}", 0.0),
        ("\\boxed{}", "1", 0.0),
        ("\\boxed{12}", "The sum is $\\boxed{12}$.", 1.0),  # a ground truth holding a boxed answer
    ],
)
def test_math_verify(response, truth, expected):
    assert math_verify(response, truth, "lighteval/MATH") == expected


def test_math_verify_off_the_main_thread():
    # math-verify's signal.alarm timeouts raise ValueError off the main thread: the reward must not use them
    assert in_thread(math_verify, "\\boxed{\\frac{1}{2}}", "0.5", "math") == 1.0
    assert in_thread(math_verify, "\\boxed{3}", "4", "math") == 0.0
    assert in_thread(gsm8k, "#### 1,234", "1234", "openai/gsm8k") == 1.0
    assert in_thread(math_reward, "\\boxed{x^2+2x+1}", "(x+1)^2", "HuggingFaceH4/MATH-500") == 1.0


def spin():
    while True:  # pure Python: the cancelling exception lands at the next bytecode
        pass


def test_a_runaway_check_times_out_and_its_thread_stops(monkeypatch):
    monkeypatch.setattr(math_rewards, "MATH_VERIFY_TIMEOUT_S", 0.3)
    monkeypatch.setattr(math_rewards, "_verify", lambda answer, truth: spin())
    before = {t.ident for t in threading.enumerate()}
    start = time.monotonic()
    assert in_thread(math_verify, "\\boxed{1}", "1", "math") == 0.0
    assert time.monotonic() - start < 5
    deadline = time.monotonic() + 5
    while any(t.name == "yatt-math-verify" and t.ident not in before for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the timed-out check's thread still runs"
        time.sleep(0.05)


def test_call_with_timeout_returns_and_raises():
    assert call_with_timeout(lambda: 3, 5) == (True, 3)
    assert call_with_timeout(spin, 0.2) == (False, None)
    with pytest.raises(ZeroDivisionError):
        call_with_timeout(lambda: 1 / 0, 5)


@pytest.mark.parametrize(
    ("source", "fn"),
    [
        ("openai/gsm8k", gsm8k),
        ("GSM8K", gsm8k),
        ("lighteval/MATH", math_verify),
        ("DigitalLearningGmbH/MATH-lighteval", math_verify),
        ("HuggingFaceH4/MATH-500", math_verify),
        ("math500", math_verify),
        ("math_dapo", math_verify),
        ("aime_2024", math_verify),
        ("hiyouga/geometry3k", math_verify),
        ("default", exact_match),
        ("arithmetic", exact_match),
    ],
)
def test_math_dispatches_by_source(source, fn):
    assert reward_for_source(source) is fn


def test_math_scores_by_source():
    assert math_reward("#### 1,234", "1234", "openai/gsm8k") == 1.0
    assert math_reward("\\boxed{\\frac{1}{2}}", "0.5", "lighteval/MATH") == 1.0
    assert math_reward("#### 1,234", "1234", "lighteval/MATH") == 0.0  # MATH wants a boxed answer
    assert math_reward("so x = \\boxed{2\\sqrt{3}}", "2\\sqrt{3}", "hiyouga/geometry3k") == 1.0
    assert math_reward(" 42 ", "42", "my_task") == 1.0 and math_reward("#### 42", "42", "my_task") == 0.0
