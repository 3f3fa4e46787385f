"""The keywords of memsaving.gradients and memsaving.plan, parsed once (memsaving.options)."""

import inspect

import numpy as np
import pytest
import tensorflow as tf

import memsaving
import memsaving.keras as memsaving_keras
from helpers import mlp_weights, tanh_mlp
from memsaving.options import ACCEPTED_KEYWORDS, SHARED_DEFAULTS, accepts_deprecated_keys, parse_options
from memsaving.sim.swap import CostModel
from memsaving.tf.swap_rewrite import SwapOptions


def test_defaults_come_from_what_the_options_configure():
    options = parse_options({"swap": True})
    assert options.swap.emit == SwapOptions()
    assert options.cost_model() == CostModel()
    assert options.planner.batch_size == 1 and not options.planner.batch_size_given
    assert options.gradient.name == "memsaving_gradients"
    assert options.gradient.unconnected_gradients == tf.UnconnectedGradients.NONE
    assert options.gradient.follow_order is None and options.planner.profile is None


def test_swap_keywords_reach_both_the_emitter_and_the_simulator():
    options = parse_options({"swap": "auto", "swap_lb": 2, "swap_ub": 9, "swap_fuse": False,
                             "swap_trigger": "chain", "swap_device": "/CPU:1",
                             "bandwidth": 1e9, "flops_per_second": 2e12})
    assert options.swap.emit == SwapOptions(device="/CPU:1", trigger="chain", lb=2, ub=9, fuse=False)
    cost = options.cost_model()
    assert (cost.lb, cost.bandwidth, cost.flops_per_second) == (2, 1e9, 2e12)
    assert cost.fuse_levels is None  # unfused: the simulator gives every reader its own swap-in too
    assert parse_options({"swap": True}).cost_model().fuse_levels == SwapOptions().fuse_levels


def test_swap_options_are_read_only_when_swapping():
    """As before the options were parsed once: without swap=, swap keywords are not checked."""
    options = parse_options({"swap_lb": "soon"})
    assert not options.swap.on and options.swap.emit is None
    with pytest.raises(ValueError, match="swap_lb must be an int"):
        parse_options({"swap": True, "swap_lb": "soon"})
    with pytest.raises(ValueError, match="0 <= lb <= ub"):
        parse_options({"swap": True, "swap_lb": 5, "swap_ub": 2})


def test_offload_keywords_are_parsed_with_the_swap_timing():
    assert not parse_options({}).offload.on and not parse_options({"offload_params": False}).offload.on
    emit = parse_options({"offload_params": True, "offload_device": "/CPU:1", "swap_lb": 2,
                          "swap_trigger": "chain"}).offload.emit
    assert (emit.device, emit.lb, emit.trigger) == ("/CPU:1", 2, "chain")
    assert parse_options({"offload_params": True}).offload.emit.device == "/CPU:0"
    with pytest.raises(TypeError, match="offload_params"):
        parse_options({"offload_params": "yes"})
    with pytest.raises(ValueError, match="cannot be combined"):
        parse_options({"offload_params": True, "split": "auto"})


def test_tf_gradients_keywords_pass_through():
    options = parse_options({"gate_gradients": True, "colocate_gradients_with_ops": True, "name": "g",
                             "unconnected_gradients": "zero", "follow_order": np.bool_(False)})
    assert options.gradient.passed == {"gate_gradients": True, "colocate_gradients_with_ops": True}
    assert options.gradient.colocated and options.gradient.name == "g"
    assert options.gradient.unconnected_gradients == tf.UnconnectedGradients.ZERO
    assert options.gradient.follow_order is False


def test_every_accepted_keyword_is_parsed():
    """A keyword memsaving.gradients accepts but the parser ignores would be silently dropped."""
    parsed_fields = {"name", "unconnected_gradients", "stop_gradients", "follow_order", "batch_size", "profile",
                     "swap", "swap_device", "swap_trigger", "swap_lb", "swap_ub", "swap_fuse", "swap_backend",
                     "bandwidth", "flops_per_second", "gate_gradients", "aggregation_method",
                     "colocate_gradients_with_ops", "planning_time", "split", "offload_params", "offload_device",
                     "multilevel", "keep_x_gradients", "swap_options", "offload_options"}
    assert ACCEPTED_KEYWORDS == parsed_fields


