"""``memsaving.gradients``: a drop-in for ``tf.gradients`` that recomputes.

The call finds the forward ops between ``xs`` and ``ys``, resolves the
checkpoints, and builds the backward pass segment by segment (see
:mod:`memsaving.tf.rewrite`).  Gradients are those of ``tf.gradients``; only the
memory held during backprop (and the compute spent) change.
"""

from __future__ import annotations

import gc
import logging
import warnings
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import tensorflow as tf
from tensorflow.python.framework import indexed_slices
from tensorflow.python.ops import control_flow_util, resource_variable_ops
from tensorflow.python.ops import gradients_impl as _gradients_impl

from memsaving.planners.budget import parse_bytes
from memsaving.tf.checkpoints import MODES, Checkpoints, resolve_checkpoints
from memsaving.errors import BudgetError, CheckpointError, PlanWarning
from memsaving.planners.known_error import HEADROOM, KNOWN_ERROR
from memsaving.fit_budget import PlanningTarget, active_target, planning_budget, refusal
from memsaving.tf.api_modules import stop_caching_gradients
from memsaving.tf.extract import graph_model
from memsaving.tf.forward import forward_graph, is_tensor_like, ops_made_in
from memsaving.tf.measure import bytes_in_use
from memsaving.planners.cache import model_key, remember, remembered
from memsaving.planners.planning import Plan
from memsaving.planners.registry import NAMED_MODES, PlanRequest, make_plan_for
from memsaving.tf.loop_checkpoints import checkpointing_loops
from memsaving.tf.loop_pinning import pin_loop_iterations
from memsaving.tf.order import pin_step
from memsaving.tf.rewrite import BackwardBuilder
from memsaving.options import (ACCEPTED_KEYWORDS, SHARED_DEFAULTS, Options, accepts_deprecated_keys, option_keywords,
                               parse_options, shared_options)
from memsaving.sim.allowance import planning_allowance
from memsaving.sim.simulate import collector_paused
from memsaving.tf.offload import OffloadOptions
from memsaving.tf.swap_rewrite import SwapOptions, insert_swaps
from memsaving.offload import offload_step
from memsaving.tf.split_rewrite import SplitEmitter

logger = logging.getLogger("memsaving")

# AutoGraph would otherwise transpile this library's Python on every trace
# inside tf.function (it converts every function it does not know), which
# made graph building several times slower and is never needed: the rewrite
# emits ops, it has no tensor-dependent Python control flow.
_do_not_convert = tf.autograph.experimental.do_not_convert

TensorLike = Union[tf.Tensor, tf.Variable]

# TensorFlow's own gradient functions (tf.gradients, tf.compat.v1.gradients),
# captured when memsaving is imported.  The rewrite calls these, never
# whatever tf.gradients is bound to at call time: once tf.gradients is
# replaced by memsaving (memsaving.patch(), or a user's own
# ``tf.__dict__["gradients"] = memsaving.gradients_memory``), calling it per
# segment would recurse forever ("memory") or fail on segments without
# checkpoints ("speed").
ORIGINAL_TF_GRADIENTS = _gradients_impl.gradients_v2
ORIGINAL_TF_COMPAT_V1_GRADIENTS = _gradients_impl.gradients

# The TF1 package's idiom, ``tf.__dict__["gradients"] = memsaving.gradients_memory``
# on ``import tensorflow.compat.v1 as tf``, is ignored by a module wrapper that
# already cached ``tf.gradients``.  Evaluating the right-hand side imports this
# module, so the wrappers stop caching ``gradients`` before the assignment.
stop_caching_gradients()

HALF_PRECISION = (tf.float16, tf.bfloat16)


def _as_list(value) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _check_tensors(values: list, what: str) -> None:
    for value in values:
        if not is_tensor_like(value):
            raise TypeError(
                f"memsaving.gradients: {what} must be tf.Tensor or tf.Variable objects "
                f"(or a list of them), got {type(value).__name__}: {value!r:.80}"
            )


def _in_xla_function(graph) -> bool:
    """True when the function being traced will be compiled with XLA.

    tf.function(jit_compile=True) traces its body inside an XLA control-flow
    context; TensorFlow's own helper finds it in the graph or its parents.
    """
    try:
        return bool(control_flow_util.GraphOrParentsInXlaContext(graph))
    except Exception:  # pylint: disable=broad-except  # detection only warns
        return False


