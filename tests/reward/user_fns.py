"""User functions named by dotted path in the GenRM tests."""


def short_template(prompt: str, response: str, ground_truth: str) -> str:
    return f"{prompt} {response} {ground_truth}"


def always_half(text: str) -> float:
    return 0.5
