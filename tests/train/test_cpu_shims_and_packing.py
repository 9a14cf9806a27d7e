"""CPU shims (Megatron's RNG tracker on the CPU generator, oneDNN linear layers) and shared-prefix packing."""

import subprocess
import sys

import pytest
import torch

from yatt_ray.train import apply_cpu_shims, pack_shared_prefix
from yatt_ray.train.cpu_shims import OneDnnLinear, onednn_linear_available, weight_grad
from yatt_ray.train.kernels import WGRAD, KernelChoice, apply_kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are a no-op with CUDA")
def test_shims_are_idempotent_and_seed_distinct_tracker_states(single_process_world):
    from megatron.core import tensor_parallel

    assert apply_cpu_shims() and apply_cpu_shims()
    assert torch.cuda.current_device() == "cpu"
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = list(tracker.get_states().values())
    assert len(states) == 3 and not torch.equal(states[0], states[1])

    torch.manual_seed(0)
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # fork restores the outer stream
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # ... and advances its own


def test_shared_prefix_pack_by_hand():
    # two samples of the prompt [5, 6, 7] (left-padded), responses [8, 9] and [4]; then a lone row
    ids = torch.tensor([[0, 5, 6, 7, 8, 9], [0, 5, 6, 7, 4, 0], [6, 7, 5, 5, 0, 0]])
    mask = (ids != 0).long()
    packed = pack_shared_prefix(ids, mask, group_size=2)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 4], [6, 7, 5, 5, 0, 0]]  # the prompt once, no copy
    assert packed.position_ids.tolist()[0] == [0, 1, 2, 3, 4, 3]  # sample 2's 4 sits where it sits unpacked
    assert packed.segment.tolist() == [
        [0, 0, 0, 1, 1, 2],
        [0, 0, 0, 1, -1, -1],
    ]  # a lone row: body + 1 (its last token is a segment of its own)
    assert packed.targets.tolist() == [[6, 7, 8, 9, 0, 0], [7, 5, 5, 0, 0, 0]]
    # the body's last token (7) also predicts sample 2's first token: an extra prediction of that place
    assert packed.extra_at.tolist() == [2] and packed.extra_targets.tolist() == [4]
    assert packed.tokens == 10  # instead of 3 x 6 padded
    m = packed.attention_mask()[0, 0]
    T, F = True, False
    assert m[5].tolist() == [F, F, F, T, T, F]  # sample 2 sees the body and itself, not sample 1
    assert m[3].tolist() == [F, F, F, F, T, T]
    assert packed.attention_mask()[1, 0, 2].tolist() == [F, F, F, T, T, T]  # padding keys masked
    values = torch.arange(12, dtype=torch.float32).reshape(2, 6) + 1  # value = 1 + flat position
    # column t predicts token t+1; a value of the place itself (entropy) is shared by its extra prediction
    assert packed.unpack(values).tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [7, 8, 9, 0, 0]]
    # a value per prediction (a log-prob of its target) comes with its own value for the extra one
    assert packed.unpack(values, torch.tensor([100.0])).tolist()[1] == [0, 1, 2, 100, 0]
    assert packed.places(packed.source[1, 1:4]).tolist() == [0, 1, 2]  # the extra's place: 7's, index 2
    flat = packed.flat(4)  # the extras follow the flat row: index into [T', then E, then the zero]
    assert flat.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 6, 7, 5, 5, 0, 0]]
    assert flat.extra_at.tolist() == [2] and flat.source[1].tolist() == [13, 0, 1, 12, 13]
    assert flat.unpack(torch.arange(12.0) + 1, torch.tensor([100.0])).tolist() == [
        [0, 1, 2, 3, 4], [0, 1, 2, 100, 0], [7, 8, 9, 0, 0],
    ]  # fmt: skip


def test_identical_samples_keep_a_segment_each():
    """Samples that agree to their end (a common prefix as long as a row) keep one own token each (the body
    stops a token short), so that no segment is empty; nothing is predicted twice."""
    ids = torch.tensor([[5, 6, 7, 2], [5, 6, 7, 2]])
    packed = pack_shared_prefix(ids, torch.ones_like(ids), group_size=2)
    assert packed.input_ids.tolist() == [[5, 6, 7, 2, 2]] and packed.segment.tolist() == [[0, 0, 0, 1, 2]]
    assert len(packed.extra_at) == 0
    values = torch.arange(5.0)[None] + 1
    assert packed.unpack(values).tolist() == [[1, 2, 3], [1, 2, 3]]