@_do_not_convert
@accepts_deprecated_keys
def gradients(
    ys: Union[TensorLike, Sequence[TensorLike]],
    xs: Union[TensorLike, Sequence[TensorLike]],
    grad_ys: Optional[Union[tf.Tensor, Sequence[Optional[tf.Tensor]]]] = None,
    *,
    name: Optional[str] = None,
    gate_gradients: Optional[bool] = None,
    aggregation_method: Any = None,
    stop_gradients: Any = None,
    unconnected_gradients: Union[str, tf.UnconnectedGradients] = tf.UnconnectedGradients.NONE,
    colocate_gradients_with_ops: Optional[bool] = None,
    checkpoints: Checkpoints = SHARED_DEFAULTS["checkpoints"],
    budget: Optional[Union[int, str]] = SHARED_DEFAULTS["budget"],
    swap: Any = SHARED_DEFAULTS["swap"],
    split: Any = SHARED_DEFAULTS["split"],
    batch_size: Optional[int] = SHARED_DEFAULTS["batch_size"],
    profile: Optional[bool] = SHARED_DEFAULTS["profile"],
    planning_time: Optional[float] = SHARED_DEFAULTS["planning_time"],
    multilevel: bool = SHARED_DEFAULTS["multilevel"],
    follow_order: Optional[bool] = SHARED_DEFAULTS["follow_order"],
    keep_x_gradients: bool = SHARED_DEFAULTS["keep_x_gradients"],
    offload_params: bool = SHARED_DEFAULTS["offload_params"],
    swap_options: Optional[SwapOptions] = SHARED_DEFAULTS["swap_options"],
    offload_options: Optional[OffloadOptions] = SHARED_DEFAULTS["offload_options"],
    flops_per_second: Optional[float] = SHARED_DEFAULTS["flops_per_second"],
    bandwidth: Optional[float] = SHARED_DEFAULTS["bandwidth"],
) -> list:
    """Gradients of ``ys`` with respect to ``xs``, recomputing between checkpoints.

    Same arguments and results as ``tf.gradients``: a list with one entry per
    ``x``, ``None`` for an ``x`` that ``ys`` do not depend on (or zeros with
    ``unconnected_gradients="zero"``), and ``tf.IndexedSlices`` where
    tf.gradients gives them (gathers, embedding lookups).

    Parameters
    ----------
    ys
        tensor(s) to differentiate.
    xs
        tensor(s) or variable(s) to differentiate with respect to.
    grad_ys
        optional initial gradients for ``ys``, as in tf.gradients.
    name, gate_gradients, aggregation_method, stop_gradients, unconnected_gradients
        as for ``tf.gradients`` (ops are made under the name scope
        ``memsaving_gradients`` unless ``name`` is given).
    colocate_gradients_with_ops
        as for ``tf.compat.v1.gradients``.
    checkpoints
        which forward tensors are kept; everything between two kept tensors
        is recomputed during backprop (default ``"memory"``, as on every
        entry point; it was ``"collection"`` before 0.1.0):

        * a list of tensors: exactly those (each must lie between xs and ys);
        * ``"collection"``: tensors marked with :func:`memsaving.checkpoint`
          (or added to the graph collection ``"checkpoints"``);
        * ``"speed"``: outputs of MatMul, BatchMatMul, Conv and Einsum ops, so
          only cheap ops are recomputed;
        * ``"memory"``: about sqrt(n) cuts (sets of tensors every
          input-to-output path crosses: single separating tensors, tree
          decomposition separators, frontiers between depth levels), spaced
          evenly by activation bytes.
    budget
        a memory budget (bytes, or a string such as ``"2GiB"``): the
        checkpoints that minimise recomputation while the predicted peak
        fits are chosen among the cuts (among ``checkpoints`` when a list is
        given, among MatMul/Conv outputs with ``"speed"``).
    swap
        host swapping: True (every tensor the backward pass reads from the
        forward pass), ``"auto"`` (with ``budget``: keep, swap or recompute),
        a list of tensors; None or False: off.  ``swap_options`` says where
        and when copies are made.
    split
        ``{tensor_or_op: k}`` computes the region of row-wise ops around each
        (from the op that makes the tensor towards the loss, e.g. a language
        model's head and its cross-entropy) in ``k`` pieces of rows, one piece
        alive at a time, forward and backward; ``"auto"`` lets the planner
        split where one op's footprint is what a budget cannot fit
        (:mod:`memsaving.planners.splits`).  Gradients then equal
        ``tf.gradients``' up to the order of float summation.
    batch_size
        the size given to unknown dimensions when predicting memory for
        ``budget`` (default 1).
    profile
        True measures each op's kernel temporaries and run times on this
        device (:mod:`memsaving.tf.profiles`, cached on disk), False leaves
        them out; by default they are measured with ``budget`` or
        ``"memory"`` and otherwise taken from the cache when there.
    planning_time
        the seconds of simulation the planner may spend (default 30, None for
        no limit), counted in replayed actions so that plans are the same on
        every machine (:mod:`memsaving.sim.allowance`); when it is spent the
        best plan found so far is used, and ``Plan.explain()`` says so.
    multilevel
        True lets a budget below every single-level plan get a multi-level
        (recursive) plan (off by default: their peaks measure 1.13-1.5x their
        predictions and move from run to run).
    follow_order
        True makes the step run in the order the plan was scored in, with
        control edges (:mod:`memsaving.tf.order`): with TensorFlow's default
        thread pools the whole step, forward and backward, so that its peak
        repeats from run to run; with one inter-op thread each unit's
        gradient ops; False leaves the order to TensorFlow's executor.  By
        default it is on, except when the forward pass computes in float16 or
        bfloat16 (Grappler rewrites ops that carry control edges differently,
        and the gradients would then round differently from tf.gradients');
        with ``swap`` it is always off (the swaps order the step themselves).
    keep_x_gradients
        predict as if the gradients are held until the end of the step
        (True), or consumed as soon as made (False, default).
    offload_params
        True for variables that live on a host device (create them under
        ``tf.device``; ``offload_options.device``, default ``"/CPU:0"``):
        each is copied to the accelerator right before its forward use and
        again before its backward use, each copy freed after its readers
        (:mod:`memsaving.offload`); apply the gradients under that device so
        the update runs on the host too.
    swap_options, offload_options
        :class:`memsaving.tf.swap_rewrite.SwapOptions` and
        :class:`memsaving.tf.offload.OffloadOptions`: the host device and when
        copies are made.  The keywords ``swap_device``, ``swap_trigger``,
        ``swap_lb``, ``swap_ub``, ``swap_fuse``, ``swap_backend`` and
        ``offload_device`` of earlier versions still work, with a
        ``DeprecationWarning``.
    flops_per_second, bandwidth
        the device's compute rate and host link speed, used to time swaps
        against compute.

    Raises
    ------
    RuntimeError
        in eager mode (wrap the computation in ``tf.function``).
    TypeError
        ``ys``/``xs`` are not tensors, or an unknown keyword.
    memsaving.CheckpointError
        checkpoints not between xs and ys, or none found.
    memsaving.BudgetError
        no plan fits ``budget`` (says the smallest that does).
    memsaving.UnsupportedGraphError
        TF1-style control flow in the graph.

    Notes
    -----
    Stateful ops (variable reads, random ops, calls with side effects) and
    control-flow ops are never recomputed; their outputs are kept.

    Examples
    --------
    Where ``tf.gradients`` was called, in a ``tf.function``; the gradients
    are the same, the activations between checkpoints are recomputed:

    >>> import tensorflow as tf
    >>> import memsaving
    >>> weights = [tf.Variable(tf.fill([4, 4], 0.1)) for _ in range(8)]
    >>> @tf.function
    ... def step(x):
    ...     h = x
    ...     for w in weights:
    ...         h = tf.tanh(tf.matmul(h, w))
    ...     loss = tf.reduce_sum(h)
    ...     ours = memsaving.gradients(loss, weights, checkpoints="memory")
    ...     plain = tf.gradients(loss, weights)
    ...     return tf.reduce_max([tf.reduce_max(tf.abs(a - b)) for a, b in zip(ours, plain)])
    >>> float(step(tf.ones([2, 4]))) <= 1e-6
    True

    With a budget instead (``budget="2GiB"``), the checkpoints are chosen
    so that the predicted peak fits; :func:`plan` shows the plan.
    """
    keywords = shared_options(locals(), leave_out=("checkpoints", "budget"))
    keywords.update(option_keywords(
        name=name, gate_gradients=gate_gradients, aggregation_method=aggregation_method,
        stop_gradients=stop_gradients, unconnected_gradients=unconnected_gradients,
        colocate_gradients_with_ops=colocate_gradients_with_ops))
    return gradients_and_plan(ys, xs, grad_ys, checkpoints, budget, **keywords)[0]


