"""Data-parallel load balancing of the train phase: prompt groups (or equal slices of them) move between ranks
so that each rank's cost is (nearly) equal, and per-row results can be sent back to where each row came from.

The unit moved is a GROUP of `s` consecutive rows of a `RolloutBatch`, where `s` divides the batch's
`group_size` g (a prompt's samples): s = g moves whole prompt groups; a smaller s slices a group into g / s
parts that may land on different ranks (advantages were already computed over the whole group, and the
trainer packs each slice into one row with its prompt, so a slice costs its prompt once more). Unit k of a
batch of N rows is rows [k s, min((k+1) s, N)).

One exchange, on every rank of the data-parallel process group (a collective):
  1. each rank prices its units for every candidate size s (`unit_costs`: real tokens, or training FLOPs);
  2. the costs (and each rank's widths and field dtypes) are all-gathered as small Python objects;
  3. every rank computes the same `Plan` for each s (`plan_exchange`): Karmarkar-Karp over all units into one
     part per rank of equal unit count, each part given to the rank that already holds most of its cost; the
     largest s whose plan's largest rank cost is within `SLICE_GAIN` of the best is used (`choose_plan`), so
     groups are sliced only when whole groups are too coarse to balance (few groups a rank, a heavy tail);
  4. the rows of each moved unit go worker to worker (`batch_isend_irecv`, one byte message per rank pair;
     on CUDA when the group's backend is NCCL, else on the CPU for gloo), never through a driver;
  5. each rank joins what it holds into one batch (`yatt_ray.batch.concat`: prompts left-padded, responses
     right-padded to the widest, image slots zero-padded to the most; `group_size` = the s used), and keeps a
     `Restore` that sends per-row results back.
A vision batch's images are held once per prompt (`batch.PromptImages`, rows point at theirs by
`image_prompt`): a message carries the images of the prompts its rows name, once each (a sliced group sends
its prompt's images with every slice, as it sends the prompt's tokens), and a prompt without images is a text
prompt. Each rank's all-gathered summary holds its rows' prompts and each prompt's pixel rows and image count,
from which a receiver sizes what it gets.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from yatt_ray.batch import PromptImages, RolloutBatch, concat
from yatt_ray.metrics.flops import ModelFlops, PerfModel

MODES = ("tokens", "flops")
SLICE_GAIN = 0.01  # a group is sliced only when that lowers the largest rank cost by more than this fraction


# ---- partitioning ---------------------------------------------------------------------------------------
def karmarkar_karp(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Split indices 0..n-1 into `parts` lists of (nearly) EQUAL COUNT whose cost sums are close
    (Karmarkar-Karp largest differencing, the multi-way balanced form).

    Algorithm: pad `costs` with zero-cost dummies to m = parts * ceil(n / parts) items (dummies sort last, so
    each part gets at most one and real counts differ by at most one); sort descending (ties by index); cut
    the sorted list into m / parts chunks, each a partial solution of `parts` one-item subsets. Repeatedly
    take the two partial solutions of largest spread (max subset sum - min subset sum; ties: the one made
    first) and merge them subset by subset, the largest sum of one with the smallest of the other, so the
    differences cancel; the merged solution goes back to the pool. The last solution is the answer.
    Complexity: O(n log n) for the sort, then m / parts - 1 merges of O(parts log parts) each with a heap of
    m / parts solutions: O(n log n) in all, O(n) memory.

    Deterministic: every tie is broken by index or creation order. Returns `parts` lists, each ascending,
    ordered by their smallest index (empty lists, when n < parts, last). Raises ValueError for parts < 1.
    """
    if parts < 1:
        raise ValueError(f"karmarkar_karp: parts={parts} must be >= 1")
    values = [float(c) for c in costs]
    n = len(values)
    m = -(-n // parts) * parts
    weight = values + [0.0] * (m - n)
    order = sorted(range(m), key=lambda i: (i >= n, -weight[i], i))
    pool: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for made, start in enumerate(range(0, m, parts)):
        _push(pool, [(weight[i], [i]) for i in order[start : start + parts]], made)
    made = len(pool)
    while len(pool) > 1:
        a, b = heapq.heappop(pool)[2], heapq.heappop(pool)[2]
        big = sorted(a, key=lambda s: (-s[0], min(s[1])))
        small = sorted(b, key=lambda s: (s[0], min(s[1])))
        _push(pool, [(x[0] + y[0], x[1] + y[1]) for x, y in zip(big, small)], made)
        made += 1
    if not pool:
        return [[] for _ in range(parts)]
    found = [sorted(i for i in items if i < n) for _, items in pool[0][2]]
    return sorted(found, key=lambda p: p[0] if p else m)


def _push(pool: list, subsets: list[tuple[float, list[int]]], made: int) -> None:
    """Add a partial solution to the heap, keyed by (-spread, creation order)."""
    sums = [s for s, _ in subsets]
    heapq.heappush(pool, (-(max(sums) - min(sums)), made, subsets))


# ---- costs ----------------------------------------------------------------------------------------------
def unit_costs(
    attention_mask: Tensor,
    group_size: int,
    mode: str,
    model: ModelFlops | PerfModel | None = None,
    prompt_width: int | None = None,
) -> Tensor:
    """Cost [G] (float64, CPU) of each group of `group_size` consecutive rows of a [N, T] mask, G = ceil(N/g).

    A group packs into one row (`packing.pack_shared_prefix`): a shared body of b = c tokens, c the group's
    prompt length (real tokens left of `prompt_width`; b = c - 1 where a row has no token past it), then each
    row's own o_j = t_j - b tokens (t_j its real tokens). Without `prompt_width` nothing is shared (b = 0,
    each row whole). Responses that begin alike share more in the packing than counted here.

        "tokens":  T = b + sum_j o_j                              (the prompt counted once)
        "flops":   F = 6 N T + 12 L q P,  P = sum_j (b + o_j) (b + o_j + 1) / 2

    P is the (query, key) pairs the packed attention computes (`attention.packed_attention`: one causal
    attention over [body; segment j] per sample, the body's queries included each time); F is
    `ModelFlops.forward(T, P)` x 3 (forward + backward), N the matmul parameters, L the layers,
    q = heads x head_dim. `model` (a `ModelFlops`, or a `PerfModel` whose `.flops` is used) is needed for
    "flops".
    """
    if mode not in MODES:
        raise ValueError(f"unit_costs: mode={mode!r}; valid modes: {', '.join(MODES)}")
    if group_size < 1:
        raise ValueError(f"unit_costs: group_size={group_size} must be >= 1")
    mask = attention_mask.detach().cpu().to(torch.float64)
    rows = mask.shape[0]
    gid = torch.arange(rows) // group_size
    groups = -(-rows // group_size)
    total = mask.sum(1)
    if prompt_width is None:
        body = torch.zeros(groups, dtype=torch.float64)
    else:
        prompt = mask[:, :prompt_width].sum(1)
        shortest = torch.full((groups,), math.inf, dtype=torch.float64).scatter_reduce(0, gid, prompt, "amin")
        past = torch.full((groups,), math.inf, dtype=torch.float64).scatter_reduce(
            0, gid, total - shortest[gid], "amin"
        )  # the fewest tokens a row of the group has past the prompt
        body = torch.where(past > 0, shortest, (shortest - 1).clamp(min=0))
    own = total - body[gid]
    tokens = body + torch.zeros(groups, dtype=torch.float64).index_add(0, gid, own)
    if mode == "tokens":
        return tokens
    flops = model.flops if isinstance(model, PerfModel) else model
    if not isinstance(flops, ModelFlops):
        raise ValueError(
            f"unit_costs: mode='flops' needs a ModelFlops (or PerfModel) as model, got {model!r}"
        )
    seq = body[gid] + own  # each sample's [body; own tokens]
    pairs = torch.zeros(groups, dtype=torch.float64).index_add(0, gid, seq * (seq + 1) / 2)
    return 3.0 * flops.forward(tokens, pairs)  # type: ignore[arg-type,return-value]  # elementwise on [G]


def imbalance(costs_per_rank: list[float]) -> float:
    """max / mean of the ranks' costs: 1.0 is perfect balance (and the value for no cost at all)."""
    values = [float(c) for c in costs_per_rank]
    mean = math.fsum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


# ---- the plan -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Who holds which unit after the exchange.

    holds[r]: the (src_rank, unit) pairs rank r holds, sorted (the canonical order of its balanced batch);
    before[r] / after[r]: rank r's summed cost before / after.
    """

    holds: tuple[tuple[tuple[int, int], ...], ...]
    before: tuple[float, ...]
    after: tuple[float, ...]

    @property
    def moved(self) -> int:
        """Units that change rank."""
        return sum(src != r for r, held in enumerate(self.holds) for src, _ in held)

    def units(self, src: int, dst: int) -> list[int]:
        """Units of rank `src` that rank `dst` holds, in `dst`'s order."""
        return [u for s, u in self.holds[dst] if s == src]


def plan_exchange(costs_by_rank: list[list[float]], parts: int) -> Plan:
    """The same Plan on every rank for the same all-gathered `costs_by_rank[r][unit]`.

    Karmarkar-Karp splits all units into `parts` (= one per rank) parts of equal unit count; part p goes to
    the rank that holds most of its cost already (greedy over (part, rank) pairs by held cost, then held
    count, then index), so little data moves. When that plan would not lower the largest rank cost (the
    equal-count constraint can make it worse), nothing moves: the identity plan is returned.
    """
    ranks = len(costs_by_rank)
    if parts != ranks:
        raise ValueError(
            f"plan_exchange: parts={parts} must equal the number of ranks ({ranks}): one part each"
        )
    flat = [(r, u) for r, costs in enumerate(costs_by_rank) for u in range(len(costs))]
    cost = [float(c) for costs in costs_by_rank for c in costs]
    split = karmarkar_karp(cost, parts)
    owner = _owners(split, flat, cost, ranks)
    holds: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    for p, members in enumerate(split):
        holds[owner[p]].extend(flat[i] for i in members)
    before = tuple(math.fsum(float(c) for c in costs) for costs in costs_by_rank)
    price = dict(zip(flat, cost))
    after = tuple(math.fsum(price[k] for k in held) for held in holds)
    if max(after) >= max(before) * (1 - 1e-9):  # (relative slack: equal sums summed in another order)
        identity = tuple(tuple((r, u) for u in range(len(costs))) for r, costs in enumerate(costs_by_rank))
        return Plan(identity, before, before)
    return Plan(tuple(tuple(sorted(h)) for h in holds), before, after)


def _owners(split: list[list[int]], flat: list[tuple[int, int]], cost: list[float], ranks: int) -> list[int]:
    """owner[p]: the rank part p goes to, greedy by the cost (then count) of p already on that rank."""
    held = [[0.0] * ranks for _ in split]
    count = [[0] * ranks for _ in split]
    for p, members in enumerate(split):
        for i in members:
            held[p][flat[i][0]] += cost[i]
            count[p][flat[i][0]] += 1
    pairs = sorted(
        ((p, r) for p in range(len(split)) for r in range(ranks)),
        key=lambda pr: (-held[pr[0]][pr[1]], -count[pr[0]][pr[1]], pr[0], pr[1]),
    )
    owner: dict[int, int] = {}
    for p, r in pairs:
        if p not in owner and r not in owner.values():
            owner[p] = r
    return [owner[p] for p in range(len(split))]


def unit_sizes(group_size: int) -> list[int]:
    """The candidate unit sizes for groups of `group_size` rows: its divisors, largest (whole groups) first."""
    return [s for s in range(group_size, 0, -1) if group_size % s == 0]


def choose_plan(plans: dict[int, Plan]) -> int:
    """The unit size to use among `plans` (size -> Plan, the whole-group size the largest key): the largest
    size whose plan's largest rank cost is within `SLICE_GAIN` of the lowest one, so slicing a group (which
    costs its prompt again) is chosen only for a real gain."""
    best = min(max(p.after) for p in plans.values())
    return max(s for s, p in plans.items() if max(p.after) <= best * (1 + SLICE_GAIN))


# ---- the exchange ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Shard:
    """What every rank learns about another's batch (all-gathered): sizes, costs, and each set row field's
    (name, dtype, shape after the row dimension)."""

    rows: int
    prompt_width: int
    response_width: int
    group_size: int
    costs: dict[int, tuple[float, ...]]  # unit size -> the units' costs at that size
    fields: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
    # images: each row's prompt, each prompt's (pixel rows, images), the pixel row shape S, whether a grid comes
    row_prompt: tuple[int, ...] = ()
    prompt_sizes: tuple[tuple[int, int], ...] = ()
    pixel_shape: tuple[int, ...] | None = None
    has_grid: bool = False

    def unit_rows(self, unit: int) -> list[int]:
        return list(range(unit * self.group_size, min((unit + 1) * self.group_size, self.rows)))

    def rows_of(self, units: list[int]) -> list[int]:
        return [i for u in units for i in self.unit_rows(u)]

    def image_specs(self, rows: list[int]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """(dtype, shape) of the `PromptImages.tensors()` of `rows`' prompts ([] for a text batch)."""
        if self.pixel_shape is None:
            return []
        prompts = sorted({self.row_prompt[r] for r in rows})  # the order `RolloutBatch.rows` keeps them in
        pixel_rows = sum(self.prompt_sizes[g][0] for g in prompts)
        images = sum(self.prompt_sizes[g][1] for g in prompts)
        specs = [(torch.float32, (pixel_rows, *self.pixel_shape)), (torch.long, (len(prompts),))]
        specs.append((torch.long, (len(prompts),)))
        return specs + ([(torch.long, (images, 3))] if self.has_grid else [])


def _shard(batch: RolloutBatch, costs: dict[int, tuple[float, ...]]) -> _Shard:
    tensors = batch.tensors()
    images: dict = {}
    if batch.images is not None and batch.image_prompt is not None:
        im = batch.images
        images = dict(
            row_prompt=tuple(batch.image_prompt.tolist()),
            prompt_sizes=tuple(zip(im.rows.tolist(), im.counts.tolist())),
            pixel_shape=tuple(im.values.shape[1:]),
            has_grid=im.grid is not None,
        )
    return _Shard(
        **images,
        rows=batch.size,
        prompt_width=batch.prompt_width,
        response_width=batch.input_ids.shape[1] - batch.prompt_width,
        group_size=batch.group_size,
        costs=costs,
        fields=tuple((k, t.dtype, tuple(t.shape[1:])) for k, t in tensors.items()),
    )


class Restore:
    """Sends per-row results of the balanced batch back to each row's original rank and place.

    `restore(t)`: t is [N_bal, R_bal] (per response token; any dtype) or [N_bal] (per row); returns
    [N_local, R_local] (or [N_local]) in the local batch's original row order, each row cut back to its
    rank's response width R_local (the exchange only right-padded it). A collective over the same group:
    every rank calls it, with tensors of the same dtype and number of dimensions.
    """

    def __init__(self, plan: Plan | None = None, shards: tuple[_Shard, ...] = (), rank: int = 0, group=None):
        self.plan, self.shards, self.rank, self.group = plan, shards, rank, group

    def restore(self, tensor: Tensor) -> Tensor:
        if self.plan is None:
            return tensor
        plan, shards, me = self.plan, self.shards, self.rank
        origin = [(src, i) for src, unit in plan.holds[me] for i in shards[src].unit_rows(unit)]
        mine = shards[me]
        trail = (mine.response_width,) if tensor.ndim == 2 else tuple(tensor.shape[1:])

        def back(src: int) -> Tensor:  # the balanced rows that came from `src`, cut to its width
            rows = torch.tensor([b for b, (s, _) in enumerate(origin) if s == src], dtype=torch.long)
            part = tensor.index_select(0, rows.to(tensor.device))
            return part[:, : shards[src].response_width] if tensor.ndim == 2 else part

        out = tensor.new_zeros((mine.rows, *trail))
        local = [i for s, i in origin if s == me]
        if local:
            out[torch.tensor(local, device=tensor.device)] = back(me)
        peers = [r for r in range(len(shards)) if r != me]
        sends = {r: _to_bytes([back(r)]) for r in peers if any(s == r for s, _ in origin)}
        expect = {r: mine.rows_of(plan.units(me, r)) for r in peers}
        spec = {r: [(tensor.dtype, (len(rows), *trail))] for r, rows in expect.items() if rows}
        got = _send_recv(sends, {r: _nbytes(s) for r, s in spec.items()}, self.group)
        for r, buf in got.items():
            rows = torch.tensor(expect[r], device=tensor.device)
            out[rows] = _from_bytes(buf, spec[r])[0].to(tensor.device)
        return out


def exchange(
    batch: RolloutBatch,
    mode: str,
    group=None,
    model: ModelFlops | PerfModel | None = None,
    slice_groups: bool = True,
    skipped: Tensor | None = None,
) -> tuple[RolloutBatch, Restore, dict[str, float]]:
    """Balance `batch` over the data-parallel process group `group` (a collective; None = the default group).
    `skipped` [N] bool marks rows the train step will leave out (`step.zero_gradient_rows`): they cost nothing.

    Returns the balanced batch (the groups this rank holds in the Plan's order: every set row field, re-padded
    by `concat`; `greedy_rewards` dropped; `counters`, `truncated`, `prompts_clipped` of the local batch),
    a `Restore`, and stats {"balance/imbalance_before" (whole groups where they are), "balance/imbalance_after",
    "balance/moved_groups" (units moved), "balance/unit_size" (rows a unit)}, the same on every rank.
    `slice_groups=False` moves whole groups only; else a group may be sliced (`choose_plan`), and the
    balanced batch's `group_size` is the slice size. With one rank, or when the plan moves nothing, the batch itself comes back (with
    a Restore that returns its argument) and no rows are sent. On NCCL the process's CUDA device must be set
    (`torch.cuda.set_device`), as for any object collective.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        stats = {"balance/imbalance_before": 1.0, "balance/imbalance_after": 1.0, "balance/moved_groups": 0.0}
        return batch, Restore(), {**stats, "balance/unit_size": float(batch.group_size)}
    me = dist.get_rank(group)
    sizes = unit_sizes(batch.group_size) if slice_groups else [batch.group_size]
    mask = batch.attention_mask if skipped is None else batch.attention_mask * ~skipped[:, None]
    costs = {
        s: tuple(unit_costs(mask, s, mode, model, prompt_width=batch.prompt_width).tolist()) for s in sizes
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, _shard(batch, costs), group=group)
    _check_same_layout(gathered)
    plans = {s: plan_exchange([list(sh.costs[s]) for sh in gathered], world) for s in sizes}
    size = choose_plan(plans)
    plan = plans[size]
    stats = {
        "balance/imbalance_before": imbalance(list(plans[batch.group_size].before)),
        "balance/imbalance_after": imbalance(list(plan.after)),
        "balance/moved_groups": float(plan.moved),
        "balance/unit_size": float(size),
    }
    if plan.moved == 0:
        return batch, Restore(), stats
    shards = [dataclasses.replace(sh, group_size=size) for sh in gathered]
    joined = _move(dataclasses.replace(batch, group_size=size), plan, shards, me, group)
    return joined, Restore(plan, tuple(shards), me, group), stats


def _move(batch: RolloutBatch, plan: Plan, shards: list[_Shard], me: int, group) -> RolloutBatch:
    """Rank `me`'s balanced batch under `plan`: its units sent to the ranks that take them and theirs
    received (worker to worker), joined in the plan's order with the local batch's counters, `truncated` and
    `prompts_clipped`. `batch` and `shards` (every rank's) are in the plan's unit size."""
    world = len(shards)
    mine = shards[me]
    sends = {
        r: _to_bytes(_message(_pick(batch, mine.rows_of(plan.units(me, r)))))
        for r in range(world)
        if r != me and plan.units(me, r)
    }
    specs = {r: _specs(shards[r], plan.units(r, me)) for r in range(world) if r != me and plan.units(r, me)}
    got = _send_recv(sends, {r: _nbytes(s) for r, s in specs.items()}, group)
    pieces = []
    for src in sorted({s for s, _ in plan.holds[me]}):
        if src == me:
            pieces.append(_pick(batch, mine.rows_of(plan.units(me, me))))
        else:
            pieces.append(_piece(batch, shards[src], _from_bytes(got[src], specs[src])))
    joined = concat(pieces) if pieces else _pick(batch, [])
    joined.counters, joined.truncated = dict(batch.counters), batch.truncated
    joined.prompts_clipped = batch.prompts_clipped
    return joined


def _check_same_layout(shards: list[_Shard]) -> None:
    """Every rank must set the same row fields (dtypes included), use the same group size and, with images,
    the same pixel row shape S (and grids or none)."""
    layouts = [
        (s.group_size, tuple((k, d) for k, d, _ in s.fields), s.pixel_shape, s.has_grid) for s in shards
    ]
    if any(lay != layouts[0] for lay in layouts):
        raise ValueError(
            f"balance.exchange: the ranks' batches differ in group size, row fields or image shape: "
            f"{layouts}; every rank must reach the exchange after the same phases (same fields set, same "
            "rollout.n), its images from `batch.prompt_images` (a prompt without images: [0, *S] pixels)"
        )


def _message(batch: RolloutBatch) -> list[Tensor]:
    """The tensors one rank sends another for `batch`'s rows: the row fields, then their prompts' images."""
    return list(batch.tensors().values()) + ([] if batch.images is None else batch.images.tensors())


def _pick(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    return batch.rows(torch.tensor(rows, dtype=torch.long))


def _specs(shard: _Shard, units: list[int]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of each field of `units`' rows of `shard`, in field order, then of their prompts'
    images: what its message (`_message`) holds."""
    rows = shard.rows_of(units)
    return [(dtype, (len(rows), *trail)) for _, dtype, trail in shard.fields] + shard.image_specs(rows)


def _piece(like: RolloutBatch, shard: _Shard, tensors: list[Tensor]) -> RolloutBatch:
    """A RolloutBatch of received rows, with the sender's widths, on the local batch's device."""
    device = like.input_ids.device
    fields: dict = {name: t.to(device) for (name, _, _), t in zip(shard.fields, tensors)}
    rest = tensors[len(shard.fields) :]
    images = PromptImages.from_tensors(rest) if rest else None
    return RolloutBatch(**fields, prompt_width=shard.prompt_width, group_size=shard.group_size, images=images)


# ---- wire format: tensors <-> one uint8 message per rank pair -------------------------------------------
def _nbytes(spec: list[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in spec)


def _to_bytes(tensors: list[Tensor]) -> Tensor:
    """The raw bytes of `tensors`, one after the other ([sum of nbytes] uint8, CPU or the tensors' device)."""
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8)


def _from_bytes(buf: Tensor, spec: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[Tensor]:
    """Inverse of `_to_bytes` for tensors of the given (dtype, shape)s."""
    out, at = [], 0
    for dtype, shape in spec:
        size = math.prod(shape) * dtype.itemsize
        out.append(buf[at : at + size].clone().view(dtype).reshape(shape))  # clone: aligned storage
        at += size
    return out


def _send_recv(sends: dict[int, Tensor], recv_bytes: dict[int, int], group) -> dict[int, Tensor]:
    """Post every send (to group rank r) and receive (from group rank r, of the given size) at once and wait.

    Messages travel on CUDA when the group's backend is NCCL alone, else on the CPU (gloo). Returns the
    received buffers on that wire device."""
    backend = str(dist.get_backend(group))
    wire = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    ops, received = [], {}
    for peer in sorted(set(sends) | set(recv_bytes)):
        if peer in sends and sends[peer].numel():
            ops.append(dist.P2POp(dist.isend, sends[peer].to(wire), group=group, group_peer=peer))
        if recv_bytes.get(peer):
            received[peer] = torch.empty(recv_bytes[peer], dtype=torch.uint8, device=wire)
            ops.append(dist.P2POp(dist.irecv, received[peer], group=group, group_peer=peer))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return received
