"""The model of TensorFlow's BFC allocator (memsaving.sim.allocator): hand-worked
sequences, and the invariants of any sequence."""

from hypothesis import given, settings, strategies as st
import pytest

from memsaving.model.buffers import ALLOCATE, FREE, HAND_OVER, Action, AllocationEvents, BufferRows, replay_with_events
from memsaving.model.graph import chain_model
from memsaving.sim.allocator import (FIRST_REGION, SPLIT_EXCESS, Allocator, AllocatorExhausted, replay,
                                     rounded)
from memsaving.sim.simulate import simulate

KIB, MIB = 1 << 10, 1 << 20


def _owned(bfc: Allocator) -> dict:
    """key -> (region, offset in its region, bytes) of each chunk in use."""
    starts = [start for start, _ in bfc.regions]
    return {c.owner: (c.region, c.address - starts[c.region], c.size) for c in bfc.chunks() if c.owner is not None}


def test_requests_are_rounded_to_256_bytes_and_zero_bytes_hold_nothing():
    bfc = Allocator()
    assert [bfc.allocate(k, n) for k, n in enumerate([1, 256, 257, 0])] == [256, 256, 512, 0]
    assert bfc.in_use == 1024 and not bfc.holds(3)
    bfc.free(3)  # holds nothing: frees nothing
    assert bfc.in_use == 1024


def test_a_free_chunk_less_than_twice_the_request_is_given_whole():
    bfc = Allocator()
    bfc.allocate("a", 600 * KIB)
    bfc.allocate("b", 400 * KIB)  # "b" right after "a": freeing "a" leaves a 600 KiB hole below "b"
    bfc.free("a")
    # the hole is the smallest free chunk that fits (the region's tail is 1,048 KiB) and is
    # under twice 400 KiB: it is not split
    assert bfc.allocate("c", 400 * KIB) == 600 * KIB
    assert bfc.in_use == 1000 * KIB and _owned(bfc)["c"] == (0, 0, 600 * KIB)


def test_a_free_chunk_twice_the_request_is_split_and_its_tail_reused():
    bfc = Allocator()
    bfc.allocate("a", 600 * KIB)
    bfc.allocate("b", 400 * KIB)
    bfc.free("a")
    assert bfc.allocate("c", 300 * KIB) == 300 * KIB  # 600 KiB is twice 300 KiB: split
    assert bfc.allocate("d", 300 * KIB) == 300 * KIB  # the hole's other half, not the region's tail
    assert _owned(bfc)["c"] == (0, 0, 300 * KIB) and _owned(bfc)["d"] == (0, 300 * KIB, 300 * KIB)
    assert bfc.in_use == 1000 * KIB and bfc.pool_bytes == FIRST_REGION


def test_an_excess_of_128_mib_splits_whatever_the_ratio():
    # a fresh allocator makes a region of the next power of two times 2 MiB for each
    assert Allocator().allocate("x", 200 * MIB) == 256 * MIB  # 56 MiB over, under twice: whole
    bfc = Allocator()
    assert bfc.allocate("y", 300 * MIB) == 300 * MIB  # 212 MiB over: split
    assert bfc.pool_bytes == 512 * MIB and SPLIT_EXCESS == 128 * MIB


def test_equal_free_chunks_go_lowest_address_first():
    bfc = Allocator()
    for key in "abcde":
        bfc.allocate(key, 100 * KIB)
    bfc.free("d")
    bfc.free("b")  # two 100 KiB holes, "b"'s lower
    bfc.allocate("x", 100 * KIB)
    assert _owned(bfc)["x"] == _owned(bfc)["c"][:1] + (100 * KIB, 100 * KIB)


def _two_equal_holes(bfc: Allocator) -> None:
    """A 2 KiB hole at the start of the first region (4 KiB) and one at the
    start of the third (16 KiB)."""
    for key, nbytes in (("a1", 2), ("a2", 2), ("b", 8), ("c1", 2), ("c2", 14)):
        bfc.allocate(key, nbytes * KIB)  # c1 finds no hole: it splits the third region
    bfc.free("a1")
    bfc.free("c1")


def test_a_new_region_lies_below_the_older_ones_and_wins_ties():
    bfc = Allocator(first_region=4 * KIB)
    _two_equal_holes(bfc)
    bfc.allocate("d", 2 * KIB)
    assert [size for _, size in bfc.regions] == [4 * KIB, 8 * KIB, 16 * KIB]
    assert [start for start, _ in bfc.regions] == sorted((start for start, _ in bfc.regions), reverse=True)
    assert _owned(bfc)["d"] == (2, 0, 2 * KIB)
    ascending = Allocator(first_region=4 * KIB, descending=False)
    _two_equal_holes(ascending)
    ascending.allocate("d", 2 * KIB)
    assert _owned(ascending)["d"] == (0, 0, 2 * KIB)