@_do_not_convert
def gradients_and_plan(ys, xs, grad_ys=None, checkpoints: Checkpoints = SHARED_DEFAULTS["checkpoints"], budget=None,
                       probe: Optional[Callable] = None, planning: Optional[PlanningTarget] = None,
                       **kwargs) -> Tuple[list, Plan]:
    """:func:`gradients` and the :class:`Plan` it executed (planned once).

    Parameters
    ----------
    ys, xs, grad_ys, checkpoints, budget
        as for :func:`gradients`.
    probe
        ``probe(label, tensors)``, when given, is called after each backward
        unit is built, with the unit's results (used by
        :mod:`memsaving.tools.memory_timeline` to read the allocator between units).
    planning
        a calibration's record for this step
        (:class:`memsaving.fit_budget.PlanningTarget`): the target to plan
        for, and where the plan made is recorded.  None: the one entered by
        :func:`memsaving.fit_budget.planning_target` around the trace, if any.
    **kwargs
        the other keywords of :func:`gradients`, by name.

    Returns
    -------
    tuple
        ``(gradients, plan)``.

    Examples
    --------
    >>> import tensorflow as tf, memsaving
    >>> w = tf.Variable(tf.fill([4, 4], 0.1))
    >>> plans = []
    >>> @tf.function
    ... def step(x):
    ...     grads, plan = memsaving.gradients_and_plan(tf.reduce_sum(tf.tanh(x @ w)), [w], checkpoints="memory")
    ...     plans.append(plan)
    ...     return grads
    >>> _ = step(tf.ones([2, 4]))
    >>> plans[0].mode
    'memory'
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "memsaving.gradients is not supported when eager execution is enabled: it "
            "rewrites a graph, as tf.gradients does. Compute the loss and call "
            "memsaving.gradients inside a tf.function (or in tf.compat.v1 graph mode)."
        )
    unknown = sorted(set(kwargs) - ACCEPTED_KEYWORDS)
    if unknown:
        raise TypeError(
            f"memsaving.gradients got unexpected keyword argument(s) {unknown}; "
            f"accepted: ys, xs, grad_ys, checkpoints, {', '.join(sorted(ACCEPTED_KEYWORDS))}"
        )
    options = parse_options(kwargs)
    ys = _as_list(ys)
    xs = _as_list(xs)
    if not ys:
        raise ValueError("memsaving.gradients: ys is empty")
    _check_tensors(ys, "ys")
    _check_tensors(xs, "xs")
    if grad_ys is not None:
        grad_ys = _as_list(grad_ys)
        if len(grad_ys) != len(ys):
            raise ValueError(
                f"memsaving.gradients: got {len(grad_ys)} grad_ys for {len(ys)} ys; pass one per y"
            )
    else:
        grad_ys = [None] * len(ys)

    gradients_fn = ORIGINAL_TF_COMPAT_V1_GRADIENTS if options.gradient.colocated else ORIGINAL_TF_GRADIENTS

    graph = tf.compat.v1.get_default_graph()
    if _in_xla_function(graph):
        warnings.warn(
            "memsaving.gradients inside a tf.function(jit_compile=True): XLA schedules "
            "the whole function itself and ignores the recomputation order, so memory "
            "will not go down. Use jit_compile=False for the function that computes "
            "gradients.",
            stacklevel=2,
        )
    # Planning and the rewrite make hundreds of thousands of objects, nearly
    # all freed by reference counting: full collections they would trigger
    # walk the whole traced graph for nothing (see collector_paused).
    with tf.name_scope(options.gradient.name), collector_paused():
        ys, xs = _graph_tensors(ys, xs)
        grad_ys = _graph_grad_ys(grad_ys, ys)
        planning = planning if planning is not None else active_target()
        fwd, plan_, model = _plan(ys, xs, checkpoints, budget, options, planning,
                                  seeded_with_ones=all(g is None for g in grad_ys))
        if plan_.above_plain:
            warnings.warn(plan_.above_plain_advice(), PlanWarning, stacklevel=3)
        by_name = {op.name: op for op in fwd.ops}
        emitters = [SplitEmitter(region, graph, plan_.batch_size or 1) for region in plan_.splits]
        by_name.update({emitter.name: emitter for emitter in emitters})
        # kept and inner checkpoints; a region's outputs are kept with it
        named = set(plan_.kept_ops).union(*plan_.inner_checkpoints.values())
        kept = {by_name[n] for n in named if n in by_name}
        kept |= {t.op for emitter in emitters if emitter.name in named for t in emitter.outputs}
        steps = [(kind, by_name[anchor] if anchor else None, [by_name[n] for n in names])
                 for kind, anchor, names in plan_.steps]
        follow = _follow_order(options.gradient.follow_order, fwd, plan_)
        builder = BackwardBuilder(fwd, kept, steps, gradients_fn, options.gradient.passed, probe=probe,
                                  chain_groups=follow and not model.ready_gradients_early)
        loops = [by_name[name] for name in plan_.checkpointed_loops if name in by_name]
        with ops_made_in(graph) as made, checkpointing_loops(loops):
            zeros = options.gradient.unconnected_gradients == tf.UnconnectedGradients.ZERO
            result = builder.build(ys, grad_ys, xs, zeros)
            # the regions' forward pieces, read instead of the whole ops: all are
            # made before any region is rewired, so a region that reads another
            # region's result finds it under its original tensor, and the rewire
            # of the region that makes it then points that read at its pieces
            for emitter in emitters:
                emitter.forward()
            for emitter in emitters:
                emitter.rewire()
        pin_loop_iterations(made)
        if follow and model.ready_gradients_early:  # with one inter-op thread the groups are chained instead
            pin_step(plan_.simulation.labels, builder.units, graph, made, result, ys)
        if plan_.swapped:
            by_tensor = {t.name: t for op in fwd.ops for t in op.outputs}
            insert_swaps(made, [by_tensor[n] for n in plan_.swapped],
                         options.swap.emit, options.swap.backend, forward=fwd.ops)
        if options.offload.on:
            offloaded = offload_step(list(made), [g for g in result if g is not None] + list(ys),
                                     options.offload.emit, model=model, plan=plan_, cost=options.cost_model(),
                                     graph=graph)
            plan_ = replace(plan_, offload=offloaded.prediction)
        if planning is not None:
            planning.record(plan_)  # the calibration judges the plans of the step it traced, as returned
    logger.info(
        "memsaving.gradients: %d forward ops, %d checkpoints, %d segments, %d ops recomputed; "
        "predicted peak %.1f MiB (plain %.1f MiB)",
        len(fwd.ops), len(plan_.checkpoints), builder.segments, builder.recomputed_ops,
        plan_.predicted_peak / 2**20, plan_.plain_peak / 2**20,
    )
    return result, plan_


def _follow_order(value, fwd, plan_: Plan) -> bool:
    """Whether the rewrite adds ordering edges (see ``follow_order`` in :func:`gradients`)."""
    if plan_.swapped:
        return False  # the swap rewrite orders the step; more edges could close a cycle
    if value is not None:
        return bool(value)
    return not any(t.dtype in HALF_PRECISION for op in fwd.ops for t in op.outputs)


def _graph_tensors(ys: list, xs: list):
    """Variables to tensors the way tf.gradients converts them (handles for xs).

    An ``x`` from an enclosing graph (a nested tf.function that closes over a
    tensor of the outer function) is replaced by the placeholder that captures
    it in this graph, as tf.gradients follows captures: the forward ops read
    the placeholder, not the outer tensor.  Tensors of an unrelated graph are
    refused with advice.
    """
    graph = tf.compat.v1.get_default_graph()
    ys = [y.read_value() if isinstance(y, tf.Variable) else y for y in ys]
    xs = [x.handle if resource_variable_ops.is_resource_variable(x) else x for x in xs]
    xs = indexed_slices.internal_convert_n_to_tensor_or_indexed_slices(xs, name="x", as_ref=True)
    ys = indexed_slices.convert_n_to_tensor_or_indexed_slices(ys, name="y")
    _check_same_graph(ys, graph, "ys")
    _check_same_graph(xs, graph, "xs")
    xs = [_captured_in(x, graph) for x in xs]
    return ys, xs


def _graph_grad_ys(grad_ys: list, ys: list) -> list:
    """``grad_ys`` as tensors of this graph, as tf.gradients converts them.

    A value made outside the function (an eager tensor, a numpy array, a
    Python list) is captured or embedded as a constant; the rewrite needs
    graph tensors, whose producing ops the recomputed segments wait on."""
    converted = []
    for y, gy in zip(ys, grad_ys):
        if gy is not None and not isinstance(gy, tf.IndexedSlices):
            gy = tf.convert_to_tensor(gy, dtype=y.dtype, name="grad_y")
        converted.append(gy)
    return converted


def _enclosing_graphs(graph) -> list:
    """``graph`` and the graphs it is nested in (outer tf.functions), innermost first."""
    chain = []
    while graph is not None:
        chain.append(graph)
        graph = getattr(graph, "outer_graph", None)
    return chain


def _check_same_graph(tensors: list, graph, what: str) -> None:
    chain = _enclosing_graphs(graph)
    for t in tensors:
        t_graph = getattr(t, "graph", None)
        if t_graph is not None and not any(t_graph is g for g in chain):
            raise ValueError(
                f"memsaving.gradients: {what} tensor {t.name} belongs to another graph than the one "
                "memsaving.gradients is called in. Compute ys and xs inside the same tf.function "
                "(or tf.compat.v1 graph) that calls memsaving.gradients."
            )


def _captured_in(x, graph):
    """The tensor of ``graph`` that stands for ``x`` (``x`` itself when it is
    in ``graph``, or when no graph between it and ``graph`` captured it)."""
    chain = _enclosing_graphs(graph)
    if not isinstance(x, tf.Tensor) or x.graph is graph or not any(x.graph is g for g in chain):
        return x
    inner_graphs = []
    for g in chain:
        if g is x.graph:
            break
        inner_graphs.append(g)
    for g in reversed(inner_graphs):  # outermost first
        internal = next((inside for outside, inside in getattr(g, "captures", ()) if outside is x), None)
        if internal is None:
            return x  # never read inside: ys cannot depend on it, its gradient is None
        x = internal
    return x


def check_checkpoints_argument(checkpoints) -> None:
    """``checkpoints=None`` or a number would fail deep inside with "object is
    not iterable", and a list of numbers with a CheckpointError about the
    graph; say what the argument takes instead.  The elements of a list or
    a tuple are checked here (another iterable, which checking would use
    up, is checked when it is resolved)."""
    if isinstance(checkpoints, str):
        if checkpoints not in MODES:
            raise CheckpointError(f"unknown checkpoints mode {checkpoints!r}: pass a list of tensors or one of {MODES}")
        return
    if is_tensor_like(checkpoints):
        return
    try:
        iter(checkpoints)
    except TypeError:
        raise TypeError(
            f"checkpoints={checkpoints!r} is not supported: pass a list of tensors, or one of "
            "'memory' (the default), 'speed', 'collection'; use checkpoints=[] to keep nothing extra"
        ) from None
    if isinstance(checkpoints, (list, tuple)):
        for position, element in enumerate(checkpoints):
            if not is_tensor_like(element):
                raise TypeError(
                    f"checkpoints[{position}] is a {type(element).__name__} ({element!r:.60}): a list of "
                    "checkpoints holds tensors (or variables) of the forward pass; or pass one of "
                    "'collection', 'speed', 'memory'")


def _profile_mode(profile, checkpoints, budget) -> str:
    """How kernel temporaries are profiled (:mod:`memsaving.tf.profiles`).

    Measured by default when the plan depends on predictions (a budget, or
    ``"memory"``, which picks the plan of lowest predicted peak); otherwise
    only profiles already cached are used, so that the predicted peaks,
    plain backprop's included, still count them when known."""
    if profile is None:
        predicted = budget is not None or (isinstance(checkpoints, str) and checkpoints == "memory")
        return "measure" if predicted else "cached"
    return "measure" if profile else "off"


