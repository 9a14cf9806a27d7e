"""A verifiable task with a long tail of response lengths: copy a random string back.

Each row's `prompt` is a random string followed by ">" (e.g. "qkzw>"), its `ground_truth` the string itself
("qkzw"), `data_source` "longtail", plus a unique `id`. The answer is as long as the string (plus EOS), so a
policy that has learnt to copy answers with the strings' lengths, and those are heavy-tailed: most answers are
a few tokens, a few are over 100. That is the workload long-tail control (over-sampling with abort of the
stragglers, `rollout.over_sample`) and data-parallel balancing (`train.balance`) are made for. The warm-up
teaches the model to copy the string once or more (`warmup_answer`: K copies joined by ">", K - 1 geometric
with mean 1), so lengths also vary from sample to sample of one prompt, as real generations do. The rule
reward is `repeat_match` (`yatt_ray.reward.rules`): 1.0 for the string once or repeated, else the matched
prefix over the longer of response and nearest repeated answer (< 1), so partial copies still give GRPO a
signal.

Lengths: L = clip(round(exp(N(ln 8, 1.1^2))), 2, 120), a log-normal with median 8 clipped to [2, 120]. Over
100,000 draws (seed 0) the quantiles of L are

    p10   p25   p50   p75   p90   p95   p99   max    mean
      2     4     8    17    33    49   104   120    14.4

1.1% of the strings have 100 characters or more (0.7% sit at the cap of 120), and the longest 10% of the
prompts hold 41% of all answer tokens. The characters are drawn uniformly from `ALPHABET`, the 26 lower-case
letters: one token each in the tiny character-level tokenizer (`yatt_ray.models.tiny`). With BOS a prompt is
L + 2 tokens (at most 122) and its answer L + 1 with EOS (at most 121).
"""

from __future__ import annotations

import math
import random
import string

DATA_SOURCE = "longtail"
ALPHABET = string.ascii_lowercase
SEPARATOR = ">"  # ends the string in the prompt (not in the alphabet): where the copy stops
MEDIAN_LENGTH = 8
SIGMA = 1.1  # standard deviation of ln L before clipping
MIN_LENGTH, MAX_LENGTH = 2, 120
REPEAT = 0.5  # the warm-up's answers run on: after each copy, another one follows with this probability
MAX_ANSWER = 120  # characters of a warm-up answer, repeats and separators included


def warmup_answer(text: str, rng: random.Random, repeat: float = REPEAT, max_answer: int = MAX_ANSWER) -> str:
    """The supervised target for `text`: the string K times joined by SEPARATOR, K - 1 ~ Geometric(repeat)
    (P(K = k) = (1 - repeat) repeat^(k-1), mean 1 / (1 - repeat)), K capped so the answer fits `max_answer`
    (at least once). A policy warmed up on it samples its own number of copies, so one prompt's samples have
    different lengths (L, 2L + 1, 3L + 2, ...): the per-sample long tail of real generations."""
    cap = max(1, (max_answer + 1) // (len(text) + 1))
    copies = 1
    while copies < cap and rng.random() < repeat:
        copies += 1
    return SEPARATOR.join([text] * copies)


def sample_length(
    rng: random.Random,
    median: float = MEDIAN_LENGTH,
    sigma: float = SIGMA,
    min_length: int = MIN_LENGTH,
    max_length: int = MAX_LENGTH,
) -> int:
    """One string length: round(exp(N(ln median, sigma^2))) clipped to [min_length, max_length]."""
    return min(max_length, max(min_length, round(math.exp(rng.gauss(math.log(median), sigma)))))


def make_problems(
    count: int,
    seed: int,
    id_offset: int = 0,
    median: float = MEDIAN_LENGTH,
    sigma: float = SIGMA,
    min_length: int = MIN_LENGTH,
    max_length: int = MAX_LENGTH,
    alphabet: str = ALPHABET,
) -> list[dict]:
    """`count` copy problems with heavy-tailed string lengths (module docstring), drawn with a fixed seed.

    Rows: {"id": id_offset + i, "prompt": "<string>>", "ground_truth": "<string>", "data_source": "longtail"}.
    `sigma=0` gives every string the median's length (clipped to [min_length, max_length]).
    """
    if not (median >= 1 and sigma >= 0 and 1 <= min_length <= max_length):
        raise ValueError(
            "need median >= 1, sigma >= 0 and 1 <= min_length <= max_length; got "
            f"median={median}, sigma={sigma}, min_length={min_length}, max_length={max_length}"
        )
    if not alphabet or SEPARATOR in alphabet or any(c.isspace() for c in alphabet):
        raise ValueError(f"alphabet {alphabet!r} must be non-empty, without white space or {SEPARATOR!r}")
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        length = sample_length(rng, median, sigma, min_length, max_length)
        text = "".join(rng.choice(alphabet) for _ in range(length))
        rows.append(
            {
                "id": id_offset + i,
                "prompt": text + SEPARATOR,
                "ground_truth": text,
                "data_source": DATA_SOURCE,
            }
        )
    return rows
