"""The Hugging Face `generate` engine against a plain transformers reference."""

from __future__ import annotations

import pytest
import torch

from yatt_ray.errors import ConfigError, YattError
from yatt_ray.models.tiny import EOS_ID
from yatt_ray.rollout import GenerateRequest, SamplingSpec
from yatt_ray.rollout.hf_engine import HFEngine


@pytest.fixture(scope="module")
def engine(model_dirs):
    engine = HFEngine(model_dirs[0], seed=0, device="cpu")
    yield engine
    engine.close()


def test_greedy_matches_reference_loop_with_left_padding(engine, hf_models, ref, old_weights):
    ref.check_greedy(engine, hf_models[0])  # 4 prompts of lengths 3..41 in one left-padded batch


def test_batch_chunks_change_nothing(model_dirs, hf_models, ref):
    small = HFEngine(model_dirs[0], device="cpu", max_batch_size=1)
    try:
        ref.check_greedy(small, hf_models[0])
    finally:
        small.close()


def test_streamed_groups_arrive_after_each_batch(model_dirs, ref):
    small = HFEngine(model_dirs[0], device="cpu", max_batch_size=4)  # 2 prompts x n=2 per batch
    try:
        order: list[int] = []
        spec = SamplingSpec(n=2, max_new_tokens=4, seed=3)
        streamed = small.generate(
            GenerateRequest(ref.prompts, spec), on_finished=lambda i, g: order.append(i)
        )
        assert order == list(range(len(ref.prompts)))
        assert ref.token_ids(streamed) == ref.token_ids(small.generate(GenerateRequest(ref.prompts, spec)))
    finally:
        small.close()


def test_sampling_shapes_seeds_and_stops(engine, ref, eos_heavy_state, old_weights):
    engine.load_weights(eos_heavy_state.items())
    spec = SamplingSpec(n=4, max_new_tokens=4, temperature=1.0, seed=11)
    before = torch.get_rng_state()
    first = engine.generate(GenerateRequest(ref.prompts, spec))
    assert torch.equal(torch.get_rng_state(), before), "generate moved the global torch RNG"
    stops, lengths = ref.check_stops(first, n=4, max_new_tokens=4, stop_ids={EOS_ID})
    assert stops > 0 and lengths > 0, (stops, lengths)
    assert ref.token_ids(engine.generate(GenerateRequest(ref.prompts, spec))) == ref.token_ids(
        first
    )  # same seed, same samples
    other = engine.generate(GenerateRequest(ref.prompts, SamplingSpec(n=4, max_new_tokens=4, seed=12)))
    assert ref.token_ids(other) != ref.token_ids(first)
    unseeded = SamplingSpec(n=4, max_new_tokens=4)
    assert ref.token_ids(engine.generate(GenerateRequest(ref.prompts, unseeded))) != ref.token_ids(
        engine.generate(GenerateRequest(ref.prompts, unseeded))
    )


def test_stop_token_ids_end_completions(engine, ref, old_weights):
    stop_ids = set(range(40, 104))  # half the vocabulary: most completions stop within a few tokens
    spec = SamplingSpec(n=3, max_new_tokens=6, seed=0, stop_token_ids=tuple(sorted(stop_ids)))
    stops, _ = ref.check_stops(engine.generate(GenerateRequest(ref.prompts, spec)), 3, 6, stop_ids | {EOS_ID})
    assert stops > 0