def _plan(ys, xs, checkpoints, budget, options: Options, planning: Optional[PlanningTarget],
          seeded_with_ones: bool = True, shown: bool = False) -> tuple:
    """Forward graph, plan and the graph model it was made on, shared by
    ``gradients`` and ``plan`` (``planning``: a calibration's record, or
    None; ``seeded_with_ones``: no ``grad_ys`` were given; ``shown``: the
    plan is made to be shown, by ``plan``)."""
    check_checkpoints_argument(checkpoints)
    fwd = forward_graph(xs, ys, list(options.gradient.stop_gradients))
    batch_size = options.planner.batch_size
    profile = _profile_mode(options.planner.profile, checkpoints, budget)
    in_use = _in_use_before_the_step(collect=budget is not None or shown, held=planning.held if planning else 0)
    model = graph_model(fwd, batch_size=batch_size, profile=profile, seeded_with_ones=seeded_with_ones,
                        in_use_bytes=in_use, rows=options.planner.split is not None)
    # the budget less room for the model's known error, or a calibration's target (fit_to_budget, Keras)
    planned_for = planning_budget(budget, model.resident_bytes, planning)
    or_lowest = planning is not None and planning.or_lowest
    key = _cache_key(model, checkpoints, planned_for, options, or_lowest)
    plan_ = remembered(key, model) if key is not None else None
    if plan_ is None:
        with planning_allowance(options.planner.planning_time) as allowance:
            try:
                with collector_paused():
                    fwd, plan_ = _plan_for_model(fwd, model, checkpoints, planned_for, options, or_lowest)
            except BudgetError as error:
                if budget is not None and not (planning is not None and planning.calibrating):
                    error = _within_known_error(error, parse_bytes(budget), model.resident_bytes)
                if key is not None:
                    remember(key, model, error)
                raise error from None
        plan_ = replace(plan_, planning_seconds=allowance.spent_seconds,
                        planning_stopped=options.planner.planning_time if allowance.stopped else None)
        if key is not None:
            remember(key, model, plan_)
    # the budget asked for (the predicted peak fits the lower one planned for), and the batch sized for
    plan_ = replace(plan_, budget=plan_.budget if budget is None else parse_bytes(budget), batch_size=batch_size,
                    batch_source="batch_size=" if options.planner.batch_size_given else "")
    return fwd, plan_, model