def test_a_freed_chunk_merges_with_free_neighbours_in_its_region():
    bfc = Allocator()
    for key in "abc":
        bfc.allocate(key, 512 * KIB)
    bfc.free("a")
    bfc.free("c")  # merges with the region's tail
    assert [(c.size, c.owner) for c in bfc.chunks()] == [(512 * KIB, None), (512 * KIB, "b"), (1 * MIB, None)]
    bfc.free("b")  # merges with both
    assert [(c.size, c.owner) for c in bfc.chunks()] == [(2 * MIB, None)]
    assert bfc.allocate("whole", 2 * MIB) == 2 * MIB and bfc.pool_bytes == 2 * MIB


def test_regions_never_merge():
    bfc = Allocator(first_region=4 * KIB)
    bfc.allocate("a", 4 * KIB)  # region 0, full
    bfc.allocate("b", 8 * KIB)  # region 1, full
    bfc.free("a")
    bfc.free("b")
    assert sorted(c.size for c in bfc.chunks()) == [4 * KIB, 8 * KIB]
    bfc.allocate("c", 12 * KIB)  # no free chunk of 12 KiB: a third region
    assert len(bfc.regions) == 3


def test_regions_double_and_a_large_request_raises_the_size_without_doubling_after():
    bfc = Allocator()
    assert bfc.allocate("a", 1536 * KIB) == 2 * MIB  # region 1: 2 MiB, taken whole
    assert bfc.allocate("b", 1 * MIB) == 1 * MIB  # region 2: doubled to 4 MiB, split
    assert bfc.allocate("c", 5 * MIB) == 8 * MIB  # 3 MiB free is too small: region 3 of 8 MiB, whole
    assert bfc.allocate("d", 20 * MIB) == 32 * MIB  # 16 MiB is too small: raised to 32 MiB, whole
    assert bfc.allocate("e", 4 * MIB) == 4 * MIB  # 3 MiB free: region 5, still 32 MiB (not doubled after d)
    assert [size for _, size in bfc.regions] == [2 * MIB, 4 * MIB, 8 * MIB, 32 * MIB, 32 * MIB]
    assert bfc.pool_bytes == 78 * MIB and bfc.next_region == 64 * MIB


def test_no_region_past_the_limit():
    bfc = Allocator(limit=4 * MIB)
    assert bfc.allocate("a", 3 * MIB) == 4 * MIB  # the region is the limit, taken whole
    with pytest.raises(AllocatorExhausted, match="larger limit"):
        bfc.allocate("b", 1)
    limited = Allocator(limit=5 * MIB)
    limited.allocate("a", 2 * MIB)
    assert limited.allocate("b", 2 * MIB) == 3 * MIB  # the second region is what the limit leaves


def test_a_hand_over_keeps_the_chunk_and_the_peak_resets_to_what_is_in_use():
    bfc = Allocator()
    bfc.allocate("a", 600 * KIB)
    bfc.allocate("b", 400 * KIB)
    bfc.free("b")
    bfc.hand_over("a", "a in place")
    assert bfc.chunk_bytes("a in place") == 600 * KIB and not bfc.holds("a")
    assert (bfc.in_use, bfc.peak) == (600 * KIB, 1000 * KIB)
    bfc.reset_peak()
    assert bfc.peak == 600 * KIB


def test_bad_requests_say_what_to_do():
    bfc = Allocator()
    bfc.allocate("a", 10)
    with pytest.raises(ValueError, match="free it first"):
        bfc.allocate("a", 10)
    with pytest.raises(ValueError, match="0 or more"):
        bfc.allocate("b", -1)
    with pytest.raises(ValueError, match="free it first"):
        bfc.hand_over("b", "a")
    with pytest.raises(ValueError, match="positive"):
        Allocator(limit=0)


def test_replay_runs_allocations_frees_and_hand_overs_in_order():
    events = AllocationEvents([ALLOCATE, ALLOCATE, FREE, HAND_OVER, ALLOCATE],
                              [1, 2, 1, 2, 4], [600 * KIB, 400 * KIB, 0, 3, 400 * KIB])
    bfc = replay(events)
    assert bfc.chunk_bytes(3) == 400 * KIB and bfc.chunk_bytes(4) == 600 * KIB
    assert (bfc.in_use, bfc.peak) == (1000 * KIB, 1000 * KIB)


