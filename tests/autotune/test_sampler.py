"""LengthBatchSampler: micro-batches within capacity at their padded length, updates of target_tokens,
every index once, the same micro-batches per update on every rank, packing into rows; the Accumulator
gives the big-batch gradient over its uneven micro-batches; a real CPU run stays within the budget."""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from autotune.core.capacity import capacity
from autotune.loop.accumulate import Accumulator
from autotune.loop.sampler import BUCKET_GROWTH, LengthBatchSampler, PackedRow, Update
from autotune.loop.verify import verify_micro_batches
from examples import gpt
from tests.factories import surface_gpt_payloads

IGNORE = gpt.IGNORE_INDEX


def lognormal_lengths(count: int, *, median: int = 120, sigma: float = 1.0, low: int = 8, high: int = 1000,
                      seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(count)]


def plans(lengths: Sequence[int], cap: Callable[[int], int], replicas: int = 1, **kwargs: Any) -> list[list[Update]]:
    """Every rank's updates of one epoch."""
    return [
        list(LengthBatchSampler(lengths, cap, num_replicas=replicas, rank=rank, **kwargs).updates())
        for rank in range(replicas)
    ]


def check_epoch(
    ranks: list[list[Update]],
    lengths: Sequence[int],
    cap: Callable[[int], int],
    *,
    target_tokens: int,
    pad_to_multiple_of: int = 1,
    supervised: Sequence[int] | None = None,
    drop_last: bool = False,
    pack_to: int | None = None,
) -> None:
    """The sampler's invariants over one epoch of every rank."""
    supervised = list(lengths) if supervised is None else list(supervised)
    replicas = len(ranks)
    most = max(supervised)
    # The same updates on every rank: number, micro-batches per update, what each says of the whole.
    assert len({len(updates) for updates in ranks}) == 1
    seen: collections.Counter[int] = collections.Counter()
    repeated: collections.Counter[int] = collections.Counter()
    updates = list(zip(*ranks, strict=True))
    for position, shares in enumerate(updates):
        assert len({len(share) for share in shares}) == 1, [len(share) for share in shares]
        assert all(len(share) >= 1 for share in shares)
        first = shares[0]
        assert all((s.position, s.tokens, s.samples, s.short, s.repeated) == (first.position, first.tokens,
                   first.samples, first.short, first.repeated) for s in shares)
        assert first.position == position
        tokens = samples = 0
        for share in shares:
            for batch in share:
                assert batch, "an empty micro-batch"
                if pack_to is None:
                    padded = -(-max(lengths[i] for i in batch) // pad_to_multiple_of) * pad_to_multiple_of
                    assert len(batch) <= cap(padded), (len(batch), padded)
                    indices = list(batch)
                else:
                    assert len(batch) <= cap(pack_to)
                    indices = []
                    for row in batch:
                        assert isinstance(row, PackedRow) and row.length == pack_to and row.indices
                        bounds = [0]
                        for i in row.indices:
                            bounds.append(bounds[-1] + lengths[i])
                        assert list(row.boundaries) == bounds and row.tokens <= pack_to
                        indices.extend(row.indices)
                seen.update(indices)
                tokens += sum(supervised[i] for i in indices)
                samples += len(indices)
        assert (first.tokens, first.samples) == (tokens, samples)
        repeated.update(first.repeated)
        if first.short:
            assert position == len(updates) - 1, "only the last update may be short"
            assert tokens <= target_tokens + (replicas - 1) * most
        else:
            # Within one longest sample of the target; under DDP, where micro-batches of one sample
            # cannot be cut further, within one per replica.
            assert target_tokens - replicas * most < tokens <= target_tokens, (tokens, target_tokens, most)
            if replicas == 1 and most:
                assert target_tokens - most < tokens
    everything = collections.Counter(range(len(lengths)))
    if drop_last:
        assert not repeated and all(count == 1 for count in seen.values())
        left = everything - seen
        assert sum(supervised[i] for i in left) <= target_tokens  # what the dropped short update held
    else:
        assert seen == everything + repeated, "every index exactly once per epoch (and DDP's repeats)"
        assert not repeated or replicas > 1


def token_capacity(tokens: int) -> Callable[[int], int]:
    return lambda length: max(1, tokens // length)


# -- properties ----------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=150),
    tokens=st.integers(300, 6000),
    replicas=st.integers(1, 4),
    factor=st.integers(1, 12),
    pad=st.sampled_from([1, 8, 64]),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 10),
    masked=st.booleans(),
)
def test_invariants_over_random_lengths(
    lengths: list[int], tokens: int, replicas: int, factor: int, pad: int, shuffle: bool, drop_last: bool,
    seed: int, masked: bool,
) -> None:
    cap = token_capacity(tokens)
    supervised = [length - 1 for length in lengths] if masked else None
    most = max(supervised or lengths)
    target = max(1, most) * replicas * factor
    kwargs = dict(target_tokens=target, pad_to_multiple_of=pad, shuffle=shuffle, drop_last=drop_last, seed=seed,
                  supervised_tokens=supervised)
    ranks = plans(lengths, cap, replicas, **kwargs)
    check_epoch(ranks, lengths, cap, target_tokens=target, pad_to_multiple_of=pad, supervised=supervised,
                drop_last=drop_last)
    # Iteration is the updates' micro-batches in order, and len() counts them.
    sampler = LengthBatchSampler(lengths, cap, num_replicas=replicas, rank=replicas - 1, **kwargs)
    flat = [batch for update in ranks[-1] for batch in update]
    assert list(sampler) == flat and len(sampler) == len(flat)


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 256), min_size=1, max_size=150),
    pack_to=st.integers(256, 1024),
    rows=st.integers(1, 6),
    replicas=st.integers(1, 3),
    factor=st.integers(1, 8),
    seed=st.integers(0, 5),
)
def test_packing_invariants_over_random_lengths(
    lengths: list[int], pack_to: int, rows: int, replicas: int, factor: int, seed: int
) -> None:
    cap = lambda length: rows  # noqa: E731
    target = max(lengths) * replicas * factor
    ranks = plans(lengths, cap, replicas, target_tokens=target, pack_to=pack_to, seed=seed)
    check_epoch(ranks, lengths, cap, target_tokens=target, pack_to=pack_to)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=2, max_size=80), seed=st.integers(0, 5))
