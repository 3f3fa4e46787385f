"""Bad input gets an error that says what is wrong and what to do."""

from functools import partial

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import mlp_weights, tanh_mlp
from memsaving.options import parse_options

W = [tf.Variable(tf.ones([4, 4]) * 0.1) for _ in range(3)]
SPEC = tf.TensorSpec([2, 4])
_weights = partial(mlp_weights, width=12)


def _loss(x):
    h = tanh_mlp(x, W)
    return tf.reduce_sum(h * h)


def _trace(fn):
    tf.function(fn).get_concrete_function(SPEC)


# ys, xs and grad_ys.

def test_ys_not_a_tensor():
    @tf.function
    def step(x):
        return memsaving.gradients(3.0, W)

    with pytest.raises(TypeError, match="ys must be tf.Tensor"):
        step.get_concrete_function(tf.TensorSpec([2, 4]))


def test_xs_from_an_unrelated_graph_is_refused_with_advice():
    other = tf.Graph()
    with other.as_default():
        stranger = tf.compat.v1.placeholder(tf.float32, [2], name="stranger")
    with pytest.raises(ValueError, match=r"stranger:0 belongs to another graph.*same tf.function"):
        _trace(lambda x: memsaving.gradients(_loss(x), [stranger], checkpoints="memory"))


def test_grad_ys_length_mismatch():
    @tf.function
    def step(x):
        h = tanh_mlp(x, W)
        return memsaving.gradients([h], W, grad_ys=[h, h], checkpoints=[])

    with pytest.raises(ValueError, match="grad_ys"):
        step.get_concrete_function(tf.TensorSpec([2, 4]))


# Checkpoints.

def test_checkpoint_outside_forward_graph_is_named():
    @tf.function
    def step(x):
        unrelated = tf.sqrt(tf.ones([3]), name="unrelated_sqrt")
        loss = tf.reduce_sum(tanh_mlp(x, W))
        return memsaving.gradients(loss, W, checkpoints=[unrelated])

    with pytest.raises(memsaving.CheckpointError, match="unrelated_sqrt"):
        step.get_concrete_function(tf.TensorSpec([2, 4]))


def test_checkpoint_after_ys_is_rejected():
    @tf.function
    def step(x):
        h = tanh_mlp(x, W)
        loss = tf.reduce_sum(h)
        later = tf.exp(loss, name="after_loss")
        return memsaving.gradients(loss, W, checkpoints=[later])

    with pytest.raises(memsaving.CheckpointError, match="after_loss"):
        step.get_concrete_function(tf.TensorSpec([2, 4]))


def test_empty_collection_says_how_to_mark():
    @tf.function
    def step(x):
        return memsaving.gradients(tf.reduce_sum(tanh_mlp(x, W)), W, checkpoints="collection")

    with pytest.raises(memsaving.CheckpointError, match="memsaving.checkpoint"):
        step.get_concrete_function(tf.TensorSpec([2, 4]))


@pytest.mark.parametrize("checkpoints", [None, 5, 2.5])
def test_checkpoints_of_the_wrong_type(checkpoints):
    with pytest.raises(TypeError, match=r"pass a list of tensors, or one of 'memory' \(the default\)"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints=checkpoints))


@pytest.mark.parametrize("what", ["variable", "constant", "before_xs"])
def test_checkpoints_not_between_xs_and_ys(what):
    def step(x):
        a = x * 3.0  # xs is a; x is before it
        loss = tf.reduce_sum(tf.tanh(tf.matmul(a, W[0])))
        chosen = {"variable": W[1], "constant": tf.constant(1.0, name="a_constant"), "before_xs": x}[what]
        return memsaving.gradients(loss, [a, W[0]], checkpoints=[chosen])

    with pytest.raises(memsaving.CheckpointError, match="not in the forward graph between xs and ys"):
        _trace(step)


@pytest.mark.parametrize("checkpoints, kind", [([1, 2], "int"), ((3.0,), "float"), (["Tanh:0"], "str"),
                                               ([None], "NoneType")])
def test_a_list_of_checkpoints_that_holds_no_tensors_is_a_type_error(checkpoints, kind):
    """Such lists used to get a CheckpointError about the graph."""

    def step(x):
        return memsaving.gradients(_loss(x), W, checkpoints=checkpoints)

    with pytest.raises(TypeError, match=rf"checkpoints\[0\] is a {kind} .*holds tensors \(or variables\)"):
        _trace(step)
    with pytest.raises(TypeError, match=r"checkpoints\[0\] is a"):
        memsaving.patch(checkpoints)


def test_a_tensor_inside_a_loop_body_cannot_be_a_checkpoint():
    """The loop body is another graph: a tensor from it is refused by name."""
    ws = _weights(2)
    inside = {}

    @tf.function
    def step(x):
        def body(i, v):
            inside["t"] = tf.tanh(tf.matmul(v, ws[0]), name="body_tanh")
            return i + 1, inside["t"]

        h = tf.while_loop(lambda i, v: i < 2, body, (0, x))[1]
        loss = tf.reduce_sum(tf.matmul(h, ws[1]))
        return memsaving.gradients(loss, ws, checkpoints=[inside["t"]])

    with pytest.raises(memsaving.CheckpointError, match="body_tanh"):
        step.get_concrete_function(tf.TensorSpec([4, 12]))


