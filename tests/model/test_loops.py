"""Loops checkpointed inside on the graph model: which loops the memory mode
checkpoints, and how their figures change (memsaving.model.loops)."""

from dataclasses import replace

from memsaving.model.graph import chain_model
from memsaving.model.loops import checkpointable_loops, with_loops_checkpointed
from memsaving.planners.registry import PlanRequest, make_plan_for

MiB = 2 ** 20


def _with_a_loop(saved, checkpointed, grad_temp=0):
    """A chain of 1 MiB tensors whose third op is a loop saving ``saved`` bytes for its gradient."""
    model = chain_model([MiB] * 6)
    ops = list(model.ops)
    ops[2] = replace(ops[2], type="While", copyable=False, saved_bytes=saved, grad_temp_bytes=grad_temp,
                     checkpointed_grad_temp_bytes=checkpointed, grad_seconds=0.5, checkpointed_grad_seconds=0.8)
    return replace(model, ops=ops)


def test_a_loop_is_checkpointed_only_where_its_gradient_then_holds_less():
    assert checkpointable_loops(_with_a_loop(saved=40 * MiB, checkpointed=4 * MiB)) == [2]
    assert checkpointable_loops(_with_a_loop(saved=4 * MiB, checkpointed=8 * MiB)) == []  # a scan of a tanh
    assert checkpointable_loops(_with_a_loop(saved=0, checkpointed=0)) == []  # not profiled: nothing known
    assert checkpointable_loops(chain_model([MiB] * 3)) == []


def test_the_checkpointed_model_saves_nothing_and_plain_figures_keep_the_loop_whole():
    model = _with_a_loop(saved=40 * MiB, checkpointed=4 * MiB)
    checkpointed = with_loops_checkpointed(model)
    loop = checkpointed.ops[2]
    assert (loop.saved_bytes, loop.grad_temp_bytes, loop.grad_seconds) == (0, 4 * MiB, 0.8)
    assert checkpointed.unfolded is model
    assert model.ops[2].saved_bytes == 40 * MiB, "the model given is left as it was"


def test_memory_mode_plans_checkpoint_the_loop_and_the_users_checkpoints_do_not():
    model = _with_a_loop(saved=40 * MiB, checkpointed=4 * MiB)
    memory = make_plan_for(PlanRequest(model, checkpoints="memory"))
    assert memory.checkpointed_loops == ["op3"]
    assert "1 loops checkpointed inside" in memory.table()
    # plain tf.gradients keeps the loop's 40 MiB from its forward to its gradient
    assert memory.plain_peak >= memory.predicted_peak + 30 * MiB, memory.table()
    listed = make_plan_for(PlanRequest(model, checkpoints="list", named_ops=("op2",)))
    assert listed.checkpointed_loops == []
    assert listed.predicted_peak > memory.predicted_peak


def test_a_budget_plan_fits_below_plain_by_checkpointing_the_loop():
    """A budget between plain's peak and the checkpointed loop's: met only with the loop
    checkpointed inside, which the plan names."""
    model = _with_a_loop(saved=40 * MiB, checkpointed=4 * MiB)
    memory = make_plan_for(PlanRequest(model, checkpoints="memory"))
    budget = memory.predicted_peak + 4 * MiB
    assert budget < memory.plain_peak
    planned = make_plan_for(PlanRequest(model, budget=budget))
    assert planned.checkpointed_loops == ["op3"] and planned.device_peak <= budget


def test_a_budget_the_whole_loop_fits_keeps_it_whole():
    """Checkpointing a loop inside runs its forward twice more: a budget met without it keeps
    TensorFlow's loop gradient."""
    model = _with_a_loop(saved=40 * MiB, checkpointed=4 * MiB)
    roomy = 2 * make_plan_for(PlanRequest(model, checkpoints="memory")).plain_peak
    planned = make_plan_for(PlanRequest(model, budget=roomy))
    assert planned.checkpointed_loops == [] and planned.device_peak <= roomy