def _within_known_error(error: BudgetError, budget: int, resident: int) -> BudgetError:
    """The planner's BudgetError for the budget less the known error, said
    for the budget the user asked for: the smallest budget it gives is the
    one the lowest plan found may run under."""
    lowest = error.smallest_budget
    if lowest is None or lowest <= resident:
        return error
    return refusal("memsaving.gradients", budget, lowest, resident, 1 + KNOWN_ERROR, headroom=HEADROOM,
                   how="budget= alone: nothing is measured, so the step is planned with room for it",
                   otherwise="Or let the step be measured: memsaving.fit_to_budget (or, for Keras, "
                             f"memsaving.keras.enable(model, budget=...)) replaces that {KNOWN_ERROR:.0%} with the error it "
                             "measures, and where running out of memory raises (a GPU) it may try the lowest "
                             "plan once.")


def _in_use_before_the_step(collect: bool, held: int = 0) -> int:
    """The bytes the device holds now, which every predicted peak counts,
    less ``held`` (room a calibration holds while the step is traced, which
    the step will not find in use); with ``collect``, after collecting
    garbage (even with the collector off).

    Objects no longer reachable but not yet collected (steps traced, run and
    dropped, the frames of an error caught and let go) can hold device
    memory until a collection: counted, they would move every prediction by
    whatever garbage happened to wait, from one trace of the same step to
    the next, and the smallest budget a BudgetError reported could be
    refused when the step is traced again.  Collected here, that memory is
    free when the step runs.  A collection walks the whole heap (0.3-0.6 s
    once TensorFlow and a model are loaded), so it is made where the figure
    decides what fits (a budget) or is asked for (``plan``) only."""
    if collect:
        gc.collect()
    return max(bytes_in_use() - held, 0)