@st.composite
def _operations(draw):
    """A random run of allocations (sizes around a few regions' worth, so
    that chunks split, merge and regions grow), frees and hand-overs."""
    steps, live, made = [], [], 0
    for _ in range(draw(st.integers(1, 60))):
        choice = draw(st.integers(0, 9))
        if live and choice < 3:
            steps.append(("free", live.pop(draw(st.integers(0, len(live) - 1)))))
        elif live and choice == 3:
            key = live.pop(draw(st.integers(0, len(live) - 1)))
            steps.append(("hand_over", key, made))
            live.append(made)
            made += 1
        else:
            scale = draw(st.sampled_from([1, 256, 4 * KIB, 256 * KIB, 1 * MIB]))
            steps.append(("allocate", made, draw(st.integers(0, 8)) * scale + draw(st.integers(0, 300))))
            live.append(made)
            made += 1
    return steps


@settings(max_examples=300, deadline=None)
@given(_operations())
def test_chunks_tile_their_regions_and_in_use_is_their_sum(steps):
    bfc = Allocator()
    requested = {}
    for step in steps:
        if step[0] == "allocate":
            requested[step[1]] = rounded(step[2])
            chunk = bfc.allocate(step[1], step[2])
            # a chunk is at least the rounded request and is split when twice it
            assert chunk == 0 if step[2] == 0 else (requested[step[1]] <= chunk < 2 * requested[step[1]])
        elif step[0] == "free":
            bfc.free(step[1])
        else:
            bfc.hand_over(step[1], step[2])
        chunks = bfc.chunks()
        assert bfc.in_use == sum(c.size for c in chunks if c.owner is not None)
        assert bfc.peak >= bfc.in_use
        assert bfc.pool_bytes == sum(size for _, size in bfc.regions)
        for number, (start, size) in enumerate(bfc.regions):
            mine = [c for c in chunks if c.region == number]
            assert mine[0].address == start and sum(c.size for c in mine) == size
            assert all(a.address + a.size == b.address for a, b in zip(mine, mine[1:])), "chunks overlap or gap"
            assert not any(a.owner is None and b.owner is None for a, b in zip(mine, mine[1:])), "free neighbours"
        ends = sorted((start, start + size) for start, size in bfc.regions)
        assert all(a[1] < b[0] for a, b in zip(ends, ends[1:])), "regions overlap or touch"


def _step_chunks(forwards_buffers: bool):
    """Hand-made actions through the buffer rules' events and the model:
    "a" (600 KiB) dies after "b" (400 KiB) reads it; "c" (400 KiB, with a
    100 KiB temporary) reads "b" last, and may write in its place."""
    actions = [Action("a", [], [(("a",), 600 * KIB)]),
               Action("b", [("a",)], [(("b",), 400 * KIB)]),
               Action("c", [("b",)], [(("c",), 400 * KIB)], temp=100 * KIB, forwards_buffers=forwards_buffers),
               Action("use c", [("c",)], [])]
    _, live_peak, events = replay_with_events(BufferRows(actions), set())
    return live_peak, replay(events)


def test_a_step_replayed_through_the_allocator_counts_whole_chunks():
    live_peak, bfc = _step_chunks(forwards_buffers=False)
    # "c" gets "a"'s 600 KiB hole whole (under twice 400 KiB) while "b" and the temporary are held
    assert live_peak == 1000 * KIB and bfc.peak == 1100 * KIB
    assert bfc.in_use == 0 and [c.size for c in bfc.chunks()] == [FIRST_REGION]


def test_a_write_in_place_keeps_the_dying_input_chunk():
    live_peak, bfc = _step_chunks(forwards_buffers=True)
    # "c" takes over "b"'s chunk: no new chunk, the temporary is split off the region's tail
    assert live_peak == 1000 * KIB and bfc.peak == 1000 * KIB


def test_simulate_with_the_allocator_counts_256_bytes_for_each_tiny_buffer():
    # buffers of 3 bytes each hold a chunk of 256: the chunk peak is 256 per buffer live at the peak
    model = chain_model([3] * 10)
    for kwargs in (dict(), dict(checkpoint_ops=[4]), dict(plain=True, unpinned=True)):
        simulation = simulate(model, allocator=True, **kwargs)
        live_buffers = (simulation.peak_bytes - model.resident_bytes) // 3
        assert simulation.chunk_peak_bytes - model.resident_bytes == 256 * live_buffers, kwargs
        assert simulate(model, **kwargs).chunk_peak_bytes is None
    with pytest.raises(ValueError, match="leave allocator off"):
        simulate(model, swapped=[3], allocator=True)
