"""Math rewards by data source: GSM8K's `#### <number>`, a `\\boxed{...}` answer checked by math-verify, and
`math`, which picks one of them from the sample's `data_source` (as verl's and OpenRLHF's default scorers do).

All are rule rewards `fn(response, ground_truth, data_source) -> float` in REWARD_FUNCTIONS, scoring 1.0 for
a right answer and 0.0 for a wrong or missing one (never raising on a response, whatever its form):

  gsm8k        the response's answer is the number after its last "####" ("#### 1,234", "#### $5.50"); a
               response without a "####" number is read by its last number instead ("... so she has 18 left.",
               "\\boxed{18}"), as lm-eval's flexible extraction does, so a policy that has not yet learnt the
               format still earns the reward for a right answer. The answer and the ground truth (a number, or
               a whole GSM8K solution ending in "#### <number>") are compared as exact decimals after removing
               commas and "$" ("1,234.00" equals "1234"); a ground truth that is no number is compared as text.
  math_verify  the response's answer is the content of its last `\\boxed{...}` (or `\\fbox{...}`; none scores
               0); it and the ground truth (bare LaTeX such as "\\frac{1}{2}", or a text holding a boxed
               answer) are parsed by math-verify (`math_verify.parse`, LaTeX then plain expressions) and
               compared by `math_verify.verify(gold, answer)`: numerically ("0.5" equals "\\frac{1}{2}"),
               symbolically, as sets / intervals / equations. A ground truth that math-verify cannot parse is
               compared with the answer as text (white space and surrounding "$" removed).
  math         by `data_source` (case-insensitive; the first entry of MATH_SOURCES whose word occurs in it):
               "gsm8k" (openai/gsm8k) -> gsm8k; "math" (lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,
               HuggingFaceH4/MATH-500, math500, math_dapo, ...), "aime", "amc", "olympiad", "minerva",
               "numina", "deepscaler", "omni", "geometry3k" / "geo3k" (hiyouga/geometry3k, verl's geo3k) -> math_verify;
               any other source -> exact_match.

Timeouts and threads. math-verify bounds its own work with `signal.alarm`, which works only on the main
thread (elsewhere it raises ValueError), and a reward may run off it (a Ray Train worker runs the training
function in a thread). So math-verify's timeouts are turned off and each parse-and-verify runs in a short-lived
daemon thread that the caller waits on for at most `MATH_VERIFY_TIMEOUT_S` seconds, on any thread. A call
past that scores 0.0 (logged); its thread is stopped by an exception raised in it
(`PyThreadState_SetAsyncExc`), which takes effect at its next Python bytecode (sympy and the LaTeX parser are
Python), so a runaway comparison neither hangs the step nor keeps a core busy.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from yatt_ray.reward.rules import REWARD_FUNCTIONS, RewardFn, exact_match

log = logging.getLogger(__name__)

MATH_VERIFY_TIMEOUT_S = 5.0  # per response: parsing both sides and comparing them

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_HASH_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


# ---- gsm8k ---------------------------------------------------------------------------------------------
def gsm8k_answer(response: str) -> str | None:
    """The number a GSM8K response answers (the module docstring), commas and "$" removed; None for none."""
    found = _HASH_ANSWER.findall(response) or _ANY_NUMBER.findall(response)
    return _clean_number(found[-1]) if found else None


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip()


def _same_number(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a == b


@REWARD_FUNCTIONS.register("gsm8k")
def gsm8k(response: str, ground_truth: str, data_source: str = "") -> float:
    """1.0 when the response's GSM8K answer (its last "#### <number>", else its last number) equals the
    ground truth's number (or "#### <number>" of a whole solution) as exact decimals; else 0.0."""
    answer = gsm8k_answer(response)
    if answer is None:
        return 0.0
    truth = _HASH_ANSWER.findall(ground_truth)
    expected = _clean_number(truth[-1] if truth else ground_truth)
    return 1.0 if _same_number(answer, expected) else 0.0