def _cache_key(model, checkpoints, budget, options: Options, or_lowest: bool):
    """The key a plan for these arguments is remembered under (:mod:`memsaving.planners.cache`),
    or None when it is not remembered: checkpoints given as tensors or taken
    from the graph's collection name tensors of one graph, and are cheap to
    resolve anyway; only the named modes (``"memory"``, ``"speed"``) search."""
    if not (isinstance(checkpoints, str) and checkpoints in ("memory", "speed")):
        return None
    # the batch size and the profiling mode shaped the model itself
    if options.planner.split is not None and options.planner.split != "auto":
        return None  # names tensors of one graph
    key = (model_key(model), checkpoints, budget, or_lowest, options.planner.keep_x_gradients,
           options.planner.planning_time, options.hardware, options.swap.swap, options.swap.emit,
           options.planner.split, options.planner.multilevel)
    try:
        hash(key)
    except TypeError:  # swap= a list of tensors
        return None
    return key


def _plan_for_model(fwd, model, checkpoints, budget, options: Options, or_lowest: bool = False) -> tuple:
    """``(fwd, plan)`` for ``model`` (the sized graph model of ``fwd``): the
    arguments resolved against the graph, and the planner the registry's
    rule picks (:mod:`memsaving.planners.registry`); with ``or_lowest``, a
    budget nothing fits gets the lowest plan found instead of a BudgetError."""
    return fwd, make_plan_for(_plan_request(fwd, model, checkpoints, budget, options, or_lowest))