def test_a_capacity_that_grows_with_the_length_is_never_trusted_beyond_a_shorter_length(
    lengths: list[int], seed: int
) -> None:
    # Not physical, but a callable may say it: a part of a micro-batch (split at an update's edge or
    # for DDP) must still fit at its own, shorter, padded length.
    cap = lambda length: 1 + (length * 7919) % 5  # noqa: E731
    target = max(lengths) * 2
    ranks = plans(lengths, cap, 2, target_tokens=target, seed=seed)
    check_epoch(ranks, lengths, cap, target_tokens=target)


# -- what the design promises, on the data of the issue ----------------------------------------


def test_micro_batches_fill_the_surface_and_pad_little() -> None:
    lengths = lognormal_lengths(3000)
    cap = capacity(surface_gpt_payloads())
    sampler = LengthBatchSampler(lengths, cap, target_tokens=65536, pad_to_multiple_of=8)
    batches = list(sampler)
    padded = sum(len(b) * sampler.padded_length(b) for b in batches)
    assert sum(lengths) / padded > 0.94  # bucketed: a few percent of padding
    # Against m_max at the longest length for every micro-batch in random order: far fewer micro-batches.
    fixed = cap(1000)
    assert len(batches) < 0.4 * math.ceil(len(lengths) / fixed)
    # Most micro-batches stay within a bucket or two (lengths within BUCKET_GROWTH of each other).
    waste = sorted(1 - sum(lengths[i] for i in b) / (len(b) * sampler.padded_length(b)) for b in batches)
    assert waste[len(waste) // 2] < 2 * BUCKET_GROWTH and waste[int(0.9 * len(waste))] < 4 * BUCKET_GROWTH


def test_under_ddp_the_target_holds_to_one_sample_where_micro_batches_can_be_cut() -> None:
    lengths = lognormal_lengths(2000, seed=1)
    cap = capacity(surface_gpt_payloads())
    for replicas in (2, 4, 8):
        ranks = plans(lengths, cap, replicas, target_tokens=65536, pad_to_multiple_of=8)
        check_epoch(ranks, lengths, cap, target_tokens=65536, pad_to_multiple_of=8)
        full = [update for update in ranks[0] if not update.short]
        assert all(65536 - max(lengths) < update.tokens <= 65536 for update in full)
        assert not any(update.repeated for update in ranks[0])
        # Every rank's share holds about the same work (padded tokens).
        for shares in zip(*ranks, strict=True):
            work = [sum(len(b) * max(lengths[i] for i in b) for b in share) for share in shares]
            assert max(work) <= 2 * min(work) + 8 * 1000


def test_where_nothing_can_be_cut_ddp_repeats_as_distributed_sampler_pads() -> None:
    # Capacity 1 at every length: 7 samples over 2 ranks cannot give each rank the same count once each.
    ranks = plans([100] * 7, lambda length: 1, 2, target_tokens=300)
    check_epoch(ranks, [100] * 7, lambda length: 1, target_tokens=300)
    last = ranks[0][-1]
    # Two of three per full update (the third waits for the next), then the last three and one again.
    assert [u.tokens for u in ranks[0]] == [200, 200, 400]
    assert last.short and len(last.repeated) == 1 and last.samples == 4
    dropped = plans([100] * 7, lambda length: 1, 2, target_tokens=300, drop_last=True)
    assert [u.tokens for u in dropped[0]] == [200, 200]


def test_the_short_last_update_says_so() -> None:
    updates = plans([10] * 25, lambda length: 4, target_tokens=100)[0]
    assert [u.tokens for u in updates] == [100, 100, 50]
    assert [u.short for u in updates] == [False, False, True]
    assert "short=True" in repr(updates[-1])
    assert [u.tokens for u in plans([10] * 25, lambda length: 4, target_tokens=100, drop_last=True)[0]] == [100, 100]


def test_set_epoch_reshuffles_and_an_epoch_is_the_same_everywhere() -> None:
    lengths = lognormal_lengths(500, seed=2)
    cap = capacity(surface_gpt_payloads())
    one = LengthBatchSampler(lengths, cap, target_tokens=20000, seed=3)
    two = LengthBatchSampler(lengths, cap, target_tokens=20000, seed=3)
    first = list(one)
    assert list(two) == first and list(one) == first
    one.set_epoch(1)
    assert list(one) != first
    two.set_epoch(1)
    assert list(two) == list(one)
    assert list(LengthBatchSampler(lengths, cap, target_tokens=20000, seed=4)) != first
    fixed = LengthBatchSampler(lengths, cap, target_tokens=20000, shuffle=False)
    in_order = list(fixed)
    fixed.set_epoch(5)
    assert list(fixed) == in_order
    # Without shuffling the updates run from the shortest samples to the longest.
    longest = [max(lengths[i] for batch in update for i in batch) for update in fixed.updates()]
    assert longest == sorted(longest)


def test_packed_rows_are_full_and_carry_their_boundaries() -> None:
    lengths = lognormal_lengths(2000, seed=3)
    cap = capacity(surface_gpt_payloads())
    sampler = LengthBatchSampler(lengths, cap, target_tokens=65536, pack_to=1024)
    batches = list(sampler)
    rows = [row for batch in batches for row in batch]
    assert all(len(batch) <= cap(1024) for batch in batches)
    assert sum(row.tokens for row in rows) / (1024 * len(rows)) > 0.9
    assert sorted(i for row in rows for i in row.indices) == list(range(len(lengths)))
    row = rows[0]
    assert row.boundaries[0] == 0 and all(
        row.boundaries[k + 1] - row.boundaries[k] == lengths[i] for k, i in enumerate(row.indices)
    )
    assert sampler.padded_length(batches[0]) == 1024


# -- bad input: one line each, from the constructor ------------------------------------------------


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "12", None])
def test_a_length_that_is_not_a_positive_integer(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"^length of sample 2 must be a positive integer, got .*$"):
        LengthBatchSampler([5, 6, bad, 7], lambda length: 4, target_tokens=100)


