"""GenRM pieces: the wire types, templates and verdict parsers of the generative judge (no Ray Serve import:
every controller imports this; the Serve replica class is `yatt_ray.reward.judge_replica.GenRMJudge`).

A judge prompt is rendered from a template with the sample's `prompt`, `response` and `ground_truth`; the
judge (any Hugging Face causal LM directory) generates a short verdict greedily; a parser turns the verdict
text into a score in [0, 1], or None when it cannot be read. Requests arrive one sample at a time and are
batched on the replica by `serve.batch` (up to `reward.genrm.batch_size`, waiting at most
`reward.genrm.batch_wait_s` for a batch to fill).

Templates and parsers are plain functions; users give their own by dotted path (`pkg.mod:fn`), or a
template as a string with `{prompt}`, `{response}` and `{ground_truth}` fields.

In full and partial coexistence the replica shares its accelerator with a trainer and releases its memory
(the engine sleeps) when no batch arrived for `idle_release_s`; the next batch wakes it. Disaggregated, it
stays awake on its own slice.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from yatt_ray.algos.registry import Registry
from yatt_ray.errors import ConfigError
from yatt_ray.reward.rules import import_object

APP_NAME = "yatt-genrm"
DEFAULT_TEMPLATE = (
    "Grade the response to the question against the reference answer.\n"
    "Question: {prompt}\nReference answer: {ground_truth}\nResponse: {response}\n"
    "Is the response correct? Answer yes or no.\nVerdict:"
)

Template = Callable[[str, str, str], str]
Parser = Callable[[str], "float | None"]
PARSERS: Registry[Parser] = Registry("GenRM verdict parser")


@dataclass(frozen=True)
class JudgeRequest:
    """One sample to judge. `key` is unique per sample and attempt-independent (the client keeps one score
    per key, so a retried request is never counted twice)."""

    key: str
    prompt: str
    response: str
    ground_truth: str


@dataclass(frozen=True)
class Verdict:
    key: str
    score: float | None  # None: the parser could not read `text`
    text: str  # the judge's raw output (stays on the controller: never sent to the driver)


@PARSERS.register("yes_no")
def parse_yes_no(text: str) -> float | None:
    """1.0 for a first word of yes / y / correct / true, 0.0 for no / n / incorrect / wrong / false, else None
    (case and surrounding punctuation ignored)."""
    words = re.findall(r"[a-z]+", text.lower())
    if not words:
        return None
    if words[0] in ("yes", "y", "correct", "true"):
        return 1.0
    if words[0] in ("no", "n", "incorrect", "wrong", "false"):
        return 0.0
    return None


@PARSERS.register("score")
def parse_score(text: str) -> float | None:
    """The first number in the text, read as a score in [0, 1] ("0.8"), or out of 10 ("7/10"); else None."""
    match = re.search(r"(\d+(?:\.\d+)?)\s*(/\s*10)?", text)
    if match is None:
        return None
    value = float(match.group(1)) / (10.0 if match.group(2) else 1.0)
    return value if 0.0 <= value <= 1.0 else None


def resolve_template(spec: str) -> Template:
    """A template string with {prompt}, {response}, {ground_truth} fields, or a dotted path to a function
    `fn(prompt, response, ground_truth) -> str`; "default" is `DEFAULT_TEMPLATE`.

    A template string must use {response} (otherwise the judge never sees the answer it grades); {prompt}
    and {ground_truth} are optional (a reference-free judge needs no ground truth)."""
    if spec == "default":
        spec = DEFAULT_TEMPLATE
    fields = "{prompt}, {response} and {ground_truth}"
    if "{" in spec or "}" in spec:
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(spec) if name is not None}
        except ValueError as exc:  # an unmatched brace
            raise ConfigError(
                f"reward.genrm.template={_short(spec)} is not a valid template ({exc}); use the fields {fields} "
                "and double braces ({{ or }}) for a literal brace"
            ) from exc
        unknown = names - {"prompt", "response", "ground_truth"}
        if unknown:
            raise ConfigError(
                f"reward.genrm.template has unknown field(s) {sorted(unknown)}; use {fields} "
                "(double braces for a literal brace)"
            )
        if "response" not in names:
            raise ConfigError(
                f"reward.genrm.template={_short(spec)} has no {{response}} field, so the judge would never see "
                f"the response it grades; add {{response}} (fields: {fields})"
            )
        return lambda prompt, response, ground_truth: spec.format(
            prompt=prompt, response=response, ground_truth=ground_truth
        )
    if not re.fullmatch(r"[A-Za-z_][\w.]*[:.][A-Za-z_]\w*", spec.strip()):
        raise ConfigError(
            f"reward.genrm.template={_short(spec)} is neither a template string (it has none of the fields "
            f"{fields}) nor a 'package.module:function' path; write the judge prompt with at least {{response}} "
            "in it, or name a function fn(prompt, response, ground_truth) -> str"
        )
    fn = import_object(spec.strip(), "reward.genrm.template")
    return fn


def _short(text: str, limit: int = 80) -> str:
    """`text` quoted, cut to `limit` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def resolve_parser(spec: str) -> Parser:
    """A built-in parser name (yes_no, score) or a dotted path to `fn(text) -> float | None`."""
    if spec in PARSERS:
        return PARSERS.get(spec)
    if "." not in spec and ":" not in spec:
        PARSERS.get(spec)  # raises, listing the built-ins
    return import_object(spec, "reward.genrm.parser")


def tp_kwargs(accelerators: int) -> dict[str, Any] | None:
    """vLLM arguments that spread one judge over the accelerators of its placement-group bundles."""
    return {"tensor_parallel_size": accelerators} if accelerators > 1 else None
