"""A variable read twice (a tied embedding) gets one gradient: TensorFlow sums
the contributions of its reads, holding the first until the last arrives.
The simulator must count that holding (it under-predicted keras_hub's GPT2
by the embedding's gradient before)."""

from chains import dense_chain
from memsaving.model.graph import shared_results
from memsaving.sim.actions import step_blocks
from memsaving.model.schedule import backward_units, kept_set
from memsaving.sim.replay import plain_schedule, simulate_schedule
from memsaving.sim.simulate import simulate

WEIGHT = 4096
ACTIVATION = 64


def _chain(tied):
    return dense_chain(6, WEIGHT, ACTIVATION, tied=tied)


def test_the_reads_of_one_variable_share_its_result():
    tied = _chain(tied=True)
    assert shared_results(tied) == {2: (1, 2), 52: (1, 2)}
    assert shared_results(_chain(tied=False)) == {}


def _above_resident(simulation, model):
    return simulation.peak_bytes - model.resident_bytes


def test_the_first_contribution_is_held_until_the_last():
    # the last layer's weight gradient (made first) lives through the whole
    # backward pass, beside each other layer's weight gradient
    tied, untied = _chain(tied=True), _chain(tied=False)
    held = _above_resident(simulate(tied), tied)
    assert held >= _above_resident(simulate(untied), untied) + WEIGHT - ACTIVATION
    assert held >= 2 * WEIGHT


def test_replays_of_events_count_it_too():
    for tied in (True, False):
        model = _chain(tied=tied)
        assert simulate_schedule(model, plain_schedule(model)).peak_bytes == simulate(model).peak_bytes


def test_kept_results_are_counted_once():
    # the caller keeps the results: the partial sum goes, the variable's gradient stays
    tied, untied = _chain(tied=True), _chain(tied=False)
    assert (_above_resident(simulate(tied, keep_x_gradients=True), tied)
            <= _above_resident(simulate(untied, keep_x_gradients=True), untied))


def test_plans_of_a_model_with_shared_results_are_not_cut_into_remembered_blocks():
    model = _chain(tied=True)
    kept = kept_set(model, [3])
    assert step_blocks(model, backward_units(model, kept)) is None