def test_a_sample_longer_than_the_surface_covers_is_named() -> None:
    cap = capacity(surface_gpt_payloads())  # covers up to 2048
    with pytest.raises(ValueError) as caught:
        LengthBatchSampler([100, 300, 2500, 2049], cap, target_tokens=10_000)
    assert str(caught.value) == "sample 3 has length 2049, longer than the capacity covers (up to 2048)"
    with pytest.raises(ValueError, match=r"^sample 1 has length 2041 \(padded to 3000\), longer than the capacity "
                       r"covers \(up to 2048\)$"):
        LengthBatchSampler([100, 2041], cap, target_tokens=10_000, pad_to_multiple_of=1000)


def test_a_target_below_the_longest_sample() -> None:
    with pytest.raises(ValueError, match=r"^target_tokens 150 is below the longest sample \(sample 1: 200 tokens\)"):
        LengthBatchSampler([100, 200], lambda length: 4, target_tokens=150)
    with pytest.raises(ValueError, match=r"below 4 replicas x the longest sample .* on every replica$"):
        LengthBatchSampler([100, 200], lambda length: 4, target_tokens=700, num_replicas=4, rank=0)


def test_a_capacity_of_zero_or_one_that_fails() -> None:
    with pytest.raises(ValueError, match=r"^capacity\(64\) is 0: not even one sample of length 64 \(sample 2\) fits"):
        LengthBatchSampler([10, 20, 64, 30], lambda length: 0 if length > 50 else 3, target_tokens=1000)

    def broken(length: int) -> int:
        raise RuntimeError("no surface here\nsecond line")

    with pytest.raises(ValueError, match=r"^capacity\(10\) failed for sample 0 \(length 10\): RuntimeError: no "
                       r"surface here$"):
        LengthBatchSampler([10], broken, target_tokens=1000)
    with pytest.raises(ValueError, match="not a micro-batch size"):
        LengthBatchSampler([10], lambda length: 2.0, target_tokens=1000)  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(lengths=[]), "lengths is empty"),
        (dict(pack_to=100), "sample 1 has length 120, longer than pack_to 100: documents are never split"),
        (dict(num_replicas=2, rank=2), "rank must be an integer from 0 to 1, got 2"),
        (dict(num_replicas=0), "num_replicas must be a positive integer, got 0"),
        (dict(pad_to_multiple_of=0), "pad_to_multiple_of must be a positive integer, got 0"),
        (dict(target_tokens=0), "target_tokens must be a positive integer, got 0"),
        (dict(supervised_tokens=[1]), "supervised_tokens has 1 entries for 3 samples"),
        (dict(supervised_tokens=[1, -1, 2]), "supervised tokens of sample 1 must be a non-negative integer"),
        (dict(supervised_tokens=[1, 2, 0.5]), "supervised tokens of sample 2 must be a non-negative integer"),
        (dict(seed="1"), "seed must be an integer, got '1'"),
    ],
)
def test_other_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = dict(lengths=[50, 120, 60], capacity=lambda length: 4, target_tokens=1000)
    arguments.update(kwargs)
    with pytest.raises(ValueError) as caught:
        LengthBatchSampler(**arguments)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