# Budget and batch_size.

def test_infeasible_budget_states_the_smallest_which_then_fits():
    @tf.function
    def step(x):
        loss = _loss(x)
        with pytest.raises(memsaving.BudgetError) as info:
            memsaving.gradients(loss, W, checkpoints="memory", budget=10)
        message = str(info.value)
        assert "smallest feasible budget" in message and "Raise the budget" in message
        # budget= alone measures nothing: the error points to the routes that do
        assert "Or let the step be measured: memsaving.fit_to_budget" in message
        smallest = info.value.smallest_budget
        assert smallest > 10 and f"found is {smallest:,} bytes" in message
        plan = memsaving.plan(loss, W, checkpoints="memory", budget=smallest)
        assert plan.predicted_peak <= smallest
        return tf.gradients(loss, W), memsaving.gradients(loss, W, checkpoints="memory", budget=smallest)

    plain, ours = step(tf.ones([2, 4]))
    for p, o in zip(plain, ours):
        np.testing.assert_allclose(o.numpy(), p.numpy(), rtol=1e-6)


def test_the_budget_refused_and_the_smallest_are_printed_to_the_byte():
    """Both figures to the byte: rounded to a tenth of a MiB, a budget just
    under the lowest plan and the smallest feasible budget (that plan's peak
    and a slack) read the same ("no plan fits the budget of 6.0 MiB; the
    smallest feasible budget found is 6.0 MiB")."""
    ws = mlp_weights(12, width=256)
    refused = []

    @tf.function
    def step(x):
        loss = tf.reduce_sum(tanh_mlp(x, ws))
        with pytest.raises(memsaving.BudgetError) as info:
            memsaving.plan(loss, ws, checkpoints="memory", budget=1, profile=False)
        smallest = info.value.smallest_budget
        # from just under the lowest plan's peak down, the first budget refused
        for budget in range(smallest - smallest // 200 - 16 * 1024 - 1, smallest // 2, -8 * 1024):
            try:
                memsaving.plan(loss, ws, checkpoints="memory", budget=budget, profile=False)
            except memsaving.BudgetError as error:
                refused.append((budget, error))
                break
        return loss

    step.get_concrete_function(tf.TensorSpec([256, 256]))
    budget, error = refused[0]
    message = str(error)
    assert error.smallest_budget > budget
    assert f"fits the budget of {budget:,} bytes (" in message
    assert f"the smallest feasible budget found is {error.smallest_budget:,} bytes (" in message


def test_the_smallest_budget_is_stored_with_the_error_never_read_from_its_message():
    assert memsaving.BudgetError("an error of our own (4096 bytes)").smallest_budget is None
    assert memsaving.BudgetError.carrying("a message without the figure", 4096).smallest_budget == 4096
    # out of a tf.function, AutoGraph raises a copy made from the message
    # alone, while handling the original: the copy reads the original's figure
    with pytest.raises(memsaving.BudgetError) as info:
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints="memory", budget=10))
    original = info.value.__context__
    assert isinstance(original, memsaving.BudgetError) and original is not info.value
    assert info.value.smallest_budget == original.smallest_budget > 10


@pytest.mark.parametrize("budget, message", [("lots", "512MiB"), (-5, "positive"), ("12 parsecs", "2GiB"),
                                             (3.5j, "int number of bytes")])
def test_bad_budgets_say_what_to_pass(budget, message):
    ws = mlp_weights(2)

    @tf.function
    def step(x):
        loss = tf.reduce_sum(tf.matmul(tf.tanh(tf.matmul(x, ws[0])), ws[1]))
        return memsaving.gradients(loss, ws, budget=budget)

    with pytest.raises((ValueError, TypeError), match=message):
        step(tf.ones([4, 16]))


@pytest.mark.parametrize("budget", ["2 gigabytes", "1e3XB", "MiB", "--1KiB", "1,5GB", "", [1], 1.5, "0.5", 0.25])
def test_bad_budget_values_say_what_to_pass(budget):
    with pytest.raises((ValueError, TypeError), match=r"'2GiB'"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints="memory", budget=budget))


@pytest.mark.parametrize("budget", [float("nan"), float("inf")])
def test_non_finite_float_budgets_say_what_to_pass(budget):
    with pytest.raises(ValueError, match=r"'2GiB'"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints="memory", budget=budget))


@pytest.mark.parametrize("budget", ["2GiB", "512 MiB", "1.5GB", "500000kb", 10 ** 9, 1e9])
def test_good_budget_spellings_are_accepted(budget):
    _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints="memory", budget=budget))


def test_budget_with_an_empty_candidate_list():
    with pytest.raises(memsaving.CheckpointError, match=r"checkpoints=\[tensors\]"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints=[], budget="1MiB"))


