"""One reward per sample from the rule function, the GenRM verdict, or a weighted mix of both.

    reward.mode = rule   r = rule(response, ground_truth, data_source)
    reward.mode = genrm  r = genrm verdict score in [0, 1]
    reward.mode = mix    r = (1 - w) * rule + w * genrm,  w = reward.genrm_weight

A verdict the parser cannot read is counted (`genrm/parse_failures`) and replaced per
`reward.genrm.on_parse_error`: zero (0.0), rule (that sample's rule reward) or raise (GenRMError).
A rule function that raises on a sample is handled per `reward.on_error`: raise (RewardError naming the
sample) or zero (rule reward 0.0, counted in `reward/errors`); a non-numeric or NaN return always raises.

Nothing outlives its step: `scores` reads exactly the verdicts of the samples it is given (the others go on
being judged), `discard` cancels and forgets the samples a step submitted but does not score (in partial
coexistence the streamed samples of a group that finished past the need), and a failed `scores` drops its
samples' requests. `held()` counts what is still awaited; it is 0 at the end of every step
(`genrm/held`), however long the run. With asynchronous rollout (`rollout.max_staleness` = K > 0) the
samples of up to K - 1 later steps are being judged ahead at the end of a step: they belong to those steps
and are counted apart (`genrm/ahead`, by the key prefixes in `ahead`), not as held.
"""

from __future__ import annotations

from dataclasses import dataclass

from yatt_ray.config import RewardConfig
from yatt_ray.reward.client import GenRMClient, GenRMError
from yatt_ray.reward.genrm import JudgeRequest, Verdict
from yatt_ray.reward.rules import resolve_reward_fn, rule_rewards


@dataclass(frozen=True)
class Sample:
    """What scoring needs of one sample; `key` is unique within the run (the GenRM retry key)."""

    key: str
    prompt: str
    response: str
    ground_truth: str
    data_source: str


def combine(rule: float | None, genrm: float | None, mode: str, weight: float) -> float:
    """The sample's reward per `reward.mode` (see the module docstring); the needed parts are not None."""
    if mode == "rule":
        assert rule is not None
        return rule
    assert genrm is not None
    if mode == "genrm":
        return genrm
    assert rule is not None
    return (1.0 - weight) * rule + weight * genrm


def resolve_verdict(verdict: Verdict, rule: float | None, policy: str) -> tuple[float, bool]:
    """(score, parse_failed) for one verdict under the parse-error policy."""
    if verdict.score is not None:
        return float(verdict.score), False
    if policy == "raise":
        raise GenRMError(
            f"GenRM verdict {verdict.text[:80]!r} for sample {verdict.key!r} could not be parsed; fix the judge "
            "template / reward.genrm.parser, or set reward.genrm.on_parse_error to zero or rule"
        )
    if policy == "rule":
        assert rule is not None
        return rule, True
    return 0.0, True


class RewardScorer:
    """Scores samples for one controller. `submit` early (GenRM starts judging), `scores` when needed."""

    def __init__(self, config: RewardConfig, connect_timeout_s: float) -> None:
        self.config = config
        self.rule_fn = resolve_reward_fn(config.function)
        self.uses_rule = config.mode != "genrm" or config.genrm.on_parse_error == "rule"
        self.client: GenRMClient | None = None
        if config.mode != "rule":
            self.client = GenRMClient(config.genrm.timeout_s, config.genrm.max_retries, connect_timeout_s)
        self.parse_failures = 0
        self.rule_errors = 0  # samples the rule function raised on (reward.on_error=zero)
        self.discarded = 0  # submitted samples dropped unscored (their group was not taken)
        # key prefixes of later steps generated ahead and not collected yet (asynchronous rollout): their
        # samples are judged ahead, counted in `genrm/ahead`, not in `genrm/held`
        self.ahead: set[str] = set()

    def submit(self, samples: list[Sample]) -> None:
        if self.client is not None:
            self.client.submit([JudgeRequest(s.key, s.prompt, s.response, s.ground_truth) for s in samples])

    def scores(self, samples: list[Sample]) -> list[float]:
        """Rewards in `samples` order; every sample must have been submitted, and is scored once (GenRM
        modes). Waits for these samples' verdicts only. On an error, their requests are dropped too."""
        try:
            return self._scores(samples)
        except BaseException:
            self.discard(samples)  # the step fails: none of its requests stays pending
            raise

    def discard(self, samples: list[Sample]) -> None:
        """Drop `samples` unscored: cancel their GenRM requests and forget them (the ones never submitted are
        skipped). For samples submitted early whose group the step does not take; counted in
        `genrm/discarded`. A later `scores` of one of them raises `GenRMError`."""
        if self.client is not None:
            self.discarded += self.client.discard(s.key for s in samples)

    def held(self) -> int:
        """Samples submitted and neither scored nor discarded (their requests still held by the client), less
        those of later steps judged ahead (keys under a prefix in `ahead`)."""
        return self._pending()[0]

    def _pending(self) -> tuple[int, int]:
        """(held, judged ahead) from one look at the client's requests (a thread may be submitting)."""
        if self.client is None:
            return 0, 0
        with self.client.lock:
            keys = list(self.client.pending)
        prefixes = tuple(self.ahead)
        ahead = sum(key.startswith(prefixes) for key in keys) if prefixes else 0
        return len(keys) - ahead, ahead

    def _scores(self, samples: list[Sample]) -> list[float]:
        items = [(s.response, s.ground_truth, s.data_source) for s in samples]
        rules: list[float | None] = [None] * len(items)
        if self.uses_rule:
            scores, errors = rule_rewards(self.rule_fn, items, self.config.function, self.config.on_error)
            rules, self.rule_errors = list(scores), self.rule_errors + errors
        if self.client is None:
            return [float(r) for r in rules]  # type: ignore[arg-type]
        verdicts = self.client.collect(s.key for s in samples)
        out = []
        for s, rule in zip(samples, rules):
            verdict = verdicts[s.key]
            genrm, failed = resolve_verdict(verdict, rule, self.config.genrm.on_parse_error)
            self.parse_failures += failed
            out.append(combine(rule, genrm, self.config.mode, self.config.genrm_weight))
        return out

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call: `reward/errors` (the rule function raised; reward.on_error=zero) and
        the GenRM counters: parse failures, retries, samples discarded unscored, `genrm/held` (samples
        still awaited: 0 once the step has scored or discarded all it submitted) and `genrm/ahead` (samples of
        later steps being judged ahead: asynchronous rollout only). The keys follow from the config alone (the
        controllers sum them collectively)."""
        stats: dict[str, float] = {}
        if self.uses_rule and self.config.on_error == "zero":
            stats["reward/errors"] = float(self.rule_errors)
            self.rule_errors = 0
        if self.client is None:
            return stats
        stats["genrm/parse_failures"] = float(self.parse_failures)
        stats["genrm/retries"] = float(self.client.retries)
        stats["genrm/discarded"] = float(self.discarded)
        held, ahead = self._pending()
        stats["genrm/held"], stats["genrm/ahead"] = float(held), float(ahead)
        self.parse_failures, self.client.retries, self.discarded = 0, 0, 0
        return stats