def _plan_request(fwd, model, checkpoints, budget, options: Options, or_lowest: bool) -> PlanRequest:
    """The call's arguments with their tensors and names turned into the
    graph model's op and tensor indices: what the planners see."""
    label = checkpoints if isinstance(checkpoints, str) else "list"
    # a budget plans "collection" over the memory mode's candidates: its marks are read only without one
    wanted = label == "list" or (label not in NAMED_MODES and budget is None)
    named = tuple(model.ops[i].name for i in resolve_checkpoints(checkpoints, fwd, model)) if wanted else ()
    swap = options.swap.swap
    if options.swap.on and swap is not True and swap != "auto":
        swap = tuple(tensor.name for tensor in _as_list(swap))
    split = options.planner.split
    if split is not None and split != "auto":
        split = tuple(_split_seeds(split, fwd, model, options.gradient.stop_gradients))
    return PlanRequest(model, checkpoints=label, named_ops=named, budget=None if budget is None else parse_bytes(budget),
                       swap=swap if options.swap.on else None, split=split,
                       keep_x_gradients=options.planner.keep_x_gradients, multilevel=options.planner.multilevel,
                       cost=options.cost_model(), or_lowest=or_lowest)


def _split_seeds(split: tuple, fwd, model, stop_gradients) -> list:
    """``split=`` (checked pairs of op, tensor or name and pieces) as
    ``[(op index, pieces), ...]`` of ``model``."""
    index = model.op_index()
    graph = tf.compat.v1.get_default_graph()
    stopped = {getattr(t, "name", None) for t in stop_gradients}
    seeds = []
    for key, pieces in split:
        label = key if isinstance(key, str) else key.name
        if isinstance(key, str):
            try:
                key = graph.as_graph_element(key)
            except (KeyError, ValueError):
                key = None
        op = key if isinstance(key, tf.Operation) else getattr(key, "op", None)
        if op is None or op.name not in index or not fwd.contains_op(op):
            raise CheckpointError(
                f"split: {label!r} names no op between xs and ys; give an op, a tensor's "
                "ref() or a name of the forward pass that gradients flow through")
        if any(t.name in stopped for t in op.outputs):
            raise CheckpointError(f"cannot split {op.name}: its output is one of stop_gradients")
        seeds.append((index[op.name], pieces))
    return seeds


@_do_not_convert
@accepts_deprecated_keys
def plan(
    ys: Union[TensorLike, Sequence[TensorLike]],
    xs: Union[TensorLike, Sequence[TensorLike]],
    *,
    stop_gradients: Any = None,
    checkpoints: Checkpoints = SHARED_DEFAULTS["checkpoints"],
    budget: Optional[Union[int, str]] = SHARED_DEFAULTS["budget"],
    swap: Any = SHARED_DEFAULTS["swap"],
    split: Any = SHARED_DEFAULTS["split"],
    batch_size: Optional[int] = SHARED_DEFAULTS["batch_size"],
    profile: Optional[bool] = SHARED_DEFAULTS["profile"],
    planning_time: Optional[float] = SHARED_DEFAULTS["planning_time"],
    multilevel: bool = SHARED_DEFAULTS["multilevel"],
    follow_order: Optional[bool] = SHARED_DEFAULTS["follow_order"],
    keep_x_gradients: bool = SHARED_DEFAULTS["keep_x_gradients"],
    offload_params: bool = SHARED_DEFAULTS["offload_params"],
    swap_options: Optional[SwapOptions] = SHARED_DEFAULTS["swap_options"],
    offload_options: Optional[OffloadOptions] = SHARED_DEFAULTS["offload_options"],
    flops_per_second: Optional[float] = SHARED_DEFAULTS["flops_per_second"],
    bandwidth: Optional[float] = SHARED_DEFAULTS["bandwidth"],
) -> Plan:
    """The plan ``gradients`` would execute, with its predicted peak and compute.

    Call it where you would call :func:`gradients` (inside a tf.function or a
    v1 graph); it adds no ops.  ``plan(...).explain()`` prints a table of the
    backward units (kept op, ops recomputed, kept bytes, recompute FLOPs).

    Parameters
    ----------
    ys, xs, stop_gradients
        as for :func:`gradients`.
    profile
        True (what None means here: a plan is asked for its predictions)
        measures each op's kernel temporaries and run times on this device,
        whatever the checkpoints; False leaves them out.
    checkpoints, budget, swap, split, batch_size, planning_time, multilevel, follow_order, keep_x_gradients, offload_params, swap_options, offload_options, flops_per_second, bandwidth
        as for :func:`gradients` (the same options, names and defaults on
        every entry point: :data:`memsaving.options.SHARED_DEFAULTS`).

    Examples
    --------
    The plan is made while the function is traced; keep it from there:

    >>> import tensorflow as tf
    >>> import memsaving
    >>> weights = [tf.Variable(tf.fill([64, 64], 0.01)) for _ in range(16)]
    >>> plans = []
    >>> @tf.function
    ... def step(x):
    ...     h = x
    ...     for w in weights:
    ...         h = tf.tanh(tf.matmul(h, w))
    ...     plans.append(memsaving.plan(tf.reduce_sum(h), weights, checkpoints="memory", profile=False))
    ...     return h
    >>> _ = step.get_concrete_function(tf.TensorSpec([256, 64]))
    >>> chosen = plans[0]
    >>> chosen.mode, len(chosen.checkpoints) > 0
    ('memory', True)
    >>> chosen.predicted_peak < chosen.plain_peak
    True

    ``chosen.explain()`` prints the backward units and the predictions.
    """
    if tf.executing_eagerly():
        raise RuntimeError("memsaving.plan needs a graph: call it inside a tf.function or tf.compat.v1 graph.")
    ys, xs = _as_list(ys), _as_list(xs)
    _check_tensors(ys, "ys")
    _check_tensors(xs, "xs")
    options = parse_options(dict(shared_options(locals(), leave_out=("checkpoints", "budget", "profile")),
                                 stop_gradients=stop_gradients, profile=True if profile is None else profile))
    ys, xs = _graph_tensors(ys, xs)
    return _plan(ys, xs, checkpoints, budget, options, active_target(), shown=True)[1]


