"""The controller's side of GenRM: send samples to the Serve deployment, gather exactly one verdict each.

`submit` sends one request per sample through a Serve handle and returns at once (in partial coexistence it
is called as each prompt's samples finish generating, so judging overlaps generation). `collect(keys)` waits
for those samples' verdicts; the other requests go on being judged. `discard(keys)` drops samples whose
verdicts are no longer wanted (in partial coexistence: the streamed samples of a group the step did not
take): their requests are cancelled and forgotten, so nothing is kept past its step. A request whose replica
dies (or whose batch fails) is cancelled and sent again; one that outlives `reward.genrm.timeout_s` is waited
for again where it is (a resend would queue behind every sample sent since); each counts as a retry, up to
`max_retries`. `collect` waits on one sample at a time, and when that one fails, or every few seconds while it
waits, looks at the others it was asked for without waiting: the requests a dead replica held fail at once
(Serve sends the ones still queued at its router to the live replicas), and are all sent again then, not one
by one as `collect` reaches them. Verdicts are kept by the sample's key, and only the live attempt of a key is
ever read, so a retried sample is scored once, and a key is read (or discarded) once. Past the retries,
`GenRMError` names the samples lost, and every request is cancelled. Serve's INFO line for each cancelled
request ("Cancelling request that has already been assigned to a replica") is filtered out: the client cancels
on purpose.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from yatt_ray.errors import YattError
from yatt_ray.reward.genrm import APP_NAME, JudgeRequest, Verdict

log = logging.getLogger(__name__)
# while `collect` waits on one sample, how often it looks for failed requests among the others
_CHECK_EVERY_S = 2.0
_SERVE_CANCEL_NOTE = "Cancelling request that has already been assigned to a replica"


def _not_a_cancel_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_SERVE_CANCEL_NOTE)


class GenRMError(YattError):
    """GenRM could not score samples (replicas failing past the retries, or an unparsable verdict with
    `reward.genrm.on_parse_error=raise`)."""


@dataclass
class _Pending:
    request: JudgeRequest
    response: Any  # serve.handle.DeploymentResponse of the live attempt
    attempts: int = 1
    sent_at: float = field(default_factory=time.time)


class GenRMClient:
    """Submit / collect against the GenRM application; counts retries for the step's metrics."""

    def __init__(self, timeout_s: float, max_retries: int, connect_timeout_s: float) -> None:
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.handle = _app_handle(connect_timeout_s)
        serve_log = logging.getLogger("ray.serve")  # Serve's logger (SERVE_LOGGER_NAME)
        if _not_a_cancel_note not in serve_log.filters:
            serve_log.addFilter(_not_a_cancel_note)
        self.pending: dict[str, _Pending] = {}
        self.retries = 0
        # asynchronous rollout submits from a thread (samples generated ahead, judged while the trainer trains)
        self.lock = threading.RLock()

    def submit(self, requests: list[JudgeRequest]) -> None:
        """Send `requests` (one per sample), all or none: when a send fails, the ones this call sent are
        cancelled and forgotten before the error propagates, so the samples can be submitted again."""
        with self.lock:
            keys = [r.key for r in requests]
            twice = [k for k in keys if k in self.pending] + [k for k, n in Counter(keys).items() if n > 1]
            if twice:
                raise GenRMError(
                    f"GenRM request key {twice[0]!r} submitted twice; keys must be unique per sample"
                )
            sent: list[str] = []
            try:
                for r in requests:
                    self.pending[r.key] = _Pending(r, self.handle.judge.remote(r))
                    sent.append(r.key)
            except BaseException:
                for key in sent:
                    self.pending.pop(key).response.cancel()
                raise

    def collect(self, keys: Iterable[str] | None = None) -> dict[str, Verdict]:
        """The verdicts of `keys` (default: every pending sample), by key; they leave the pending set, the
        other samples stay in it (still being judged). A key that is not pending (never submitted, or already
        collected or discarded) raises `GenRMError`: each sample's verdict is read once."""
        with self.lock:
            wanted = list(self.pending) if keys is None else list(keys)
            unknown = [k for k in wanted if k not in self.pending]
        twice = [k for k, count in Counter(wanted).items() if count > 1]
        if unknown or twice:
            raise GenRMError(
                f"GenRM verdicts asked for samples not pending {unknown[:5]!r} ({len(unknown)} in all) or "
                f"more than once {twice[:5]!r}: a sample must be submitted before it is scored, and is scored "
                "(or discarded) once; this is a bug in the caller"
            )
        done: dict[str, Verdict] = {}
        for key in wanted:
            while key not in done:
                with self.lock:
                    item = self.pending[key]
                left = self.timeout_s - (time.time() - item.sent_at)
                try:
                    verdict = item.response.result(timeout_s=min(max(left, 0.01), _CHECK_EVERY_S))
                except Exception as exc:  # a dead replica, a timeout, a failed batch: send the sample again
                    slow = _not_ready(exc)
                    if slow and left > _CHECK_EVERY_S:  # still judged; meanwhile, did other requests fail?
                        self._check(wanted, done)
                        continue
                    with self.lock:
                        self._retry(key, item, exc)
                    if not slow:  # a replica that died took the other requests it held with it
                        self._check(wanted, done)
                    continue
                with self.lock:
                    done[key] = verdict
                    del self.pending[key]
        return done

    def _check(self, wanted: list[str], done: dict[str, Verdict]) -> None:
        """Without waiting: take the verdicts of `wanted` that are in, and send again at once the samples whose
        request failed (a replica that dies fails all the requests it held), so none waits its turn in
        `collect` to be resent."""
        for key in wanted:
            if key in done:
                continue
            with self.lock:
                item = self.pending[key]
            try:
                verdict = item.response.result(timeout_s=0)
            except Exception as exc:
                if not _not_ready(exc):
                    with self.lock:
                        self._retry(key, item, exc)
                continue
            with self.lock:
                done[key] = verdict
                del self.pending[key]

    def discard(self, keys: Iterable[str]) -> int:
        """Stop waiting for `keys`: their requests are cancelled (best effort: Serve drops a request still
        queued or waiting for its batch; one in a running batch finishes on the replica and its verdict is
        thrown away) and forgotten. Keys that are not pending are skipped (a sample that was never submitted).
        Returns the number dropped."""
        dropped = 0
        with self.lock:
            for key in keys:
                item = self.pending.pop(key, None)
                if item is not None:
                    item.response.cancel()
                    dropped += 1
        return dropped

    def _retry(self, key: str, item: _Pending, exc: Exception) -> None:
        if item.attempts > self.max_retries:
            lost = self.discard(list(self.pending))  # the step fails: nothing stays pending past it
            raise GenRMError(
                f"GenRM failed for sample {key!r} after {item.attempts} attempts ({type(exc).__name__}: {exc}); "
                f"{lost} sample(s) of this step unscored. Check the GenRM replicas' logs, raise "
                "reward.genrm.timeout_s / max_retries, or add replicas"
            ) from exc
        self.retries += 1
        if _not_ready(exc):
            # Still queued or being judged: wait once more on the same request. A resend would join the back of
            # the replicas' queues behind every sample submitted since, and under load time out again.
            log.warning(
                "GenRM request %s is slow (no verdict within %gs); waiting again", key, self.timeout_s
            )
            self.pending[key] = _Pending(item.request, item.response, item.attempts + 1)
            return
        item.response.cancel()
        log.warning("GenRM request %s failed (%s: %s); retrying", key, type(exc).__name__, exc)
        self.pending[key] = _Pending(item.request, self.handle.judge.remote(item.request), item.attempts + 1)


def _not_ready(exc: Exception) -> bool:
    """`result(timeout_s=...)` ran out of time: the request is still queued or being judged (not a judge that
    raised TimeoutError)."""
    from ray.exceptions import RayTaskError

    return isinstance(exc, TimeoutError) and not isinstance(exc, RayTaskError)


def _app_handle(timeout_s: float):
    """The GenRM application's handle, waiting for the driver to deploy it (full coexistence deploys it
    after the training workers start)."""
    from ray import serve

    deadline = time.time() + timeout_s
    while True:
        try:
            return serve.get_app_handle(APP_NAME)
        except Exception as exc:  # not deployed yet
            if time.time() > deadline:
                raise GenRMError(
                    f"the GenRM application {APP_NAME!r} was not running within {timeout_s:g}s ({exc})"
                ) from exc
            time.sleep(0.5)