ENTRY_POINTS = {
    "gradients": lambda: memsaving.gradients,
    "plan": lambda: memsaving.plan,
    "function": lambda: memsaving.function,
    "patch": lambda: memsaving.patch,
    "patched": lambda: memsaving.patched,
    "keras.enable": lambda: memsaving_keras.enable,
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_every_entry_point_names_the_shared_options_with_their_defaults_and_no_kwargs(name):
    parameters = inspect.signature(ENTRY_POINTS[name]()).parameters
    assert not [p for p in parameters.values() if p.kind == inspect.Parameter.VAR_KEYWORD], name
    for option, default in SHARED_DEFAULTS.items():
        assert option in parameters, f"{name} lacks {option}="
        assert parameters[option].default == default, (name, option, parameters[option].default, default)
        if option != "checkpoints" or name not in ("patch", "patched"):  # patch("memory") stays positional
            assert parameters[option].kind == inspect.Parameter.KEYWORD_ONLY, (name, option)


def test_the_deprecated_swap_and_offload_keys_still_work_with_a_warning():
    w = [tf.Variable(tf.fill([8, 8], 0.1)) for _ in range(4)]

    def loss(x):
        h = x
        for v in w:
            h = tf.tanh(h @ v)
        return tf.reduce_sum(h)

    def predicted_peak(**options):
        found = []

        @tf.function
        def step(x):
            found.append(memsaving.plan(loss(x), w, checkpoints=[], swap=True, profile=False, **options))
            return x

        step.get_concrete_function(tf.TensorSpec([4, 8]))
        return found[0].predicted_peak, found[0].swap_options if hasattr(found[0], "swap_options") else None

    with pytest.warns(DeprecationWarning, match=r"swap_device, swap_lb are deprecated; pass swap_options"):
        old = predicted_peak(swap_lb=2, swap_device="/CPU:0")
    new = predicted_peak(swap_options=memsaving.SwapOptions(lb=2, device="/CPU:0"))
    assert old == new

    @accepts_deprecated_keys
    def folded(*, swap_options=None, offload_options=None):
        return swap_options, offload_options

    with pytest.warns(DeprecationWarning, match="offload_device"):
        swap, offload = folded(swap_lb=2, swap_fuse=False, swap_device="/CPU:0", offload_device="/CPU:0")
    assert swap == SwapOptions(lb=2, fuse=False, device="/CPU:0")
    assert offload == memsaving.OffloadOptions(lb=2, fuse=False, device="/CPU:0")
    with pytest.raises(TypeError, match="swap_options"):
        parse_options({"swap": True, "swap_options": {"lb": 2}})


def test_one_stop_gradient_tensor_as_tf_gradients_takes_it():
    w = [tf.Variable(tf.fill([4, 4], 0.1 * (i + 1))) for i in range(4)]

    @tf.function
    def both(x):
        h = x
        hidden = []
        for v in w:
            h = tf.tanh(tf.matmul(h, v))
            hidden.append(h)
        loss = tf.reduce_sum(h)
        stop = hidden[1]
        return (tf.gradients(loss, w, stop_gradients=stop),
                memsaving.gradients(loss, w, checkpoints="memory", stop_gradients=stop))

    plain, ours = both(tf.ones([2, 4]))
    for p, o in zip(plain, ours):
        if p is None:
            assert o is None
        else:
            np.testing.assert_allclose(p.numpy(), o.numpy(), rtol=1e-5)
    assert plain[0] is None  # the stop cuts the first layers off


@pytest.mark.parametrize("value", [0, -1.0, "30s", True, float("nan")])
def test_a_bad_planning_time_says_what_to_pass(value):
    with pytest.raises(ValueError, match="planning_time=.*positive number.*None for no limit"):
        parse_options({"planning_time": value})
    assert parse_options({}).planner.planning_time == 30.0
    assert parse_options({"planning_time": None}).planner.planning_time is None


def test_a_spent_planning_time_keeps_the_gradients_and_says_so():
    """planning_time so small that the search stops at its first plans: the plan found so far runs,
    its gradients are tf.gradients', and the plan says it stopped; without a limit it does not."""
    weights = mlp_weights(24, width=32)
    found = {}

    @tf.function
    def step(x):
        loss = tf.reduce_sum(tanh_mlp(x, weights))
        lowest = memsaving.plan(loss, weights, checkpoints="memory", profile=False)
        budget = (lowest.predicted_peak + lowest.plain_peak) // 2
        ours, found["short"] = memsaving.gradients_and_plan(loss, weights, budget=budget, planning_time=1e-6,
                                                            profile=False)
        found["full"] = memsaving.plan(loss, weights, budget=budget, planning_time=None, profile=False)
        plain = tf.gradients(loss, weights)
        return tf.reduce_max([tf.reduce_max(tf.abs(a - b)) for a, b in zip(ours, plain)])

    assert float(step(tf.ones([64, 32]))) <= 1e-6
    short, full = found["short"], found["full"]
    assert short.planning_stopped == 1e-6 and full.planning_stopped is None
    assert "planning stopped at planning_time=1e-06 s" in short.table()
    assert "planning stopped" not in full.table()
    assert 0 < short.planning_seconds < full.planning_seconds
    assert short.predicted_compute >= full.predicted_compute


@pytest.mark.parametrize("key", ["bandwidth", "flops_per_second"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "16e9", True])
def test_a_speed_must_be_a_finite_positive_number(key, value):
    """0 used to fall back to the default silently, -1 and nan to be taken."""
    with pytest.raises(ValueError, match=rf"{key}={value!r} is not supported: .*finite number > 0"):
        parse_options({key: value})
    assert getattr(parse_options({key: np.float32(2e9)}).hardware, key) == 2e9


def test_an_infinite_planning_time_is_refused_in_favour_of_none():
    with pytest.raises(ValueError, match="planning_time=inf .*finite positive number.*None for no limit"):
        parse_options({"planning_time": float("inf")})


@pytest.mark.parametrize("key", ["swap_fuse", "follow_order", "profile", "offload_params", "keep_x_gradients",
                                 "multilevel"])
def test_a_bool_option_refuses_what_is_not_a_bool(key):
    """swap_fuse='no' used to count as True."""
    with pytest.raises(TypeError, match=rf"{key}='no' is not supported: pass {key}=True .*{key}=False"):
        parse_options({"swap": True, key: "no"})
    with pytest.raises(TypeError, match=rf"{key}=1 is not supported"):
        parse_options({"swap": True, key: 1})
    parse_options({"swap": True, key: np.bool_(False)})


def test_swap_fuse_false_reaches_swaps_and_parameter_copies():
    assert parse_options({"swap": True, "swap_fuse": False}).swap.emit.fuse is False
    assert parse_options({"offload_params": True, "swap_fuse": False}).offload.emit.fuse is False
    assert parse_options({"swap": True}).swap.emit.fuse is True


@pytest.mark.parametrize("keywords", [{"swap": True, "swap_device": "/GPU:7"},
                                      {"swap": True, "swap_device": "/CPU:9"},
                                      {"swap": True, "swap_device": "host"},
                                      {"offload_params": True, "offload_device": "/device:GPU:3"}])
def test_a_device_that_does_not_exist_is_refused_with_those_that_do(keywords):
    key = next(k for k in keywords if k.endswith("_device"))
    with pytest.raises(ValueError, match=rf"{key}=.* names no device of this process; available .*device:CPU:0"):
        parse_options(keywords)


@pytest.mark.parametrize("device", ["/CPU:1", "cpu:0", "/device:CPU:1", "/job:localhost/replica:0/task:0/device:CPU:0"])
def test_a_device_of_this_process_is_taken_in_any_spelling(device):
    assert parse_options({"swap": True, "swap_device": device}).swap.emit.device == device
    assert parse_options({"offload_params": True, "offload_device": device}).offload.emit.device == device
    with pytest.raises(TypeError, match="swap_device=1 is not supported"):
        parse_options({"swap": True, "swap_device": 1})


@pytest.mark.parametrize("value", [123, 1.5, {"a": 1}, [1, 2], ["Tanh:0"], (None,)])
def test_swap_refuses_what_readme_does_not_document(value):
    """swap=123 used to fail with a CheckpointError about the graph."""
    with pytest.raises(TypeError, match=r"swap.*(is not supported: use swap=True|the list holds a)"):
        parse_options({"swap": value})


def test_swap_takes_what_readme_documents():
    for value in (None, False, True, np.bool_(True), "auto", []):
        assert parse_options({"swap": value}).swap.swap == value

    parsed = []

    @tf.function
    def step(x):
        h = tf.tanh(x)
        parsed.append((h, parse_options({"swap": [h]}).swap.swap, parse_options({"swap": h}).swap.swap))
        return h

    step.get_concrete_function(tf.TensorSpec([2]))
    h, listed, single = parsed[0]
    assert listed[0] is h and single is h
    with pytest.raises(ValueError, match="swap='sometimes' is not supported"):
        parse_options({"swap": "sometimes"})
