"""The buffer rules over arrays (memsaving.model.buffers.BufferRows): hand-overs
paired write by write, a prefix numbered once, and the replay as the
allocations and frees an allocator sees."""

from hypothesis import given, settings, strategies as st

from memsaving.model.buffers import (ALLOCATE, FREE, HAND_OVER, Action, BufferRows, donations, memory_replay,
                                     replay_with_events)
from memsaving.model.graph import chain_model
from memsaving.model.schedule import backward_units, kept_set
from memsaving.sim.actions import forward_actions, step_actions


def _last_reads(actions):
    return {key: i for i, action in enumerate(actions) for key in action.reads}


def test_each_write_takes_the_first_dying_read_of_its_size():
    actions = [
        Action("make", [], [(("a",), 4), (("b",), 8), (("c",), 4), (("d",), 4)]),
        # reads a twice and d, which it also writes: d is not handed over
        Action("in place", [("a",), ("b",), ("a",), ("c",), ("d",)],
               [(("x",), 4), (("y",), 4), (("z",), 8), (("d",), 4), (("w",), 4)], forwards_buffers=True),
    ]
    given = donations(actions, _last_reads(actions))
    assert given == {(1, ("x",)): ("a",), (1, ("y",)): ("c",), (1, ("z",)): ("b",)}


def test_no_hand_over_of_a_pinned_buffer_or_one_read_later():
    actions = [
        Action("make", [], [(("a",), 4), (("b",), 4)]),
        Action("in place", [("a",), ("b",)], [(("x",), 4)], forwards_buffers=True),
        Action("later", [("b",)], []),
    ]
    assert donations(actions, _last_reads(actions), pinned={("a",)}) == {}


def test_a_prefix_numbered_once_gives_the_same_replay():
    model = chain_model([4, 8, 4, 16])
    kept = kept_set(model, [1])
    actions, _ = step_actions(model, kept, backward_units(model, kept))
    forward = BufferRows(forward_actions(model))
    for pinned in (set(), {("g", 0)}):
        assert memory_replay(actions, pinned, forward) == memory_replay(actions, pinned)
    # a list that does not start with the prefix's actions ignores it
    reordered = actions[1:] + actions[:1]
    assert memory_replay(reordered, set(), forward) == memory_replay(reordered, set())


@st.composite
def _action_lists(draw):
    """Random actions: writes of new buffers and rewrites of earlier ones,
    reads, results, in-place writers, temporaries; and some pinned keys."""
    made, actions = [], []
    for i in range(draw(st.integers(1, 12))):
        reads = [draw(st.sampled_from(made)) for _ in range(draw(st.integers(0, 3)))] if made else []
        writes = []
        for _ in range(draw(st.integers(0, 3))):
            if made and draw(st.integers(0, 4)) == 0:
                key = draw(st.sampled_from(made))
            else:
                key = ("k", len(made))
                made.append(key)
            writes.append((key, draw(st.sampled_from([0, 4, 8, 8, 16]))))
        results = tuple(key for key, _ in writes if draw(st.booleans()))
        actions.append(Action(f"a{i}", reads, writes, forwards_buffers=draw(st.booleans()), results=results,
                              temp=draw(st.sampled_from([0, 0, 4, 12]))))
    pinned = {key for key in made if draw(st.integers(0, 4)) == 0}
    return actions, pinned


def _summed(events):
    """Peak and final bytes of the buffers the events hold, checking that
    each event is done to a buffer in the state it needs."""
    held, in_use, peak = {}, 0, 0
    for kind, key, value in zip(events.kinds, events.keys, events.values):
        if kind == ALLOCATE:
            assert key not in held, f"{key} allocated twice"
            held[key] = value
            in_use += value
            peak = max(peak, in_use)
        elif kind == FREE:
            in_use -= held.pop(key)
        else:
            assert kind == HAND_OVER and value not in held
            held[value] = held.pop(key)
    return peak, in_use


@settings(max_examples=200, deadline=None)
@given(_action_lists())
def test_the_replay_as_allocations_and_frees_holds_what_the_replay_counts(drawn):
    actions, pinned = drawn
    timeline, peak, events = replay_with_events(BufferRows(actions), pinned)
    assert (timeline, peak) == memory_replay(actions, pinned)
    assert _summed(events) == (peak, timeline[-1])


def test_a_buffer_handed_over_in_place_gives_its_memory_to_the_write():
    actions = [Action("make", [], [(("a",), 8)]),
               Action("in place", [("a",)], [(("b",), 8)], forwards_buffers=True),
               Action("read", [("b",)], [])]
    _, _, events = replay_with_events(BufferRows(actions), set())
    number = BufferRows(actions).number
    assert list(zip(events.kinds, events.keys, events.values)) == [
        (ALLOCATE, number[("a",)], 8), (HAND_OVER, number[("a",)], number[("b",)]), (FREE, number[("b",)], 0)]