@pytest.mark.parametrize("batch_size", ["abc", "8", 0, -2, 2.5, True])
def test_bad_batch_size_says_what_to_pass(batch_size):
    """Strings and fractions used to fail in int() or be truncated."""
    with pytest.raises(ValueError, match=r"batch_size=.*positive int"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints="memory", batch_size=batch_size))
    with pytest.raises(ValueError, match=r"batch_size=.*positive int"):
        _trace(lambda x: memsaving.plan(_loss(x), W, checkpoints="memory", batch_size=batch_size))


# Swap.

@pytest.mark.parametrize("kwargs, error, message", [
    (dict(swap="auto"), ValueError, "pass budget="),
    (dict(swap=True, swap_lb="3"), ValueError, "swap_lb must be an int"),
    (dict(swap=True, swap_ub=2.5), ValueError, "swap_ub must be an int"),
    (dict(swap=True, swap_lb=10, swap_ub=2), ValueError, "0 <= lb <= ub"),
    (dict(swap=True, swap_lb=-1), ValueError, "0 <= lb <= ub"),
    (dict(swap=[3.0]), TypeError, "swap: the list holds a float"),
    (dict(swap="all"), ValueError, "swap=True"),
])
def test_bad_swap_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints="memory", **kwargs))


def test_keras_enable_swap_auto_needs_a_budget():
    import keras

    import memsaving.keras as mkeras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="needs budget="):
        mkeras.enable(model, swap="auto")


# Checkpoint modes, unknown keywords and other keyword values.

def test_unknown_mode_and_keyword():
    @tf.function
    def bad_mode(x):
        return memsaving.gradients(tf.reduce_sum(tanh_mlp(x, W)), W, checkpoints="fastest")

    with pytest.raises(memsaving.CheckpointError, match="unknown checkpoints mode"):
        bad_mode.get_concrete_function(tf.TensorSpec([2, 4]))

    @tf.function
    def bad_kw(x):
        return memsaving.gradients(tf.reduce_sum(tanh_mlp(x, W)), W, checkpoints="memory", colour="red")

    with pytest.raises(TypeError, match="colour"):
        bad_kw.get_concrete_function(tf.TensorSpec([2, 4]))


@pytest.mark.parametrize("mode", ["MEMORY", "", "sqrt", "speed "])
def test_bad_checkpoint_mode_strings(mode):
    with pytest.raises(memsaving.CheckpointError, match=r"unknown checkpoints mode.*'collection', 'speed', 'memory'"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints=mode))
    with pytest.raises(memsaving.CheckpointError, match="unknown checkpoints mode"):
        _trace(lambda x: memsaving.plan(_loss(x), W, checkpoints=mode))


def test_plan_in_eager_mode_and_with_unknown_keywords():
    with pytest.raises(RuntimeError, match="tf.function"):
        memsaving.plan(tf.ones([2]), W)
    with pytest.raises(TypeError, match="colour"):
        _trace(lambda x: memsaving.plan(_loss(x), W, checkpoints="memory", colour="red"))


@pytest.mark.parametrize("keywords, error, message", [
    ({"batch_size": 0}, ValueError, "batch_size=0 is not supported"),
    ({"batch_size": 2.5}, ValueError, "batch_size=2.5 is not supported"),
    ({"profile": "yes"}, TypeError, "profile='yes' is not supported"),
    ({"follow_order": "yes"}, TypeError, "follow_order='yes'"),
    ({"unconnected_gradients": "maybe"}, ValueError, "maybe"),
])
def test_bad_values_say_what_to_pass(keywords, error, message):
    with pytest.raises(error, match=message):
        parse_options(keywords)


# Eager mode and TF1 graphs.

def test_eager_mode_raises_runtime_error_pointing_to_tf_function():
    x = tf.ones([2, 4])
    with pytest.raises(RuntimeError, match="tf.function"):
        memsaving.gradients(tf.reduce_sum(tanh_mlp(x, W)), W)


def test_tf1_control_flow_is_refused_with_advice():
    from tensorflow.python.ops import control_flow_v2_toggles

    graph = tf.Graph()
    control_flow_v2_toggles.disable_control_flow_v2()
    try:
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [4, 4])
            w = tf.compat.v1.Variable(np.eye(4, dtype=np.float32), use_resource=True)
            h = tf.compat.v1.cond(tf.reduce_sum(x) > 0, lambda: tf.matmul(x, w), lambda: tf.tanh(x))
            loss = tf.reduce_sum(h * h)
            with pytest.raises(memsaving.UnsupportedGraphError, match="control flow v2"):
                memsaving.gradients(loss, [w], checkpoints="memory")
    finally:
        control_flow_v2_toggles.enable_control_flow_v2()


# Measurement.

def test_measure_peak_on_a_device_without_statistics():
    with pytest.raises(memsaving.PeakMemoryUnavailableError, match="GPU:3"):
        memsaving.measure_peak(lambda: tf.ones([4]), device="GPU:3")
