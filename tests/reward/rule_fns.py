"""User reward functions named by dotted path in the rule-reward tests (each misbehaves in one way)."""

from __future__ import annotations


def fails_on_empty(response: str, ground_truth: str, data_source: str) -> float:
    """Exact match that indexes the response's first character: IndexError on an empty response."""
    return float(response[0] == ground_truth[0] and response == ground_truth)


def returns_text(response: str, ground_truth: str, data_source: str) -> str:
    return "1.0" if response == ground_truth else "0.0"


def returns_nan(response: str, ground_truth: str, data_source: str) -> float:
    return float("nan")


async def async_fails_on_empty(response: str, ground_truth: str, data_source: str) -> float:
    return fails_on_empty(response, ground_truth, data_source)


_calls = 0


def fails_on_the_twentieth_call(response: str, ground_truth: str, data_source: str) -> float:
    """Exact match that raises on its 20th call in a process (a bug that shows mid-run, after the driver's
    dry call passed). Each raise appends a line to the file named by `data_source`, so a test can count how
    many attempts ran into it."""
    global _calls
    _calls += 1
    if _calls == 20:
        with open(data_source, "a") as f:
            f.write("raised\n")
        raise ZeroDivisionError("the user's reward divided by zero")
    return 1.0 if response.strip() == ground_truth.strip() else 0.0


def response_length(response: str, ground_truth: str, data_source: str) -> float:
    """len(response) / 10: differs between a prompt's samples, so GRPO has an advantage to train on even
    with a random policy (tests that check that weights move, not that a task is learnt)."""
    return len(response) / 10
