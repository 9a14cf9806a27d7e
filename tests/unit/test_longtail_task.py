"""The longtail demo task: rows, their heavy-tailed lengths, the prefix_match reward and the demo's dispatch."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from yatt_ray import load_config
from yatt_ray.config import DemoConfig
from yatt_ray.errors import ConfigError
from yatt_ray.models.tiny import BOS_ID, UNK_ID, build_tokenizer
from yatt_ray.reward.rules import check_reward_fn, prefix_match, repeat_match, resolve_reward_fn
from yatt_ray.tasks import arithmetic, longtail
from yatt_ray.tasks.demo import (
    LONGTAIL_MAX_POSITIONS,
    _build_warm_model,
    demo_cache_dir,
    demo_problems,
    prepare_demo,
)

CONFIG = Path(__file__).parents[2] / "examples" / "configs" / "grpo_longtail.yaml"


def _lengths(count: int = 20000, seed: int = 0) -> list[int]:
    return sorted(len(r["ground_truth"]) for r in longtail.make_problems(count, seed))


def _quantile(values: list[int], q: float) -> int:
    return values[min(int(q * len(values)), len(values) - 1)]


def test_rows_are_deterministic_by_seed():
    assert longtail.make_problems(50, seed=3) == longtail.make_problems(50, seed=3)
    assert longtail.make_problems(50, seed=3) != longtail.make_problems(50, seed=4)
    assert (
        longtail.make_problems(10, seed=3) == longtail.make_problems(50, seed=3)[:10]
    )  # a prefix of the stream


def test_row_schema():
    rows = longtail.make_problems(500, seed=1, id_offset=1000)
    assert [r["id"] for r in rows] == list(range(1000, 1500))
    for r in rows:
        assert set(r) == {"id", "prompt", "ground_truth", "data_source"}  # the arithmetic task's columns
        assert r["data_source"] == "longtail"
        assert r["prompt"] == r["ground_truth"] + longtail.SEPARATOR
        assert set(r["ground_truth"]) <= set(longtail.ALPHABET)
        assert longtail.MIN_LENGTH <= len(r["ground_truth"]) <= longtail.MAX_LENGTH
    assert set(arithmetic.make_problems(1, seed=0)[0]) == set(rows[0])


def test_lengths_are_heavy_tailed():
    lengths = _lengths()
    median, p90, p99 = (_quantile(lengths, q) for q in (0.5, 0.9, 0.99))
    assert 7 <= median <= 9  # most answers are short ...
    assert _quantile(lengths, 0.25) <= 5
    assert 25 <= p90 <= 40
    assert p99 >= 90  # ... a few are very long
    assert lengths[0] == longtail.MIN_LENGTH and lengths[-1] == longtail.MAX_LENGTH
    assert 0.005 <= sum(n >= 100 for n in lengths) / len(lengths) <= 0.03
    assert statistics.mean(lengths) >= 1.6 * median  # the mean is pulled up by the tail
    top_tenth = lengths[int(0.9 * len(lengths)) :]
    assert sum(top_tenth) >= 0.35 * sum(lengths)  # the longest 10% of prompts hold over a third of the tokens


def test_length_parameters():
    rows = longtail.make_problems(200, seed=0, sigma=0.0, median=12)
    assert {len(r["ground_truth"]) for r in rows} == {12}
    rng = random.Random(0)
    assert all(3 <= longtail.sample_length(rng, min_length=3, max_length=5) <= 5 for _ in range(200))
    with pytest.raises(ValueError):
        longtail.make_problems(1, seed=0, alphabet="ab>")
    with pytest.raises(ValueError):
        longtail.make_problems(1, seed=0, min_length=5, max_length=4)


def test_prompts_tokenize_one_token_per_character_and_fit_the_example_config():
    tokenizer = build_tokenizer()
    config = load_config(CONFIG)
    longest = max(longtail.make_problems(3000, seed=0), key=lambda r: len(r["prompt"]))
    assert len(longest["ground_truth"]) == longtail.MAX_LENGTH
    ids = tokenizer(longest["prompt"])["input_ids"]
    assert ids[0] == BOS_ID and len(ids) == longtail.MAX_LENGTH + 2 and UNK_ID not in ids
    answer = tokenizer(longest["ground_truth"], add_special_tokens=False)["input_ids"]
    assert len(answer) == longtail.MAX_LENGTH
    assert len(ids) <= config.data.max_prompt_tokens  # no prompt is clipped
    assert len(answer) + 1 <= config.rollout.max_new_tokens  # the longest answer and its EOS fit
    assert config.data.max_prompt_tokens + config.rollout.max_new_tokens <= LONGTAIL_MAX_POSITIONS


def test_example_config():
    config = load_config(CONFIG)
    assert config.demo.task == "longtail" and config.reward.function == "repeat_match"
    assert config.rollout.over_sample == 1.25 and config.train.balance == "tokens"
    assert resolve_reward_fn(config.reward.function) is repeat_match


def test_repeat_match_accepts_the_string_repeated_and_grades_the_rest():
    assert repeat_match("abc", "abc") == 1.0 and repeat_match("abc>abc>abc", "abc") == 1.0
    assert repeat_match("abc>abd", "abc") == pytest.approx(6 / 7)  # against "abc>abc": 6 of 7 match
    assert repeat_match("ab", "abc") == pytest.approx(2 / 3) and repeat_match("", "abc") == 0.0


def test_the_warm_up_answers_repeat_the_string_a_geometric_number_of_times():
    import random

    rng = random.Random(0)
    answers = [longtail.warmup_answer("abcd", rng) for _ in range(4000)]
    copies = [a.count(">") + 1 for a in answers]
    assert all(a == ">".join(["abcd"] * k) for a, k in zip(answers, copies))
    assert 1.9 < sum(copies) / len(copies) < 2.1  # mean 1 / (1 - 0.5)
    assert max(len(longtail.warmup_answer("x" * 100, rng)) for _ in range(200)) <= longtail.MAX_ANSWER


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("abc", "abc", 1.0),
        (" abc\n", "abc", 1.0),  # surrounding white space is ignored, as in exact_match
        ("abd", "abc", 2 / 3),  # wrong last character
        ("ab", "abc", 2 / 3),  # stopped early
        ("abcd", "abc", 3 / 4),  # ran on past the answer
        ("xbc", "abc", 0.0),  # wrong first character: nothing after it counts
        ("", "abc", 0.0),
        ("a" * 59 + "b" + "a" * 60, "a" * 120, 59 / 120),
    ],
)
def test_prefix_match_hand_cases(response, truth, expected):
    assert prefix_match(response, truth, "longtail") == pytest.approx(expected)


def test_prefix_match_is_below_one_unless_exact():
    rng = random.Random(0)
    for row in longtail.make_problems(300, seed=5):
        truth = row["ground_truth"]
        cut = rng.randrange(len(truth))
        for response in (truth[:cut], truth + "a", truth[:cut] + "?" + truth[cut + 1 :]):
            assert 0.0 <= prefix_match(response, truth) < 1.0
    assert check_reward_fn(prefix_match, "prefix_match", "abc", "longtail") == (1.0, 0.0)


def test_demo_dispatches_on_the_task(tmp_path, monkeypatch):
    arithmetic_demo, longtail_demo = DemoConfig(), DemoConfig(task="longtail")
    assert demo_problems(arithmetic_demo, 20, seed=3) == arithmetic.make_problems(20, seed=3, max_operand=19)
    assert demo_problems(longtail_demo, 20, seed=3, id_offset=7) == longtail.make_problems(
        20, seed=3, id_offset=7
    )
    monkeypatch.setenv("YATT_RAY_CACHE", str(tmp_path))
    assert demo_cache_dir(arithmetic_demo) != demo_cache_dir(longtail_demo)  # the task is in the cache key


def test_demo_writes_longtail_data(tmp_path, monkeypatch):
    monkeypatch.setenv("YATT_RAY_CACHE", str(tmp_path))
    config = load_config(CONFIG, ["demo.train_prompts=64", "demo.eval_prompts=8"])
    model_dir = demo_cache_dir(config.demo) / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text("{}")  # a cached model: nothing is trained here
    prepare_demo(config)
    import pyarrow.parquet as pq

    train = pq.read_table(config.data.train_files[0]).to_pylist()
    assert train == longtail.make_problems(64, seed=config.train.seed + 100)
    evals = pq.read_table(config.data.eval_files[0]).to_pylist()
    assert [r["id"] for r in evals] == list(range(10**8, 10**8 + 8))
    assert {r["data_source"] for r in train + evals} == {"longtail"}


def test_longtail_demo_refuses_the_arithmetic_judge(tmp_path, monkeypatch):
    monkeypatch.setenv("YATT_RAY_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="reward.genrm.path"):
        prepare_demo(load_config(CONFIG, ["reward.mode=genrm"]))


def test_longtail_warm_up_builds_a_model_with_room_for_the_task(tmp_path):
    _build_warm_model(tmp_path / "model", DemoConfig(task="longtail", sft_steps=2))
    shape = json.loads((tmp_path / "model" / "config.json").read_text())
    assert shape["max_position_embeddings"] == LONGTAIL_MAX_POSITIONS
    assert not (tmp_path / "model.tmp").exists()