def test_log_probs_are_raw_at_any_temperature_and_top_k(engine, hf_models, ref, old_weights):
    spec = SamplingSpec(n=2, max_new_tokens=6, temperature=0.5, top_k=5, top_p=0.9, seed=1)
    for prompt, group in zip(ref.prompts, engine.generate(GenerateRequest(ref.prompts, spec))):
        for c in group:
            expected = ref.logprobs(hf_models[0], prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_weight_sync_in_buckets(engine, hf_models, ref, old_weights):
    for bucket in ref.buckets(hf_models[1].state_dict(), size=3):
        engine.load_weights(bucket)
    engine.finish_weight_sync()
    ref.check_greedy(engine, hf_models[1])


def test_weight_sync_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(ConfigError, match="not parameters of the model.*decoder.layers.0.weight"):
        engine.load_weights([("decoder.layers.0.weight", torch.zeros(1))])
    with pytest.raises(ConfigError, match=r"model.norm.weight has shape \(3,\), the model expects \(64,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


def test_sleep_wake_round_trip(engine, ref, old_weights):
    request = GenerateRequest(ref.prompts, SamplingSpec(n=2, max_new_tokens=8, seed=4))
    before = engine.generate(request)
    engine.sleep()
    with pytest.raises(YattError, match="asleep"):
        engine.generate(request)
    engine.wake()
    after = engine.generate(request)
    assert [[(c.token_ids, c.logprobs) for c in g] for g in after] == [
        [(c.token_ids, c.logprobs) for c in g] for g in before
    ]


def test_closed_engine_refuses_work(model_dirs):
    engine = HFEngine(model_dirs[0], device="cpu")
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(YattError, match="after close"):
        engine.generate(GenerateRequest([[1]], SamplingSpec(n=1, max_new_tokens=1)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_matches_reference_and_sleep_frees_the_device(model_dirs, hf_models, ref):
    engine = HFEngine(model_dirs[0], device="cuda")
    try:
        ref.check_greedy(engine, hf_models[0])  # reference on the CPU, engine on the GPU
        spec = SamplingSpec(n=2, max_new_tokens=8, seed=4)
        before = engine.generate(GenerateRequest(ref.prompts, spec))
        cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state()
        engine.generate(GenerateRequest(ref.prompts, SamplingSpec(n=2, max_new_tokens=8)))
        assert torch.equal(torch.get_rng_state(), cpu_rng) and torch.equal(
            torch.cuda.get_rng_state(), cuda_rng
        )
        allocated = torch.cuda.memory_allocated()
        engine.sleep()
        assert torch.cuda.memory_allocated() < allocated
        engine.wake()
        assert ref.token_ids(engine.generate(GenerateRequest(ref.prompts, spec))) == ref.token_ids(before)
        for bucket in ref.buckets(hf_models[1].state_dict(), size=3):
            engine.load_weights(bucket)  # CPU tensors into a CUDA model
        ref.check_greedy(engine, hf_models[1])
    finally:
        engine.close()


def test_ignore_eos_generates_fixed_length_completions(engine, ref, eos_heavy_state, old_weights):
    """`ignore_eos` runs every completion to max_new_tokens, EOS-heavy weights or not (`check_ignore_eos`)."""
    engine.load_weights(eos_heavy_state.items())
    ref.check_ignore_eos(engine)


def _chunked_first_k(chunk_prompts: int):
    """The prompts `finish_after=k` keeps when batches of `chunk_prompts` prompts run one after another:
    whole batches while fewer than k are done, then the batch that reaches k stops at its deciding step."""

    def expected(lengths: list[int], k: int) -> set[int]:
        done: set[int] = set()
        for start in range(0, len(lengths), chunk_prompts):
            if len(done) >= k:
                break
            batch = lengths[start : start + chunk_prompts]
            need = k - len(done)
            kth = sorted(batch)[need - 1] if need <= len(batch) else max(batch)
            done |= {start + j for j, length in enumerate(batch) if length <= kth}
        return done

    return expected


@pytest.mark.parametrize("k", [1, 3, 5])
def test_finish_after_stops_the_batch_once_k_prompts_are_done(engine, ref, old_weights, k):
    """Greedy (HF sampling depends on the batch): one batch of 8 prompts whose greedy groups end after 1 to
    24 tokens; k=1 keeps the two that stop at the first step."""
    spec = SamplingSpec(n=1, max_new_tokens=24, temperature=0.0, stop_token_ids=ref.tail_stops)
    outs, reference, _ = ref.check_finish_after(engine, spec, k)
    assert None in outs, ref.group_lengths(reference)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_finish_after_counts_earlier_batches_and_skips_later_ones(model_dirs, ref, k):
    """Batches of 2 prompts x n=2: groups done in earlier batches count, later batches never run; a batch
    stopped mid-way keeps the rows that hit a stop token, cut there (n=2 greedy rows are equal)."""
    small = HFEngine(model_dirs[0], device="cpu", max_batch_size=4)
    try:
        spec = SamplingSpec(n=2, max_new_tokens=24, temperature=0.0, stop_token_ids=ref.tail_stops)
        ref.check_finish_after(small, spec, k, expected=_chunked_first_k(2))
    finally:
        small.close()


def test_finish_after_counts_length_finished_prompts(model_dirs, ref):
    """With `ignore_eos` every row ends by length: the first batch's two prompts are done, so k=2 skips the
    rest; k=4 (all prompts) aborts nothing."""
    small = HFEngine(model_dirs[0], device="cpu", max_batch_size=2)
    try:
        spec = SamplingSpec(n=1, max_new_tokens=3, seed=1, ignore_eos=True)
        outs = small.generate(GenerateRequest(ref.prompts, spec, finish_after=2))
        assert [g is not None for g in outs] == [True, True, False, False] and small.last_aborted == 2
        assert all(c.finish_reason == "length" and len(c.token_ids) == 3 for g in outs[:2] for c in g)
        assert ref.token_ids(outs[:2]) == ref.token_ids(
            small.generate(GenerateRequest(ref.prompts, spec))[:2]
        )
        assert (
            None not in small.generate(GenerateRequest(ref.prompts, spec, finish_after=4))
            and small.last_aborted == 0
        )
    finally:
        small.close()


def test_finish_after_waits_for_the_prompts_it_must_keep(engine, ref, old_weights):
    """`wait_for`: the longest prompt is kept with k=1 (the engine runs until it is done); the others that
    finished by then are kept too, the rest aborted."""
    spec = SamplingSpec(n=1, max_new_tokens=24, temperature=0.0, stop_token_ids=ref.tail_stops)
    lengths = ref.group_lengths(engine.generate(GenerateRequest(ref.tail_prompts, spec)))
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    outs = engine.generate(
        GenerateRequest(ref.tail_prompts, spec, finish_after=1, wait_for=frozenset({longest}))
    )
    assert outs[longest] is not None and len(outs[longest][0].token_ids) == lengths[longest]


def test_a_restored_sampling_stream_samples_what_the_uninterrupted_one_does(model_dirs, ref):
    """What a checkpoint keeps of the engine (`rng_state`): a fresh engine given it samples, at temperature 1,
    exactly what the first engine samples next; without it, something else."""
    spec = SamplingSpec(n=4, max_new_tokens=6, temperature=1.0)  # unseeded: the engine's own stream
    request = GenerateRequest(ref.prompts, spec)
    first = HFEngine(model_dirs[0], seed=0, device="cpu")
    resumed = HFEngine(model_dirs[0], seed=0, device="cpu")
    try:
        first.generate(request)  # step k
        saved = first.rng_state()
        uninterrupted = ref.token_ids(first.generate(request))  # step k + 1
        fresh = ref.token_ids(resumed.generate(request))  # a restart without the stream: step k again
        assert fresh != uninterrupted
        resumed.set_rng_state(saved)
        assert ref.token_ids(resumed.generate(request)) == uninterrupted
    finally:
        first.close()
        resumed.close()


def test_new_weights_in_flight_continue_each_completion_with_its_prefix(engine, hf_models, ref, old_weights):
    """Weights swapped after the 3rd token: each greedy completion is the old model's first 3 tokens, then
    the new model's greedy continuation of prompt + those tokens; log-probs and version labels follow."""
    old, new = hf_models

    class Updates:  # new weights become ready after the 3rd token (asked before each decode forward)
        asked = 0

        def ready(self) -> bool:
            self.asked += 1
            return self.asked == 3

        def take(self) -> str:
            engine.load_weights(new.state_dict().items())
            engine.finish_weight_sync()
            return "v1"

    spec = SamplingSpec(n=2, max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outs = engine.generate(GenerateRequest(ref.prompts, spec), updates=Updates(), version="v0")
    for prompt, group in zip(ref.prompts, outs):
        head = ref.greedy(old, prompt, 3, stop_ids=())
        expected = head + ref.greedy(new, prompt + head, 5, stop_ids=())
        for c in group:
            assert c.token_ids == expected
            assert c.versions == ["v0"] * 3 + ["v1"] * 5
            torch.testing.assert_close(
                torch.tensor(c.logprobs[3:]),
                ref.logprobs(new, prompt + head, c.token_ids[3:]),
                atol=1e-4,
                rtol=0,
            )
            torch.testing.assert_close(
                torch.tensor(c.logprobs[:3]), ref.logprobs(old, prompt, head), atol=1e-4, rtol=0
            )


def test_each_prompt_is_prefilled_once_and_finished_rows_leave(engine, ref, old_weights):
    """The model runs sum_p |p| + sum_rows (|completion| - 1) token positions, not n x each prompt plus
    every row until the longest is done (transformers' generate)."""
    positions: list[int] = []
    hook = engine._model.model.embed_tokens.register_forward_hook(
        lambda m, args, out: positions.append(args[0].numel())
    )
    try:
        spec = SamplingSpec(n=4, max_new_tokens=6, seed=0, stop_token_ids=tuple(range(40, 104)))
        outs = engine.generate(GenerateRequest(ref.prompts, spec))
    finally:
        hook.remove()
    width = max(len(p) for p in ref.prompts)
    completions = [c for group in outs for c in group]
    assert any(len(c.token_ids) < 6 for c in completions) and any(len(c.token_ids) > 1 for c in completions)
    assert sum(positions) == len(ref.prompts) * width + sum(len(c.token_ids) - 1 for c in completions)