def test_any_grouping_gives_the_unpacked_rows_outputs(single_process_world):
    """Against brute force: each row alone through a causal model gives the same per-token values, for
    every group size and length cap (groups with and without a common prefix, empty responses)."""
    from yatt_ray.batch import pack

    gen = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for g in range(4):
        prompt = torch.randint(
            4, 20, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(3):
            length = int(torch.randint(0, 5, (1,), generator=gen))
            prompts.append(prompt if g < 3 else prompt + [g])
            responses.append(torch.randint(4, 20, (length,), generator=gen).tolist())
    batch = pack(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0, group_size=3)
    emb = torch.randn(32, 8, generator=gen)

    def model(ids, positions, mask):  # one causal attention layer with a position term, no learning
        h = emb[ids] + positions[..., None].float() * 0.1
        scores = (h @ h.transpose(1, 2)).masked_fill(mask[:, 0], float("-inf"))
        return torch.softmax(scores, -1) @ h

    def alone(i):  # (per-position value [n], log-prob of each next token [n - 1], real columns [n])
        real = batch.attention_mask[i].bool()
        ids = batch.input_ids[i][real][None]
        n = ids.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
        h = model(ids, torch.arange(n)[None], causal)[0]
        logp = torch.log_softmax(h @ emb.T, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        return h[:, 0], logp, torch.nonzero(real).flatten()

    for group_size, cap in ((1, None), (3, None), (3, 6), (5, None)):
        packed = pack_shared_prefix(batch.input_ids, batch.attention_mask, group_size, max_len=cap)
        h = model(packed.input_ids, packed.position_ids, packed.attention_mask())
        out = packed.unpack(h[..., 0])
        scores = torch.log_softmax(h @ emb.T, -1)  # [G, L, V]: each place's next-token log-probs
        extra = scores.reshape(-1, scores.shape[-1])[packed.extra_at, packed.extra_targets]
        logp = packed.unpack(scores.gather(-1, packed.targets[..., None])[..., 0], extra)
        for i in range(batch.size):
            expect, expect_logp, cols = alone(i)
            assert torch.allclose(out[i, cols[1:] - 1], expect[:-1], atol=1e-5), (group_size, cap, i)
            assert torch.allclose(logp[i, cols[1:] - 1], expect_logp, atol=1e-5), (group_size, cap, i)
            others = torch.ones(out.shape[1], dtype=torch.bool)
            others[cols[1:] - 1] = False
            assert (out[i, others] == 0).all() and (logp[i, others] == 0).all()
    assert len(pack_shared_prefix(batch.input_ids, batch.attention_mask, 3).extra_at) > 0  # the case is met


@pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear op")
@pytest.mark.parametrize("wgrad", [(), ((1, "transposed"),), ((1, "mkl"),)])  # direct; each other form
@pytest.mark.parametrize("out_features", [24, 12])  # wider out than in (N > K: the form matters); narrower
def test_onednn_linear_matches_torch_in_value_and_gradients(wgrad, out_features):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    w = torch.randn(out_features, 16, generator=gen, requires_grad=True)
    b = torch.randn(out_features, generator=gen, requires_grad=True)
    up = torch.randn(3, 5, out_features, generator=gen)
    try:
        apply_kernels(KernelChoice("onednn", torch.get_num_threads(), "native", 0, {}, wgrad))
        ours = OneDnnLinear.apply(x, w, b, False, None)
        grads = torch.autograd.grad((ours * up).sum(), (x, w, b))
    finally:
        apply_kernels(None)
    ref = torch.nn.functional.linear(x, w, b)
    expected = torch.autograd.grad((ref * up).sum(), (x, w, b))
    assert torch.allclose(ours, ref, atol=1e-5)
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=1e-4)
    assert grads[1].is_contiguous()  # laid out as the weight, whichever form computed it


@pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear op")
def test_weight_grad_forms_agree_and_the_active_one_runs(monkeypatch):
    """Every form of dW = g^T x gives the same [N, K] result; the transposed one hands oneDNN x^T (not g^T) as
    its first operand, only for a layer wider out than in; "mkl" calls no oneDNN product; by default the
    form measured at the nearest row count runs."""
    from yatt_ray.train import cpu_shims

    gen = torch.Generator().manual_seed(1)
    firsts: list[tuple[int, int]] = []
    real = cpu_shims.onednn_mm_t
    monkeypatch.setattr(cpu_shims, "onednn_mm_t", lambda a, b: firsts.append(tuple(a.shape)) or real(a, b))
    for n, k in ((96, 32), (32, 96)):
        g, x = torch.randn(40, n, generator=gen), torch.randn(40, k, generator=gen)
        want = g.t() @ x
        for form in WGRAD:
            firsts.clear()
            got = weight_grad(g, x, form)
            assert got.shape == (n, k) and torch.allclose(got, want, atol=1e-4), (form, n, k)
            first = [] if form == "mkl" else [(k, 40) if form == "transposed" and n > k else (n, 40)]
            assert firsts == first, (form, n, k, firsts)
    g, x = torch.randn(40, 96, generator=gen), torch.randn(40, 32, generator=gen)
    measured = ((10, "transposed"), (1000, "mkl"))
    try:  # with no form given, the form measured nearest to the row count decides
        for wgrad, first in (((), [(96, 40)]), (measured, [(32, 40)]), (measured[1:], [])):
            apply_kernels(KernelChoice("onednn", 1, "native", 0, {}, wgrad))
            firsts.clear()
            weight_grad(g, x)
            assert firsts == first, (wgrad, firsts)
    finally:
        apply_kernels(None)


def test_freed_tensor_memory_is_reused_not_faulted_in_again():
    """After the shims, a 48 MiB tensor allocated and written over and over reuses the same pages: glibc's
    default would `mmap` each one fresh (over its 32 MiB ceiling) and fault in all 12k pages every time."""
    code = (
        "import resource, torch\n"
        "from yatt_ray.host_memory import keep_freed_memory\n"
        "assert keep_freed_memory()\n"
        "torch.empty(12 << 20).fill_(1.0)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(20):\n"
        "    torch.empty(12 << 20).fill_(1.0)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    )
    faults = int(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    assert faults < 3 * 12 * 1024  # at most a few tensors' pages in 20 rounds (the default: ~20 x 12k)
