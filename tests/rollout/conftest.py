"""Fixtures for the rollout-engine tests: two tiny models (old / new weights) and a plain transformers reference.

The tiny models are pinned here (not the library default, which may change): hidden 64 with 2 query heads /
1 key-value head, i.e. head size 32, the smallest vLLM's CPU attention supports (32, 64, 80, ...).
"""

from __future__ import annotations

import os

import pytest
import torch

# In-process vLLM and a kept compile cache (the first log-prob kernel compiles in ~15 s cold, ~3-8 s warm).
# The engine sets the same defaults itself; setting them here too makes the test environment explicit.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/yatt_ray/inductor"))

from yatt_ray.models.tiny import EOS_ID, TinyModelSpec, build_tiny_model  # noqa: E402
from yatt_ray.rollout.base import GenerateRequest  # noqa: E402


def pytest_configure(config):
    # vLLM's import touches a deprecated torch.distributed alias; nothing to act on here.
    config.addinivalue_line(
        "filterwarnings", "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"
    )


ROLLOUT_SPEC = TinyModelSpec(
    hidden_size=64, intermediate_size=192, num_heads=2, num_kv_heads=1
)  # head size 32
PROMPTS = [
    [1, 10, 11, 12],
    [1, 20, 21],
    [1, 5, 6, 7, 8, 9, 40, 41],
    [1] + [10 + (i % 50) for i in range(40)],  # longer than one 32-token KV block
]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """(old, new): two tiny Llama dirs with different random weights (seeds 0 and 7)."""
    old = build_tiny_model(tmp_path_factory.mktemp("rollout_old"), ROLLOUT_SPEC)
    new = build_tiny_model(
        tmp_path_factory.mktemp("rollout_new"), TinyModelSpec(**{**vars(ROLLOUT_SPEC), "seed": 7})
    )
    return old, new


def _load(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    """(old, new) transformers models: the references."""
    return _load(model_dirs[0]), _load(model_dirs[1])


@pytest.fixture(scope="session")
def eos_heavy_state(hf_models):
    """The old model's weights with an EOS row in lm_head of norm 10: EOS is likely at most steps."""
    state = {k: v.clone() for k, v in hf_models[0].state_dict().items()}
    row = torch.randn(state["lm_head.weight"].shape[1], generator=torch.Generator().manual_seed(0))
    state["lm_head.weight"][EOS_ID] = row / row.norm() * 10
    return state


def reference_greedy(model, prompt: list[int], max_new_tokens: int, stop_ids=(EOS_ID,)) -> list[int]:
    """Argmax decoding with full re-computation at every step (no cache, no padding, no generate())."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token in stop_ids:
            break
    return ids[len(prompt) :]


def reference_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits (temperature 1) at each generated token, teacher-forced."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def buckets(state: dict[str, torch.Tensor], size: int, seed: int = 0) -> list[list[tuple[str, torch.Tensor]]]:
    """The state dict in shuffled buckets of `size` tensors, so fused groups (q/k/v, gate/up) get split."""
    items = list(state.items())
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    shuffled = [items[i] for i in order]
    return [shuffled[i : i + size] for i in range(0, len(shuffled), size)]


LOGPROB_ATOL = 1e-4  # float32 on CPU; observed differences are ~5e-7


def check_greedy(engine, model, max_new_tokens: int = 12, prompts=PROMPTS):
    """Greedy output of `engine` == the reference loop over `model`, token for token, with log-probs within
    LOGPROB_ATOL of the teacher-forced reference; returns the completions."""
    from yatt_ray.rollout import SamplingSpec

    outs = engine.generate(
        GenerateRequest(prompts, SamplingSpec(n=1, max_new_tokens=max_new_tokens, temperature=0.0))
    )
    assert len(outs) == len(prompts)
    for prompt, group in zip(prompts, outs):
        (completion,) = group
        assert completion.token_ids == reference_greedy(model, prompt, max_new_tokens)
        assert len(completion.logprobs) == len(completion.token_ids)
        expected = reference_logprobs(model, prompt, completion.token_ids)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
        stopped = completion.token_ids[-1] == EOS_ID
        assert completion.finish_reason == ("stop" if stopped else "length")
    return outs


def check_stops(outs, n: int, max_new_tokens: int, stop_ids) -> tuple[int, int]:
    """Shape and stop invariants of sampled output; returns (#stop, #length)."""
    counts = {"stop": 0, "length": 0}
    for group in outs:
        assert len(group) == n
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            assert all(lp <= 0.0 for lp in c.logprobs)
            assert not any(t in stop_ids for t in c.token_ids[:-1]), "a stop token inside a completion"
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in stop_ids
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == max_new_tokens
                assert c.token_ids[-1] not in stop_ids
            counts[c.finish_reason] += 1
    return counts["stop"], counts["length"]


def check_ignore_eos(engine, prompts=PROMPTS) -> None:
    """`engine` (loaded with weights that make EOS likely at most steps): `ignore_eos` still runs every
    completion to max_new_tokens ("length"), EOS and the stop ids inside it; the same spec without it stops
    early."""
    from dataclasses import replace

    from yatt_ray.rollout import SamplingSpec

    base = SamplingSpec(n=3, max_new_tokens=8, seed=4, stop_token_ids=(EOS_ID, 50))
    flat = [
        c
        for group in engine.generate(GenerateRequest(prompts, replace(base, ignore_eos=True)))
        for c in group
    ]
    assert len(flat) == 3 * len(prompts)
    assert all(len(c.token_ids) == len(c.logprobs) == 8 and c.finish_reason == "length" for c in flat)
    assert any(EOS_ID in c.token_ids[:-1] for c in flat), "EOS is likely: some completion must hold one"
    stopped = [c for group in engine.generate(GenerateRequest(prompts, base)) for c in group]
    assert any(c.finish_reason == "stop" and len(c.token_ids) < 8 for c in stopped)


def token_ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in group] for group in outs]


