"""The GenRM replica: the Ray Serve deployment class that hosts one judge engine and batches verdicts.

Kept apart from `yatt_ray.reward.genrm` (the wire types, templates and parsers) so that importing those costs
no Ray Serve import (~1 s a process, measured with `python -X importtime`): only the driver that deploys the
judge and its replicas import this module.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray import serve

from yatt_ray.config import GenRMConfig
from yatt_ray.reward.genrm import JudgeRequest, Verdict, resolve_parser, resolve_template, tp_kwargs


def judge_engine_kwargs(settings: Any) -> dict[str, Any]:
    """What a judge engine is built with (`make_engine`'s keywords besides the kind and path), from the run's
    `reward.genrm` section: the replica builds it so, and the driver times the engines so (`fit`)."""
    from yatt_ray.rollout import ENGINE_DTYPES

    return dict(
        seed=0,
        dtype=ENGINE_DTYPES[settings.dtype],
        kv_cache_gb=settings.kv_cache_gb,
        max_model_len=settings.max_prompt_tokens + settings.max_new_tokens,
        engine_kwargs=tp_kwargs(settings.accelerators_per_replica),
    )


class GenRMJudge:
    """The Serve deployment's class: one judge engine per replica, batched greedy verdicts.

    `settings` is the run's `reward.genrm` section (resolved on the driver); `release_when_idle` is set in full
    coexistence; `hub` (the run's MetricsHub) receives the replica's busy spans for the timeline.
    """

    def __init__(self, settings: GenRMConfig, release_when_idle: bool, hub: Any = None) -> None:
        import os

        from transformers import AutoTokenizer

        from yatt_ray.metrics.timeline import SpanRecorder, local_accelerator
        from yatt_ray.rollout import SamplingSpec, make_engine

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.settings = settings
        self.template = resolve_template(settings.template)
        self.parser = resolve_parser(settings.parser)
        self.tokenizer = AutoTokenizer.from_pretrained(settings.path)
        self.max_prompt_tokens = settings.max_prompt_tokens
        self.engine = make_engine(settings.engine, settings.path, **judge_engine_kwargs(settings))
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
        from yatt_ray.rollout import GenerateRequest, complete

        prompts = []
        for r in requests:
            ids = self.tokenizer(self.template(r.prompt, r.response, r.ground_truth))["input_ids"]
            prompts.append(ids[-self.max_prompt_tokens :])
        outs = complete(self.engine.generate(GenerateRequest(prompts, self.spec)))
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
