"""The packed attention (fused causal kernels per [prompt; sample] sequence) against the dense masked reference."""

import pytest
import torch

from yatt_ray.batch import pack
from yatt_ray.model_shape import LlamaShape
from yatt_ray.train import build_gpt_model, seed_everything
from yatt_ray.train.attention import packed_attention, segment_layout
from yatt_ray.train.model import FLAT_MULTIPLE, attention_input, forward_packed, model_rows
from yatt_ray.train.packing import PAD_SEGMENT, pack_shared_prefix

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (release/gpu_check.sh runs it there)"
)
# (device, dtype, tolerance on values and gradients against the float64 reference): float64 on the CPU; on CUDA
# fp32 (TF32 off: torch's default for matmuls) and bf16 (flash attention, fp32 accumulation)
DEVICES = [
    ("cpu", torch.float64, 1e-10),
    pytest.param("cuda", torch.float32, 1e-5, marks=[CUDA, pytest.mark.gpu]),
    pytest.param("cuda", torch.bfloat16, 3e-2, marks=[CUDA, pytest.mark.gpu]),
]


def _batch(gen, groups=5, n=4, vocab=30):
    """Groups of n samples of one prompt; response lengths 0-11, one group's prompt longer than the rest."""
    prompts, responses = [], []
    for g in range(groups):
        prompt = torch.randint(
            4, vocab, (int(torch.randint(1, 7, (1,), generator=gen)) + 3 * (g == 2),), generator=gen
        )
        for _ in range(n):
            length = int(torch.randint(0, 12, (1,), generator=gen))
            prompts.append(prompt.tolist())
            responses.append(torch.randint(4, vocab, (length,), generator=gen).tolist())
    return pack(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0, group_size=n)