# Long-tail prompts: with a fifth of the vocabulary as stop ids, the old model's completions of these end after
# very different numbers of tokens (greedy: 1 to 18, one runs to max_new_tokens), ties included.
TAIL_PROMPTS = PROMPTS + [[1, 30, 31], [1, 60, 61, 62, 63], [1, 90], [1, 3, 4, 5, 6, 7]]
TAIL_STOPS = tuple(range(50, 70))


def group_lengths(outs) -> list[int]:
    """Decoding steps each prompt's group needs: its longest completion."""
    return [max(len(c.token_ids) for c in group) for group in outs]


def first_k_finished(lengths: list[int], k: int) -> set[int]:
    """The prompts done by the step at which the k-th group finishes, when all start together."""
    kth = sorted(lengths)[k - 1]
    return {i for i, length in enumerate(lengths) if length <= kth}


def check_finish_after(engine, spec, k: int, expected=None, prompts=TAIL_PROMPTS):
    """`generate(finish_after=k)` against a `finish_after=None` run of the same seed (the reference).

    Finished prompts are exactly `expected(reference_lengths, k)` (default `first_k_finished`: every prompt
    as short as the k-th shortest, so at least k, ties kept); their groups equal the reference's (tokens,
    log-probs, finish reasons), so completions stopped inside an aborted batch are cut right; every other
    prompt is None and was longer in the reference; `on_finished` saw each finished prompt once;
    `last_aborted` counts the Nones; and the next call gives the reference again (no leftovers).
    Returns (outs, reference, the prompt indices in `on_finished` order).
    """
    reference = engine.generate(GenerateRequest(prompts, spec))
    assert engine.last_aborted == 0
    lengths = group_lengths(reference)
    want = (expected or first_k_finished)(lengths, k)
    seen: list[int] = []
    outs = engine.generate(
        GenerateRequest(prompts, spec, finish_after=k), on_finished=lambda i, g: seen.append(i)
    )
    assert len(outs) == len(prompts)
    finished = {i for i, group in enumerate(outs) if group is not None}
    assert finished == want, (finished, want, lengths)
    assert len(finished) >= k
    assert sorted(seen) == sorted(finished)
    assert engine.last_aborted == len(prompts) - len(finished)
    kth = sorted(lengths)[k - 1]
    for i, group in enumerate(outs):
        if group is None:
            assert expected or lengths[i] > kth, (i, lengths)  # one batch: only a straggler is aborted
            continue
        assert [(c.token_ids, c.finish_reason) for c in group] == [
            (c.token_ids, c.finish_reason) for c in reference[i]
        ]
        for c, r in zip(group, reference[i]):
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)
    again = engine.generate(GenerateRequest(prompts, spec))
    assert engine.last_aborted == 0
    assert token_ids(again) == token_ids(reference)
    return outs, reference, seen


@pytest.fixture(scope="session")
def ref():
    """The reference helpers, as a fixture (test modules do not import conftest)."""

    class Ref:
        greedy = staticmethod(reference_greedy)
        logprobs = staticmethod(reference_logprobs)
        buckets = staticmethod(buckets)
        check_greedy = staticmethod(check_greedy)
        check_stops = staticmethod(check_stops)
        check_ignore_eos = staticmethod(check_ignore_eos)
        token_ids = staticmethod(token_ids)
        group_lengths = staticmethod(group_lengths)
        first_k_finished = staticmethod(first_k_finished)
        check_finish_after = staticmethod(check_finish_after)
        prompts = PROMPTS
        tail_prompts = TAIL_PROMPTS
        tail_stops = TAIL_STOPS

    return Ref


@pytest.fixture
def old_weights(engine, hf_models):
    """Every test starts from (and leaves) the old model's weights; `engine` is each test module's own."""
    engine.load_weights(hf_models[0].state_dict().items())
    yield
    engine.load_weights(hf_models[0].state_dict().items())
    engine.finish_weight_sync()
