"""The buffer rules over arrays (memsaving.model.buffers.BufferRows): hand-overs
paired write by write, and a prefix numbered once."""

from memsaving.model.buffers import Action, BufferRows, donations, memory_replay
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
