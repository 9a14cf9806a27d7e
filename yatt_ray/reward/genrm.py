"""GenRM: a generative judge served by Ray Serve.

A judge prompt is rendered from a template with the sample's `prompt`, `response` and `ground_truth`; the
judge (any Hugging Face causal LM directory) generates a short verdict greedily; a parser turns the verdict
text into a score in [0, 1], or None when it cannot be read. Requests arrive one sample at a time and are
batched on the replica by `serve.batch` (up to `reward.genrm.batch_size`, waiting at most
`reward.genrm.batch_wait_s` for a batch to fill).

Templates and parsers are plain functions; users give their own by dotted path (`pkg.mod:fn`), or a
template as a string with `{prompt}`, `{response}` and `{ground_truth}` fields.

In full coexistence the replica shares its accelerator with a trainer and releases its memory (the engine
sleeps) when no batch arrived for `idle_release_s`; the next batch wakes it. In partial coexistence it stays
awake on its own slice.
"""

from __future__ import annotations

import asyncio
import re
import string
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray import serve

from yatt_ray.algos.registry import Registry
from yatt_ray.config import GenRMConfig
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


class GenRMJudge:
    """The Serve deployment's class: one judge engine per replica, batched greedy verdicts.

    `settings` is the run's `reward.genrm` section (resolved on the driver); `release_when_idle` is set in full
    coexistence; `hub` (the run's MetricsHub) receives the replica's busy spans for the timeline.
    """

    def __init__(self, settings: GenRMConfig, release_when_idle: bool, hub: Any = None) -> None:
        import os

        from transformers import AutoTokenizer

        from yatt_ray.metrics.timeline import SpanRecorder, local_accelerator
        from yatt_ray.rollout import ENGINE_DTYPES, SamplingSpec, make_engine

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.settings = settings
        self.template = resolve_template(settings.template)
        self.parser = resolve_parser(settings.parser)
        self.tokenizer = AutoTokenizer.from_pretrained(settings.path)
        self.max_prompt_tokens = settings.max_prompt_tokens
        self.engine = make_engine(
            settings.engine,
            settings.path,
            seed=0,
            dtype=ENGINE_DTYPES[settings.dtype],
            kv_cache_gb=settings.kv_cache_gb,
            max_model_len=self.max_prompt_tokens + settings.max_new_tokens,
            engine_kwargs=tp_kwargs(settings.accelerators_per_replica),
        )
        eos = self.tokenizer.eos_token_id
        self.spec = SamplingSpec(
            n=1, max_new_tokens=settings.max_new_tokens, temperature=0.0, stop_token_ids=(eos,)
        )
        self.judge.set_max_batch_size(settings.batch_size)  # type: ignore[attr-defined]  # serve.batch
        self.judge.set_batch_wait_timeout_s(settings.batch_wait_s)  # type: ignore[attr-defined]
        self.release_when_idle = release_when_idle
        self.idle_release_s = settings.idle_release_s
        self.hub = hub
        self.worker = f"genrm-{os.getpid()}"
        self.recorder = SpanRecorder("genrm", self.worker, local_accelerator(self.worker))
        self.asleep = False
        self.last_batch_end = time.time()
        self.batches = self.requests = 0
        self.idle_task: asyncio.Task | None = None
        if release_when_idle:
            self._release()

    def _wake(self) -> None:
        if self.asleep:
            with self.recorder.span("load", step=0):
                self.engine.wake()
            self.asleep = False

    def _release(self) -> None:
        if not self.asleep:
            with self.recorder.span("release", step=0):
                self.engine.sleep()
            self.asleep = True

    async def _release_when_idle(self) -> None:
        """Full coexistence: give the accelerator back once no batch came for `idle_release_s`."""
        while True:
            await asyncio.sleep(self.idle_release_s / 2)
            if not self.asleep and time.time() - self.last_batch_end > self.idle_release_s:
                self._release()
                self._push_spans()

    def judge_texts(self, requests: list[JudgeRequest]) -> list[Verdict]:
        """Render, generate and parse one batch (synchronous: the engine is not thread-safe)."""
        prompts = []
        for r in requests:
            ids = self.tokenizer(self.template(r.prompt, r.response, r.ground_truth))["input_ids"]
            prompts.append(ids[-self.max_prompt_tokens :])
        outs = self.engine.generate(prompts, self.spec)
        verdicts = []
        for r, group in zip(requests, outs):
            text = str(self.tokenizer.decode(group[0].token_ids, skip_special_tokens=True))
            verdicts.append(Verdict(r.key, self.parser(text), text))
        return verdicts

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.01)
    async def judge(self, requests: list[JudgeRequest]) -> list[Verdict]:
        """Callers send one JudgeRequest each; `serve.batch` hands this method a list of them."""
        if self.release_when_idle and self.idle_task is None:
            self.idle_task = asyncio.get_running_loop().create_task(self._release_when_idle())
        self._wake()
        with self.recorder.span("judge", step=0):
            verdicts = self.judge_texts(requests)
        self.batches += 1
        self.requests += len(requests)
        self.last_batch_end = time.time()
        self._push_spans()
        return verdicts

    def _push_spans(self) -> None:
        if self.hub is not None:
            from yatt_ray.metrics.timeline import to_wire

            self.hub.push_spans.remote(to_wire(self.recorder.drain()))

    def stats(self) -> dict[str, Any]:
        """This replica's counters: its worker name, batches run and requests judged."""
        return {
            "worker": self.worker,
            "batches": self.batches,
            "requests": self.requests,
            "asleep": self.asleep,
        }

    async def __call__(self, request: Any) -> dict[str, Any]:
        """HTTP (only when `reward.genrm.http_port` is set): POST {"prompt", "response", "ground_truth"}."""
        body = await request.json()
        missing = {"prompt", "response", "ground_truth"} - set(body)
        if missing:
            return {"error": f"missing field(s) {sorted(missing)}"}
        verdict = await self.judge(
            JudgeRequest("http", body["prompt"], body["response"], body["ground_truth"])
        )
        return {"score": verdict.score, "text": verdict.text}