# -- the Accumulator over the sampler's uneven micro-batches ---------------------------------------

TINY = gpt.GPTConfig(vocab_size=64, seq_len=64, d_model=32, n_heads=2, n_layers=2)


class Documents(torch.utils.data.Dataset[torch.Tensor]):
    """Token sequences of the given lengths."""

    def __init__(self, lengths: Sequence[int], vocab: int = TINY.vocab_size, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.docs = [torch.randint(0, vocab, (length,), generator=gen) for length in lengths]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.docs[index]


def pad(docs: Sequence[torch.Tensor], multiple: int = 1, to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded input_ids and next-token labels (-100 on padding and on each last token)."""
    longest = to or -(-max(len(d) for d in docs) // multiple) * multiple
    input_ids = torch.zeros(len(docs), longest, dtype=torch.long)
    labels = torch.full((len(docs), longest), IGNORE, dtype=torch.long)
    for row, doc in enumerate(docs):
        input_ids[row, : len(doc)] = doc
        labels[row, : len(doc) - 1] = input_ids[row, 1 : len(doc)]  # no view of the dataset's tensor
    return {"input_ids": input_ids, "labels": labels}


def supervised(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"] != IGNORE).sum()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def worst_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)) for n in want)


def test_uneven_micro_batches_from_the_sampler_give_the_big_batch_gradient() -> None:
    lengths = lognormal_lengths(60, median=16, low=2, high=64, seed=4)
    dataset = Documents(lengths)
    sampler = LengthBatchSampler(lengths, token_capacity(160), target_tokens=400, pad_to_multiple_of=4,
                                 supervised_tokens=[n - 1 for n in lengths])
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=lambda docs: pad(docs, 4))
    torch.manual_seed(0)
    model = gpt.GPT(TINY).double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulation_steps=1)
    errors, mean_of_means = [], []
    updates = list(sampler.updates())
    for update, group in zip(updates, sampler.groups(acc, loader, count=supervised), strict=True):
        assert len(group) == len(update) and group.count == update.tokens
        for batch in group:
            with acc.micro_step():
                total, count = gpt.loss_sum(model, batch)
                acc.backward(total, count=count)
        accumulated = grads(model)
        acc.step()
        # The whole update as one batch, padded to its longest sample: the gradient to reproduce.
        samples = [dataset[i] for batch in update for i in batch]
        total, count = gpt.loss_sum(model, pad(samples))
        (total / count).backward()
        full = grads(model)
        model.zero_grad(set_to_none=True)
        for batch in update:  # the classic mistake on the same micro-batches, for the record
            total, count = gpt.loss_sum(model, pad([dataset[i] for i in batch], 4))
            (total / count / len(update)).backward()
        mean_of_means.append(worst_error(grads(model), full))
        model.zero_grad(set_to_none=True)
        errors.append(worst_error(accumulated, full))
    assert len(updates) >= 3 and any(len({len(b) for b in update}) > 1 for update in updates)
    assert max(errors) < 1e-10
    assert max(mean_of_means) > 1e-3
    assert acc.counters.updates == len(updates) and acc.counters.micro_batches == len(sampler)
    assert acc.counters.tokens == sum(n - 1 for n in lengths)


def test_verify_has_a_case_for_the_sampler_s_uneven_micro_batches() -> None:
    lengths = lognormal_lengths(80, median=16, low=2, high=64, seed=5)
    update = next(LengthBatchSampler(lengths, token_capacity(200), target_tokens=600).updates())
    sizes = [len(batch) for batch in update]
    assert len(set(sizes)) > 1
    report = verify_micro_batches(gpt.task, sizes)
    assert report.ok and report.target_batch == sum(sizes) and report.micro_batch == max(sizes)
    assert "uneven micro-batches of " + "+".join(map(str, sizes)) in report.message
    assert report.mean_of_means_error is not None and report.mean_of_means_error > 1e-2
    with pytest.raises(ValueError, match="two or more positive integers"):
        verify_micro_batches(gpt.task, [4])


def test_groups_refuses_a_loader_that_is_not_the_sampler_s() -> None:
    lengths = [8] * 40
    sampler = LengthBatchSampler(lengths, lambda length: 3, target_tokens=64)
    model = gpt.GPT(TINY)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulation_steps=1)
    dataset = Documents(lengths)
    short = DataLoader(dataset, batch_size=3, collate_fn=pad)  # 14 micro-batches; the sampler plans 15
    with pytest.raises(ValueError, match="the loader ran out at update"):
        for group in sampler.groups(acc, short):
            for batch in group:
                with acc.micro_step():
                    acc.backward(gpt.loss_sum(model, batch)[0])
            acc.step()


# -- a real CPU run: every micro-batch within the budget, the fixed plan at the typical length not ----

BUDGET = 16 * 2**20


@pytest.fixture(scope="module")
def probed() -> Any:
    from autotune.orchestrate.lengths import probe_lengths
    from autotune.orchestrate.probe import ProbeConfig

    return probe_lengths(gpt.task_seq, ProbeConfig(device="cpu", budget_bytes=BUDGET), [8, 64, 256])


def test_a_real_cpu_run_stays_within_the_budget_where_a_fixed_plan_does_not(probed: Any) -> None:
    from autotune.measure.meters.cpu import CpuMeter
    from autotune.measure.trial import build_model

    cap = capacity(probed.profiles)
    measured = {p.seq_len: p.max_micro_batch for p in probed.profiles}
    assert {length: cap(length) for length in measured} == measured
    lengths = lognormal_lengths(70, median=40, low=8, high=500, seed=6) + [500, 480]
    limit = int(BUDGET * 0.9)
    task = gpt.task_seq
    dataset = Documents(lengths, vocab=256)
    sampler = LengthBatchSampler(lengths, cap, target_tokens=2048, pad_to_multiple_of=8,
                                 supervised_tokens=[n - 1 for n in lengths])
    meter = CpuMeter(BUDGET)

    def train(loader: Any, steps: Callable[[Accumulator, Any], Any]) -> list[tuple[int, int, int]]:
        """(size, padded length, peak) of every micro-batch, each measured on its own."""
        peaks = []
        with meter.hold():
            model = build_model(task, meter)
            acc = Accumulator(model, task.make_optimizer(model.parameters()), accumulation_steps=1)
            for group in steps(acc, loader):
                for k, batch in enumerate(group):
                    with meter.measure():
                        with acc.micro_step():
                            total, count = gpt.loss_sum(model, batch)
                            acc.backward(total, count=count)
                        del total
                        if k == len(group) - 1:
                            acc.step()
                    peaks.append((*batch["input_ids"].shape, meter.reading().peak_bytes))
        return peaks

    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=lambda docs: pad(docs, 8))
    peaks = train(loader, lambda acc, data: sampler.groups(acc, data, count=supervised))
    assert len(peaks) == len(sampler) >= 5
    # Within the limit the probe fits to (budget less headroom), not only the budget: the group's
    # other micro-batches, which the Accumulator holds from the start of the update, are small.
    assert max(peak for _, _, peak in peaks) <= limit, peaks
    assert max(length for _, length, _ in peaks) >= 480  # the long samples ran, at their own size
    # The fixed plan at the typical length: m_max there for every micro-batch, in random order.
    typical = sorted(lengths)[len(lengths) // 2]
    fixed = DataLoader(dataset, batch_size=cap(typical), shuffle=True, collate_fn=lambda docs: pad(docs, 8),
                       generator=torch.Generator().manual_seed(0))
    with pytest.raises(torch.OutOfMemoryError):
        train(fixed, lambda acc, data: acc.groups(data, count=supervised))


def test_the_docs_blocks_run(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/length-batching.md's python blocks, in order, in one namespace, as written."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "length-batching.md").read_text()
    code = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    assert len(code) >= 6
    namespace: dict[str, Any] = {"__name__": "docs_length_batching"}
    for block in code:
        exec(compile(block, "docs/length-batching.md", "exec"), namespace)  # noqa: S102
    printed = capsys.readouterr().out
    assert "114 14 9 3 1 (8, 916)" in printed  # the figures the page shows
    assert "sample 1 has length 2000, longer than the capacity covers (up to 916)" in printed
    assert "accumulation reproduces the full-batch gradient" in printed


# -- under DDP: 2 gloo processes, every rank the same micro-batches per update, the big-batch result --


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
)
def test_under_ddp_every_rank_runs_its_share_and_training_equals_one_process(
    tmp_path: Any,
) -> None:
    from tests.autotune import _sampler_ddp_worker as worker
    from tests.ranks import spawn

    spawn(worker.run, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["replicas"] for r in results] == [(2, 0), (2, 1)]
    plan = [list(worker.sampler(num_replicas=2, rank=r).updates()) for r in range(2)]
    updates = len(plan[0])
    # The same number of micro-batches per update on both ranks, one gradient all-reduce per update.
    assert results[0]["sizes"] == results[1]["sizes"] == [len(u) for u in plan[0]] == [len(u) for u in plan[1]]
    assert all(r["allreduces"] == list(range(updates)) for r in results)
    # The reference: one process, each update's samples of both ranks as one batch.
    docs = worker.documents()
    torch.manual_seed(0)
    model = gpt.GPT(worker.TINY)
    optimizer = torch.optim.SGD(model.parameters(), lr=worker.LR)
    for shares in zip(*plan, strict=True):
        total, count = gpt.loss_sum(model, worker.pad([docs[i] for share in shares for b in share for i in b]))
        assert results[0]["denominators"][shares[0].position] == count == shares[0].tokens - shares[0].samples
        (total / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for name, want in model.named_parameters():
        for result in results:
            torch.testing.assert_close(result["params"][name], want.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_the_example_trains_within_the_budget_plain_and_packed(probed: Any) -> None:
    from examples import train_lengths

    cap = capacity(probed.profiles)
    lengths = train_lengths.lognormal_lengths(120, median=40, high=500, seed=7)
    dataset = train_lengths.Documents(lengths)
    logged: list[str] = []
    for pack_to in (None, 512):
        sampler = LengthBatchSampler(lengths, cap, target_tokens=3000, pad_to_multiple_of=8, pack_to=pack_to,
                                     supervised_tokens=[n - 1 for n in lengths])
        result = train_lengths.train(sampler, dataset, budget_bytes=BUDGET, log=logged.append)
        assert result["updates"] == len(list(sampler.updates())) >= 2
        assert 0 < result["peak_bytes"] <= BUDGET and result["tokens_per_second"] > 0
    assert logged and "micro-batches" in logged[0]