def _dense(q, k, v, packed, scale):
    """The reference: masked softmax attention over whole packed rows, [L, G, h, d] -> [L, G, h * d]."""
    heads, groups = q.shape[2], k.shape[2]
    k, v = (x.repeat_interleave(heads // groups, dim=2) for x in (k, v))
    scores = torch.einsum("qghd,kghd->ghqk", q, k) * scale
    scores = scores.masked_fill(packed.attention_mask(), float("-inf"))
    out = torch.einsum("ghqk,kghd->qghd", scores.softmax(-1), v)
    return out.reshape(*q.shape[:2], -1)


@pytest.mark.parametrize(
    "group_size,cap,heads,kv_heads,whole_rows",
    [
        (4, None, 4, 4, False),
        (4, 12, 4, 2, False),
        (1, None, 3, 1, False),
        (8, None, 2, 2, False),
        (4, None, 4, 2, True),
    ],
)
@pytest.mark.parametrize("device,dtype,tol", DEVICES)
def test_packed_attention_equals_dense_reference_in_values_and_gradients(
    group_size, cap, heads, kv_heads, whole_rows, device, dtype, tol
):
    """Per-sample causal sequences in buckets, and (whole_rows) whole masked rows, against the dense reference
    (computed in float64 from the same inputs); on CUDA the fused kernels the trainer gets in fp32 and bf16."""
    gen = torch.Generator().manual_seed(group_size * 10 + heads)
    batch = _batch(gen)
    packed = pack_shared_prefix(batch.input_ids, batch.attention_mask, group_size, max_len=cap)
    length, rows, d = packed.segment.shape[1], packed.segment.shape[0], 8
    q = torch.randn(length, rows, heads, d, generator=gen, dtype=torch.float64).to(device, dtype)
    k, v = (
        torch.randn(length, rows, kv_heads, d, generator=gen, dtype=torch.float64).to(device, dtype)
        for _ in "kv"
    )
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    # [L, G, 1]: padding positions' outputs are never read
    real = (packed.segment != PAD_SEGMENT).T[:, :, None].to(device)
    weights = torch.randn(length, rows, heads * d, generator=gen, dtype=torch.float64).to(device) * real

    layout = segment_layout(packed.segment, dense_up_to=10**6 if whole_rows else 0).to(device)
    assert (layout.visible is not None) == whole_rows and (layout.kv_index.numel() == 0) == whole_rows
    got = packed_attention(q, k, v, layout, scale=0.3)
    want = _dense(*(x.double() for x in (q, k, v)), packed.to(device), 0.3)
    assert got.dtype == dtype and ((got.double() - want).abs() * real).max() < tol
    assert torch.isfinite(got).all()  # padding positions attend to themselves: finite, never read
    grads = torch.autograd.grad((got.double() * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for g, w in zip(grads, want_grads):  # low precision: gradients sum many positions, the tolerance scales
        scale = 1.0 if dtype == torch.float64 else max(1.0, w.abs().max().item())
        assert (g.double() - w).abs().max() < tol * scale


@pytest.mark.parametrize("whole_rows", [False, True])
@pytest.mark.parametrize("multiple", [1, 16])
def test_flat_rows_attend_as_the_padded_rows(whole_rows, multiple):
    """`SharedPrefixRows.flat(multiple)`: the real tokens as one row [1, T'] (T rounded up to `multiple`, the
    end padded) with the re-indexed layout give the padded rows' outputs at every real position, and the same
    gradients (float64, exact up to summation order), whatever the padding tokens carry."""
    gen = torch.Generator().manual_seed(7)
    batch = _batch(gen, groups=6, n=4)
    packed = pack_shared_prefix(batch.input_ids, batch.attention_mask, 4)
    length, rows, heads, d = packed.segment.shape[1], packed.segment.shape[0], 4, 8
    real = packed.segment != PAD_SEGMENT
    tokens = int(real.sum())
    assert 0 < tokens < real.numel()  # there is padding to drop
    padded_to = -(-tokens // multiple) * multiple
    assert multiple == 1 or padded_to > tokens  # the flat row has padding of its own to ignore
    q, k, v = (torch.randn(length, rows, n, d, generator=gen, dtype=torch.float64) for n in (heads, 2, 2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dense_up_to = 10**6 if whole_rows else 0
    padded = packed_attention(q, k, v, segment_layout(packed.segment, dense_up_to), scale=0.3)
    flat = packed.flat(multiple)
    layout = segment_layout(packed.segment, dense_up_to).flattened(real, padded_to)
    assert (layout.visible is not None) == whole_rows
    assert flat.input_ids.shape == (1, padded_to) and flat.tokens == packed.tokens == tokens
    assert torch.equal(
        flat.input_ids[0, :tokens], packed.input_ids[real]
    )  # row-major order of the real tokens
    assert (flat.segment[0, tokens:] == PAD_SEGMENT).all() and (flat.targets[0, tokens:] == 0).all()

    def to_flat(x):  # [L, G, n, d] -> [T', 1, n, d]: the padding carries noise, which must not leak
        noise = 100 * torch.randn(padded_to - tokens, 1, x.shape[2], d, generator=gen, dtype=x.dtype)
        return torch.cat([packed.on_flat(x.permute(2, 3, 1, 0)).permute(3, 2, 0, 1), noise])

    got = packed_attention(to_flat(q), to_flat(k), to_flat(v), layout, scale=0.3)
    assert got.shape[0] == padded_to
    got = got[:tokens]
    want = padded.transpose(0, 1)[real][:, None]  # [T, 1, h * d]
    assert got.shape == want.shape and (got - want).abs().max() < 1e-12
    weights = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for g, w in zip(grads, want_grads):
        assert (g - w).abs().max() < 1e-12 and w.abs().max() > 0


def test_flat_rows_map_back_to_the_original_columns():
    """Values at the flat row's positions unpack to the same [B, T-1] columns as the padded rows' values."""
    gen = torch.Generator().manual_seed(8)
    batch = _batch(gen, groups=3, n=4)
    packed = pack_shared_prefix(batch.input_ids, batch.attention_mask, 4)
    values = torch.randn(packed.segment.shape, generator=gen)
    flat = packed.flat()
    assert torch.equal(flat.unpack(packed.on_flat(values)[0]), packed.unpack(values))
    assert torch.equal(flat.targets[0], packed.targets[packed.segment != PAD_SEGMENT])
    # rounded up to 64 tokens: the padding's values are never read back
    rounded = packed.flat(64)
    length = rounded.input_ids.shape[-1]
    assert length % 64 == 0 and 0 < length - packed.tokens < 64
    noisy = torch.cat([packed.on_flat(values)[0], torch.full((length - packed.tokens,), 1e9)])
    assert torch.equal(
        packed.on_flat(values, length, fill=7)[0, packed.tokens :],
        torch.full_like(noisy[packed.tokens :], 7),
    )
    assert torch.equal(rounded.unpack(noisy), packed.unpack(values))
    with pytest.raises(ValueError, match="multiple=0"):
        packed.flat(0)
    with pytest.raises(ValueError, match="before .flat"):
        flat.attention_mask()


def test_layout_is_linear_in_the_packed_length():
    """One group: a 512-token prompt and 8 samples of 2048: the layout holds sum_j (b + n_j) key indices (the
    body's own sequence, then each sample's [body; own]), its CPU plan one bucket of those, no L x L."""
    body, n, own = 512, 8, 2048
    segment = torch.cat(
        [torch.zeros(body, dtype=torch.long)] + [torch.full((own,), j) for j in range(1, n + 1)]
    )[None]
    layout = segment_layout(segment)
    length = segment.shape[1]
    assert layout.cu_q.tolist() == [0, body] + [body + own * j for j in range(1, n + 1)]
    assert layout.kv_index.numel() == body + n * (body + own) < 3 * length  # dense: length ** 2 = 280M
    assert (layout.max_q, layout.max_k) == (own, body + own)
    assert torch.equal(layout.kv_index[body : 2 * body + own], torch.arange(body + own))  # sample 1's keys
    widths = [q_rows.shape for q_rows, _ in layout.plan.grids]
    assert widths == [(n, body + own), (1, body)]


def test_buckets_bound_the_padding():
    """Sequences of very different lengths go to different CPU buckets; each bucket's padding is bounded."""
    lengths = [3000, 2900, 1200, 1100, 90, 40, 5]
    segment = torch.cat([torch.full((m,), j) for j, m in enumerate(lengths, start=1)])[None]
    grids = segment_layout(segment).plan.grids
    widths = [q_rows.shape[1] for q_rows, _ in grids]
    assert widths == [3000, 1200, 90, 5]  # 40 joins 90 (within 64 tokens), 5 does not
    assert sum(q_rows.numel() for q_rows, _ in grids) < 1.1 * sum(lengths)


@pytest.mark.parametrize("gqa", ["native", "expand"])
def test_varlen_operator_equals_autograd_buckets(gqa):
    """The one-call operator (its CPU kernel: saved log-sum-exp, hand-written backward) against the same
    buckets through autograd (`bucketed_attention`), values and gradients in float64; one operator each way."""
    from yatt_ray.testing.gpu_proxies import OpCounter
    from yatt_ray.train.varlen import bucketed_attention, varlen_attention

    gen = torch.Generator().manual_seed(3)
    batch = _batch(gen, groups=4, n=4)
    packed = pack_shared_prefix(batch.input_ids, batch.attention_mask, 4).flat()
    layout = segment_layout(packed.segment, dense_up_to=0)
    tokens, kv = layout.cu_q[-1].item(), layout.kv_index.numel()
    q = torch.randn(tokens, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(kv, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    counter = OpCounter()
    with counter:
        cpu_plan, expand = layout.plan.flat(), gqa == "expand"
        got = varlen_attention(
            q, k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, 0.3, cpu_plan, expand
        )
        got = got[0]
        grads = torch.autograd.grad((got * got).sum(), (q, k, v))
    assert {name: n for name, n in counter.ops.items() if "varlen" in name} == {
        "varlen_attention": 1, "varlen_attention_backward": 1
    }  # fmt: skip
    want = bucketed_attention(q, k, v, layout.plan, 0.3, gqa)
    want_grads = torch.autograd.grad((want * want).sum(), (q, k, v))
    assert (got - want).abs().max() < 1e-12
    for g, w in zip(grads, want_grads):
        assert (g - w).abs().max() < 1e-10 and w.abs().max() > 0


def _shape(**over):
    base = dict(
        vocab_size=40,
        hidden_size=48,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        ffn_hidden_size=64,
        max_positions=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        qkv_bias=True,
    )
    return LlamaShape(**{**base, **over})


def test_gpt_model_logits_packed_equal_dense_fp32(single_process_world):
    """The trainer's model (packed attention, the default) against Megatron's DotProductAttention over the
    dense mask, same weights: logits within 1e-5 at every real position (Qwen2-like: GQA, q/k/v biases)."""
    gen = torch.Generator().manual_seed(3)
    batch = _batch(gen, groups=4, n=4, vocab=40)
    packed = pack_shared_prefix(batch.input_ids, batch.attention_mask, 4)
    seed_everything(0)
    fused, dense = build_gpt_model(_shape()), build_gpt_model(_shape(), attention="dense")
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    dense.load_state_dict(fused.state_dict())
    packed = packed.to(next(fused.parameters()).device)  # on CUDA the model is built there
    assert type(attention_input(fused, packed)).__name__ == "SegmentLayout"
    with torch.no_grad():
        got, want = forward_packed(fused.eval(), packed), forward_packed(dense.eval(), packed)
    real = packed.segment != PAD_SEGMENT
    assert (got - want)[real].abs().max() < 1e-5
    assert got[real].abs().max() > 0.1  # the logits are not trivially equal
    with (
        torch.no_grad()
    ):  # the trainer's form: the real tokens as one flat row (no padding through the layers)
        flat = forward_packed(fused, model_rows(fused, packed.to("cpu")).to(packed.input_ids.device))
    tokens = int(real.sum())  # on a CPU the flat row is rounded up to FLAT_MULTIPLE tokens, padding ignored
    multiple = FLAT_MULTIPLE if packed.input_ids.device.type == "cpu" else 1
    assert flat.shape[:2] == (1, -(-tokens // multiple) * multiple) and (
        multiple == 1 or flat.shape[1] > tokens
    )
    assert (flat[0, :tokens] - want[real]).abs().max() < 1e-5
