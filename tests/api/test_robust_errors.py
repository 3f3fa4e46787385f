"""Bad input: the error paths not covered by test_errors.py,
test_robustness.py, test_swap.py and test_cli_and_measure.py, each with a
message that says what to do."""

import numpy as np
import pytest
import tensorflow as tf

import memsaving

W = [tf.Variable(tf.ones([4, 4]) * 0.1) for _ in range(3)]
SPEC = tf.TensorSpec([2, 4])


def _loss(x):
    h = x
    for v in W:
        h = tf.tanh(tf.matmul(h, v))
    return tf.reduce_sum(h * h)


def _trace(fn):
    tf.function(fn).get_concrete_function(SPEC)


def test_xs_from_an_unrelated_graph_is_refused_with_advice():
    other = tf.Graph()
    with other.as_default():
        stranger = tf.compat.v1.placeholder(tf.float32, [2], name="stranger")
    with pytest.raises(ValueError, match=r"stranger:0 belongs to another graph.*same tf.function"):
        _trace(lambda x: memsaving.gradients(_loss(x), [stranger], checkpoints="memory"))


def test_xs_captured_from_an_outer_function_get_their_gradient():
    """A nested tf.function closing over a tensor of the outer function:
    tf.gradients follows the capture; memsaving used to return None."""
    @tf.function
    def outer(x):
        h = tf.tanh(x * 2.0)

        @tf.function
        def inner():
            loss = _loss(h)
            return tf.gradients(loss, [h] + W), memsaving.gradients(loss, [h] + W, checkpoints="memory")

        return inner()

    plain, ours = outer(tf.ones([2, 4]))
    for p, o in zip(plain, ours):
        assert o is not None
        np.testing.assert_allclose(o.numpy(), p.numpy(), rtol=1e-6)


def test_xs_not_reachable_give_none_and_zeros_like_tf_gradients():
    @tf.function
    def step(x):
        loss = _loss(x)
        unrelated = tf.ones([3]) * 2.0
        return (memsaving.gradients(loss, [unrelated, W[0]], checkpoints="memory"),
                memsaving.gradients(loss, [unrelated], checkpoints="memory", unconnected_gradients="zero"))

    some, zero = step(tf.ones([2, 4]))
    assert some[0] is None and some[1] is not None
    np.testing.assert_array_equal(zero[0].numpy(), np.zeros(3))


@pytest.mark.parametrize("checkpoints", [None, 5, 2.5])
def test_checkpoints_of_the_wrong_type(checkpoints):
    with pytest.raises(TypeError, match=r"pass a list of tensors, or one of 'collection'"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints=checkpoints))


@pytest.mark.parametrize("mode", ["MEMORY", "", "sqrt", "speed "])
def test_bad_checkpoint_mode_strings(mode):
    with pytest.raises(memsaving.CheckpointError, match=r"unknown checkpoints mode.*'collection', 'speed', 'memory'"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints=mode))
    with pytest.raises(memsaving.CheckpointError, match="unknown checkpoints mode"):
        _trace(lambda x: memsaving.plan(_loss(x), W, checkpoints=mode))


@pytest.mark.parametrize("what", ["variable", "constant", "before_xs", "python_number"])
def test_checkpoints_not_between_xs_and_ys(what):
    def step(x):
        a = x * 3.0  # xs is a; x is before it
        loss = tf.reduce_sum(tf.tanh(tf.matmul(a, W[0])))
        chosen = {"variable": W[1], "constant": tf.constant(1.0, name="a_constant"), "before_xs": x,
                  "python_number": 3.0}[what]
        return memsaving.gradients(loss, [a, W[0]], checkpoints=[chosen])

    with pytest.raises(memsaving.CheckpointError, match="not in the forward graph between xs and ys"):
        _trace(step)


def test_infeasible_budget_states_the_smallest_which_then_fits():
    @tf.function
    def step(x):
        loss = _loss(x)
        with pytest.raises(memsaving.BudgetError) as info:
            memsaving.gradients(loss, W, checkpoints="memory", budget=10)
        message = str(info.value)
        assert "smallest feasible budget" in message and "Raise the budget" in message
        smallest = info.value.smallest_budget
        assert smallest > 10 and f"({smallest} bytes)" in message
        plan = memsaving.plan(loss, W, checkpoints="memory", budget=smallest)
        assert plan.predicted_peak <= smallest
        return tf.gradients(loss, W), memsaving.gradients(loss, W, checkpoints="memory", budget=smallest)

    plain, ours = step(tf.ones([2, 4]))
    for p, o in zip(plain, ours):
        np.testing.assert_allclose(o.numpy(), p.numpy(), rtol=1e-6)


@pytest.mark.parametrize("budget", ["2 gigabytes", "1e3XB", "MiB", "--1KiB", "1,5GB", "", [1], 1.5, "0.5", 0.25])
def test_bad_budget_values_say_what_to_pass(budget):
    with pytest.raises((ValueError, TypeError), match=r"'2GiB'"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints="memory", budget=budget))


@pytest.mark.parametrize("budget", ["2GiB", "512 MiB", "1.5GB", "500000kb", 10 ** 9, 1e9])
def test_good_budget_spellings_are_accepted(budget):
    _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints="memory", budget=budget))


@pytest.mark.parametrize("batch_size", ["abc", "8", 0, -2, 2.5, True])
def test_bad_batch_size_says_what_to_pass(batch_size):
    """Strings and fractions used to fail in int() or be truncated."""
    with pytest.raises(ValueError, match=r"batch_size=.*positive int"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints="memory", batch_size=batch_size))
    with pytest.raises(ValueError, match=r"batch_size=.*positive int"):
        _trace(lambda x: memsaving.plan(_loss(x), W, checkpoints="memory", batch_size=batch_size))


@pytest.mark.parametrize("budget", [float("nan"), float("inf")])
def test_non_finite_float_budgets_say_what_to_pass(budget):
    with pytest.raises(ValueError, match=r"'2GiB'"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints="memory", budget=budget))


def test_budget_with_an_empty_candidate_list():
    with pytest.raises(memsaving.CheckpointError, match=r"checkpoints=\[tensors\]"):
        _trace(lambda x: memsaving.gradients(_loss(x), W, checkpoints=[], budget="1MiB"))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(swap="auto"), ValueError, "pass budget="),
    (dict(swap=True, swap_lb="3"), ValueError, "swap_lb must be an int"),
    (dict(swap=True, swap_ub=2.5), ValueError, "swap_ub must be an int"),
    (dict(swap=True, swap_lb=10, swap_ub=2), ValueError, "0 <= lb <= ub"),
    (dict(swap=True, swap_lb=-1), ValueError, "0 <= lb <= ub"),
    (dict(swap=[3.0]), memsaving.CheckpointError, "cannot swap"),
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


def test_plan_in_eager_mode_and_with_unknown_keywords():
    with pytest.raises(RuntimeError, match="tf.function"):
        memsaving.plan(tf.ones([2]), W)
    with pytest.raises(TypeError, match="colour"):
        _trace(lambda x: memsaving.plan(_loss(x), W, checkpoints="memory", colour="red"))


def test_measure_peak_on_a_device_without_statistics():
    with pytest.raises(memsaving.PeakMemoryUnavailableError, match="GPU:3"):
        memsaving.measure_peak(lambda: tf.ones([4]), device="GPU:3")