# ---- math_verify ---------------------------------------------------------------------------------------
def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` of `text` (nested braces kept), or of a
    `\\boxed 5` without braces (up to the next space or "$"); None when there is none or it is not closed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + (6 if text.startswith("\\boxed", start) else 5) :]
    if rest.startswith(" "):
        word = rest.strip().split("$")[0].split()
        return word[0] if word else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


def _plain(text: str) -> str:
    return "".join(text.strip().strip("$").split())


def _verify(answer: str, ground_truth: str) -> bool:
    """math-verify's verdict on `answer` (a boxed content) against `ground_truth`; no signal timeouts."""
    import math_verify.grader
    import math_verify.parser
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # we bound the time ourselves (module docstring): silence math-verify's "timeout is disabled" warning
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    targets = [LatexExtractionConfig(), ExprExtractionConfig()]
    truth = last_boxed(ground_truth)
    truth = truth if truth is not None else ground_truth.strip().strip("$")
    gold = parse(f"\\boxed{{{truth}}}", targets, parsing_timeout=None)
    if not gold:
        return _plain(answer) == _plain(truth)
    predicted = parse(f"\\boxed{{{answer}}}", targets, parsing_timeout=None)
    return bool(predicted) and bool(verify(gold, predicted, timeout_seconds=None))


class _Cancelled(BaseException):
    """Raised inside a math-verify thread that ran past its time (BaseException: no `except Exception` in
    the library swallows it)."""


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """(True, `fn()`) when it returns within `timeout_s` seconds, (False, None) when it does not; `fn`'s own
    exception is raised again here. Works on any thread: `fn` runs in a daemon thread, which is stopped by an
    exception raised in it at its next Python bytecode when the time is up."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except _Cancelled:
            pass
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="yatt-math-verify", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() and thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Cancelled))
        thread.join(1.0)
        return False, None
    if "error" in outcome:
        raise outcome["error"]
    return True, outcome.get("value")


@REWARD_FUNCTIONS.register("math_verify")
def math_verify(response: str, ground_truth: str, data_source: str = "") -> float:
    """1.0 when the response's last `\\boxed{...}` answer equals the ground truth by math-verify (the module
    docstring); 0.0 for a wrong answer, no boxed answer, or a check past MATH_VERIFY_TIMEOUT_S seconds."""
    answer = last_boxed(response)
    if answer is None or not answer.strip():
        return 0.0
    finished, right = call_with_timeout(lambda: _verify(answer, ground_truth), MATH_VERIFY_TIMEOUT_S)
    if not finished:
        log.warning(
            "math_verify: checking the answer %r against %r took over %.0f s; scored 0",
            answer[:100],
            ground_truth[:100],
            MATH_VERIFY_TIMEOUT_S,
        )
        return 0.0
    return 1.0 if right else 0.0


# ---- math: by data source ------------------------------------------------------------------------------
MATH_SOURCES: tuple[tuple[str, RewardFn], ...] = (
    ("gsm8k", gsm8k),
    ("math", math_verify),
    ("aime", math_verify),
    ("amc", math_verify),
    ("olympiad", math_verify),
    ("minerva", math_verify),
    ("numina", math_verify),
    ("deepscaler", math_verify),
    ("omni", math_verify),
    ("geometry3k", math_verify),  # hiyouga/geometry3k (verl's geo3k): boxed answers
    ("geo3k", math_verify),
)


def reward_for_source(data_source: str) -> RewardFn:
    """The reward `math` uses for `data_source`: the first MATH_SOURCES word it contains, else exact_match."""
    source = data_source.lower()
    return next((fn for word, fn in MATH_SOURCES if word in source), exact_match)


@REWARD_FUNCTIONS.register("math")
def math_reward(response: str, ground_truth: str, data_source: str = "") -> float:
    """gsm8k, math_verify or exact_match, chosen by `data_source` (`reward_for_source`)."""
    return float(reward_for_source(data_source)(response, ground_truth, data_source))