def gradients_speed(ys, xs, grad_ys=None, **kwargs) -> list:
    """``gradients(..., checkpoints="speed")``: keep MatMul/Conv/Einsum outputs (the TF1 package's name).

    Parameters
    ----------
    ys, xs, grad_ys
        as for :func:`gradients`.
    **kwargs
        the other keywords of :func:`gradients`.

    Examples
    --------
    >>> import tensorflow as tf, memsaving
    >>> w = tf.Variable(tf.fill([4, 4], 0.1))
    >>> @tf.function
    ... def step(x):
    ...     h = tf.tanh(tf.matmul(tf.tanh(tf.matmul(x, w)), w))
    ...     return memsaving.gradients_speed(tf.reduce_sum(h), [w])
    >>> step(tf.ones([2, 4]))[0].shape
    TensorShape([4, 4])
    """
    return gradients(ys, xs, grad_ys, checkpoints="speed", **kwargs)


@_do_not_convert
def gradients_memory(ys, xs, grad_ys=None, **kwargs) -> list:
    """``gradients(..., checkpoints="memory")``: about sqrt(n) separating tensors (the TF1 package's name).

    Parameters
    ----------
    ys, xs, grad_ys
        as for :func:`gradients`.
    **kwargs
        the other keywords of :func:`gradients`.

    Examples
    --------
    >>> import tensorflow as tf, memsaving
    >>> w = tf.Variable(tf.fill([4, 4], 0.1))
    >>> @tf.function
    ... def step(x):
    ...     h = tf.tanh(tf.matmul(tf.tanh(tf.matmul(x, w)), w))
    ...     return memsaving.gradients_memory(tf.reduce_sum(h), [w])
    >>> step(tf.ones([2, 4]))[0].shape
    TensorShape([4, 4])
    """
    return gradients(ys, xs, grad_ys, checkpoints="memory", **kwargs)


@_do_not_convert
def gradients_collection(ys, xs, grad_ys=None, **kwargs) -> list:
    """``gradients(..., checkpoints="collection")``: tensors marked by the user (the TF1 package's name).

    Parameters
    ----------
    ys, xs, grad_ys
        as for :func:`gradients`.
    **kwargs
        the other keywords of :func:`gradients`.

    Examples
    --------
    >>> import tensorflow as tf, memsaving
    >>> w = tf.Variable(tf.fill([4, 4], 0.1))
    >>> @tf.function
    ... def step(x):
    ...     h = tf.tanh(tf.matmul(memsaving.checkpoint(tf.tanh(tf.matmul(x, w))), w))
    ...     return memsaving.gradients_collection(tf.reduce_sum(h), [w])
    >>> step(tf.ones([2, 4]))[0].shape
    TensorShape([4, 4])
    """
    return gradients(ys, xs, grad_ys, checkpoints="collection", **kwargs)


DROP_IN_GRADIENTS = (gradients, gradients_speed, gradients_memory, gradients_collection)
"""memsaving's functions that take ``tf.gradients``' arguments: the ones users
assign to ``tf.gradients`` by hand, and :func:`memsaving.unpatch` takes back."""
