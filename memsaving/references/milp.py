"""Exact reference: the Checkmate MILP for tensor rematerialization.

Jain et al. (MLSys 2020) pose "which values to recompute, when, under a
memory budget" as a mixed-integer linear program over *stages*: stage ``t``
computes node ``t`` of a topological order of the training graph for the
first time, and may recompute any earlier node.  Solved exactly (here with
HiGHS through :func:`scipy.optimize.milp`), it gives the cheapest schedule
of that family, which bounds from below what any checkpoint selection in the
same family can reach; the budget DP of :mod:`memsaving.planners.budget` is measured
against it.  Everything here works on the neutral
:class:`~memsaving.model.graph.GraphModel`; no TensorFlow.

Training graph
  One forward node per op of the model (its cost ``op.cost``, its memory
  the bytes of all its outputs) and one backward node per op whose gradient
  runs (:func:`memsaving.model.graph.gradient_ops`), in the order: all forward
  nodes, then the backward nodes in reverse op order (the order plain
  backprop runs them).  A backward node reads the forward nodes producing
  its op's ``grad_reads`` and the gradients made by earlier backward nodes.

Formulation and why it is smaller than Checkmate's general one
  * Backward nodes are never recomputed and each runs exactly in its own
    stage.  Checkmate allows recomputing them; the simulator cannot express
    it (a contribution to a gradient replaces the running sum, so a
    gradient cannot be rebuilt later), and it is rarely useful.  With the
    backward order fixed, which gradient buffers are alive at any point is
    fixed too, so gradients need no variables: their bytes are
    constants per stage, read off the simulator's own gradient actions
    (``grad_before[s]``: alive while stage ``s`` recomputes forward nodes;
    ``grad_during[s]``: alive while its backward node runs).  Weight
    gradients (``xs``) count only during the backward node that makes them,
    unless ``keep_x_gradients``.
  * Variables are binary ``R[t, i]`` (forward node ``i`` computed in stage
    ``t``) and ``S[t, i]`` (node ``i``'s value kept from stage ``t - 1``
    into ``t``) for forward nodes only, lower-triangular: ``R[t, i]`` for
    ``i <= t`` with ``R[t, t] = 1`` fixed in forward stages, ``S[t, i]`` for
    ``i < t``.  In backward stage ``s`` only the forward nodes that some
    backward node at stage ``>= s`` still depends on (directly or through
    forward nodes) get variables; any other computation or kept value there
    is useless.  Ops that cannot be copied (stateful) are computed once.
  * ``FREE[t, i, k]`` (node ``i``'s value dies right after node ``k`` of
    stage ``t``) is *continuous* in [0, 1] and only bounded from above
    (by ``R[t, k]``, ``1 - S[t+1, i]`` and ``1 - R[t, j]`` for every later
    user ``j`` of ``i`` in the stage): the solver gains by freeing, so it
    sets every ``FREE`` to its largest allowed value where the budget
    binds, and a smaller value only over-counts memory.  A variable is not
    created where a later user is certainly computed (the stage's backward
    node, or the forward node of a forward stage).
  * ``U[t, p]`` is the memory of forward values while position ``p`` of
    stage ``t`` runs (positions: the forward nodes the stage may compute,
    in order, then its backward node), by Checkmate's recurrence; the
    budget row is ``U[t, p] + gradient bytes <= budget - resident_bytes``.
  * The objective is the total compute: the recomputation cost (every
    ``R`` but the fixed diagonal) plus, as a variable fixed to 1, the
    first computations and the backward pass, so HiGHS's relative gap is
    relative to the total.
  * Rows that cut off only dominated schedules tighten the LP relaxation
    (:meth:`_Formulation._dominance_rows`).

Memory model against the simulator
  For the same schedule, the MILP's memory is an upper bound of the
  simulator's (:func:`memsaving.sim.replay.simulate_schedule`) at every action:
  gradient bytes are the simulator's own; a forward value is held from its
  computation to its last reader in the stage where it is last read (the
  simulator frees it at that same action) and through the stages between,
  where the simulator holds it too; it can only be over-counted (an op with
  several outputs is one value; a value computed while also kept counts
  twice; a kept value nobody reads counts until the stage ends).  For the
  schedules of single-level checkpoint plans on chains the two are equal,
  so on chains the MILP optimum is at most the best single-level plan.  The
  loss seed is written just before the first backward node runs, and the
  MILP counts it from the start of that stage.  Bytes are scaled into units
  for the solver; the row's right-hand side is ``budget + 0.25`` bytes so
  that a solution within the solver's tolerance still fits to the byte (the
  returned peak is the replayed one, checked against the budget).

The family is Checkmate's: backward nodes in one fixed order.  Checkpoint
plans of :mod:`memsaving.model.schedule` on branching graphs may differentiate in
another order (segment by segment), so there the DP can, in principle, find
plans outside this family.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union, cast

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from memsaving.model.graph import GraphModel, gradient_ops, gradient_sinks, without_forwarding
from memsaving.sim.replay import Event, plain_schedule, schedule_actions, simulate_schedule
from memsaving.model.buffers import Action, memory_replay
from memsaving.sim.simulate import Simulation

MAX_NODES = 250
"""Largest training graph (forward + backward nodes) :func:`solve_milp`
accepts: the program has about ``3 n^2 / 2`` binaries for ``n`` forward
nodes, and beyond a few hundred nodes HiGHS rarely closes the gap in
minutes."""


@dataclass(frozen=True)
class TrainingGraph:
    """The training graph the MILP schedules.

    Attributes
    ----------
    sizes
        bytes of each forward node's outputs (forward node = op index).
    costs
        forward cost of each op.
    deps
        forward nodes each forward node reads.
    copyable
        whether each forward node may be recomputed.
    backward_ops
        op index of each backward node, in stage order.
    backward_deps
        forward nodes each backward node reads (its ``grad_reads``).
    grad_before
        gradient bytes alive while each backward stage recomputes.
    grad_during
        gradient bytes alive while each backward node runs.
    """

    sizes: Tuple[int, ...]
    costs: Tuple[float, ...]
    deps: Tuple[Tuple[int, ...], ...]
    copyable: Tuple[bool, ...]
    backward_ops: Tuple[int, ...]
    backward_deps: Tuple[Tuple[int, ...], ...]
    grad_before: Tuple[int, ...]
    grad_during: Tuple[int, ...]

    @property
    def forward_count(self) -> int:
        return len(self.sizes)

    @property
    def node_count(self) -> int:
        """Forward plus backward nodes (the number of stages)."""
        return len(self.sizes) + len(self.backward_ops)


def training_graph(model: GraphModel, keep_x_gradients: bool = False) -> TrainingGraph:
    """The forward and backward nodes of ``model``'s training step, with the
    gradient bytes of each backward stage taken from the simulator."""
    tensors = model.tensors

    def producers(ts: Sequence[int]) -> Tuple[int, ...]:
        return tuple(sorted({tensors[t].producer for t in ts if tensors[t].producer >= 0}))

    backward_ops = tuple(sorted(gradient_ops(model), reverse=True))
    before, during = _gradient_profile(model, keep_x_gradients)
    return TrainingGraph(
        sizes=tuple(sum(tensors[t].nbytes for t in op.outputs) for op in model.ops),
        costs=tuple(float(op.cost) for op in model.ops),
        deps=tuple(producers(op.inputs) for op in model.ops),
        copyable=tuple(op.copyable for op in model.ops),
        backward_ops=backward_ops,
        backward_deps=tuple(producers(model.ops[j].grad_reads) for j in backward_ops),
        grad_before=tuple(before),
        grad_during=tuple(during),
    )


def _gradient_profile(model: GraphModel, keep_x_gradients: bool) -> Tuple[List[int], List[int]]:
    """Gradient bytes alive before and during each backward action of plain
    backprop, by the simulator's own rules.

    The plain schedule's actions are stripped of forward buffers (which do
    not change when gradient buffers die), and each action is followed by a
    probe that reads everything the action touched: the probe delays the
    action's frees by one step, so :func:`memory_replay`'s "after" value at the
    action is the bytes alive *during* it, and at the probe the bytes after.
    """
    actions = [a for a in schedule_actions(model, plain_schedule(model)) if not a.label.startswith("forward ")]
    probed: List[Action] = []
    for a in actions:
        reads = [k for k in a.reads if k[0] == "g"]
        writes = [(k, b) for k, b in a.writes if k[0] == "g"]
        probed += [Action(a.label, reads, writes), Action("probe", reads + [k for k, _ in writes], [])]
    pinned = {("g", x) for x in gradient_sinks(model)} if keep_x_gradients else set()
    timeline, _ = memory_replay(probed, pinned)
    during, after = timeline[0::2], timeline[1::2]
    # actions[0] is the seed; actions[1 + s] is backward node s
    return after[:-1], during[1:]


@dataclass
class MilpResult:
    """A solved MILP and its schedule replayed in the simulator.

    Attributes
    ----------
    events
        the schedule (``("forward", op)`` / ``("backward", op)``).
    total_cost
        the MILP objective as total compute (forward + recompute
        + backward, in the model's cost units).
    lower_bound
        no schedule of the family costs less (HiGHS's dual
        bound; ``total_cost`` when proven optimal).
    recompute_cost
        the part of ``total_cost`` spent recomputing.
    optimal
        proven optimal (within ``mip_gap``).
    mip_gap
        HiGHS's relative gap at the end.
    seconds
        solve time.
    variables, integer_variables, constraints
        program size.
    bound_bytes
        the MILP's own (upper-bound) peak, resident included.
    peak_bytes, compute_ratio, simulation
        the schedule replayed by
        :func:`memsaving.sim.replay.simulate_schedule`.
    """

    events: List[Event]
    total_cost: float
    lower_bound: float
    recompute_cost: float
    optimal: bool
    mip_gap: float
    seconds: float
    variables: int
    integer_variables: int
    constraints: int
    bound_bytes: int
    peak_bytes: int
    compute_ratio: float
    simulation: Simulation = field(repr=False)


Ref = Union[int, float]
"""A variable index (int) or a fixed value (float)."""


def _is_fixed(ref: Ref) -> bool:
    """True for a constant term (a float), false for a variable index."""
    return isinstance(ref, float)


class _Program:
    """Sparse MILP rows and columns, built one variable and row at a time.

    Terms refer to a variable (an int) or a constant (a float), so rows can
    mention fixed variables (``R[t, t] = 1``, absent ones = 0) uniformly;
    constants move to the bounds.
    """

    def __init__(self):
        self.cost: List[float] = []
        self.lower: List[float] = []
        self.upper: List[float] = []
        self.integer: List[int] = []
        self.entries: Tuple[List[int], List[int], List[float]] = ([], [], [])
        self.row_lb: List[float] = []
        self.row_ub: List[float] = []

    def var(self, cost: float = 0.0, upper: float = 1.0, integer: bool = True, lower: float = 0.0) -> int:
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(1 if integer else 0)
        return len(self.cost) - 1

    def row(self, terms: Sequence[Tuple[float, Ref]], lb: float = -np.inf, ub: float = np.inf) -> None:
        shift = 0.0
        rows, cols, vals = self.entries
        index = len(self.row_lb)
        for coef, ref in terms:
            if not _is_fixed(ref):
                rows.append(index)
                cols.append(int(ref))
                vals.append(coef)
            else:
                shift += coef * float(ref)
        self.row_lb.append(lb - shift)
        self.row_ub.append(ub - shift)

    def solve(self, time_limit: float, mip_rel_gap: float):
        n = len(self.cost)
        matrix = coo_array((self.entries[2], (self.entries[0], self.entries[1])), shape=(len(self.row_lb), n))
        return milp(
            c=np.array(self.cost),
            constraints=[LinearConstraint(matrix.tocsr(), np.array(self.row_lb), np.array(self.row_ub))],
            integrality=np.array(self.integer),
            bounds=Bounds(np.array(self.lower), np.array(self.upper)),
            options={"time_limit": float(time_limit), "mip_rel_gap": mip_rel_gap, "disp": False},
        )


class _Formulation:
    """The variables and rows of one budget (see the module docstring).

    ``capacity`` is the budget above resident memory in units of
    ``byte_unit`` bytes; costs are divided by ``cost_unit``; ``fixed_cost``
    is the compute every schedule pays; ``tighten`` adds the dominance rows.
    """

    def __init__(self, graph: TrainingGraph, capacity: float, byte_unit: float, cost_unit: float,
                 fixed_cost: float = 0.0, tighten: bool = True):
        self.tighten = tighten
        self.g = graph
        self.n = graph.forward_count
        self.stages = graph.node_count
        self.capacity = capacity
        self.unit = byte_unit
        self.program = _Program()
        self.R: Dict[Tuple[int, int], int] = {}
        self.S: Dict[Tuple[int, int], int] = {}
        self.U: Dict[Tuple[int, int], int] = {}
        self.grad_bytes: Dict[Tuple[int, int], float] = {}
        self.need = self._needed_per_backward_stage()
        self.feasible = True
        self._variables(cost_unit, fixed_cost)
        for t in range(self.stages):
            self._stage_rows(t)

    # -- which nodes each stage may touch -------------------------------------------------
    def _needed_per_backward_stage(self) -> List[List[int]]:
        """Forward nodes that backward nodes at stage >= s depend on."""
        found: set = set()
        need: List[List[int]] = [[] for _ in self.g.backward_ops]
        for s in range(len(self.g.backward_ops) - 1, -1, -1):
            stack = [i for i in self.g.backward_deps[s] if i not in found]
            while stack:
                i = stack.pop()
                if i in found:
                    continue
                found.add(i)
                stack.extend(d for d in self.g.deps[i] if d not in found)
            need[s] = sorted(found)
        return need

    def computable(self, t: int) -> List[int]:
        """Forward nodes stage ``t`` may compute, in order."""
        if t < self.n:
            return [i for i in range(t + 1) if i == t or self.g.copyable[i]]
        return [i for i in self.need[t - self.n] if self.g.copyable[i]]

    def keepable(self, t: int) -> List[int]:
        """Forward nodes whose value may be kept into stage ``t``."""
        if t == 0:
            return []
        return list(range(t)) if t < self.n else self.need[t - self.n]

    def r(self, t: int, i: int) -> Ref:
        if t < self.n and i == t:
            return 1.0
        return self.R.get((t, i), 0.0)

    def s(self, t: int, i: int) -> Ref:
        return self.S.get((t, i), 0.0)

    def _variables(self, cost_unit: float, fixed_cost: float) -> None:
        # the fixed part of the compute as a variable fixed to 1, so that the
        # solver's relative gap is relative to the total compute
        self.program.var(cost=fixed_cost / cost_unit, lower=1.0, integer=False)
        for t in range(self.stages):
            for i in self.computable(t):
                if not (t < self.n and i == t):
                    self.R[(t, i)] = self.program.var(cost=self.g.costs[i] / cost_unit)
            for i in self.keepable(t):
                self.S[(t, i)] = self.program.var()

    # -- rows ----------------------------------------------------------------------------
    def _stage_rows(self, t: int) -> None:
        p = self.program
        backward = t >= self.n
        s_index = t - self.n
        # a computed node needs each dependency computed in the stage or kept into it
        for k in self.computable(t):
            for i in self.g.deps[k]:
                p.row([(1.0, self.r(t, k)), (-1.0, self.r(t, i)), (-1.0, self.s(t, i))], ub=0.0)
        if backward:
            for i in self.g.backward_deps[s_index]:
                p.row([(1.0, self.r(t, i)), (1.0, self.s(t, i))], lb=1.0)
        # a value is kept into the next stage only if it was computed or kept in this one
        if t + 1 < self.stages:
            for i in self.keepable(t + 1):
                p.row([(1.0, self.s(t + 1, i)), (-1.0, self.r(t, i)), (-1.0, self.s(t, i))], ub=0.0)
        if self.tighten:
            self._dominance_rows(t)
        self._memory_rows(t)

    def _dominance_rows(self, t: int) -> None:
        """Rows that cut off only dominated schedules, to tighten the LP
        relaxation: a recomputed or kept value is read in the stage or kept
        further (else dropping it is cheaper and no larger), and a value is
        not both kept into a stage and recomputed in it."""
        p = self.program
        positions = self._positions(t)
        for i in sorted(set(self.computable(t)) | set(self.keepable(t))):
            readers = [self._r_pos(t, v) for v in positions if v != i and i in self._reads(t, v)]
            if any(_is_fixed(ref) for ref in readers):
                continue  # read by a node that surely runs
            later = [(-1.0, ref) for ref in readers] + [(-1.0, self.s(t + 1, i))]
            for ref in (self.r(t, i), self.s(t, i)):
                if not _is_fixed(ref):
                    p.row([(1.0, ref)] + later, ub=0.0)
            if not _is_fixed(self.r(t, i)) and not _is_fixed(self.s(t, i)):
                p.row([(1.0, self.r(t, i)), (1.0, self.s(t, i))], ub=1.0)

    def _positions(self, t: int) -> List[int]:
        """Nodes of stage ``t`` in evaluation order; -1 is the backward node."""
        return self.computable(t) + ([-1] if t >= self.n else [])

    def _reads(self, t: int, node: int) -> Tuple[int, ...]:
        return self.g.backward_deps[t - self.n] if node == -1 else self.g.deps[node]

    def _r_pos(self, t: int, node: int) -> Ref:
        return 1.0 if node == -1 else self.r(t, node)

    def _free_vars(self, t: int) -> Dict[int, List[Tuple[int, int]]]:
        """``FREE`` variables of stage ``t``: position -> [(var, freed node)]."""
        p = self.program
        positions = self._positions(t)
        present = sorted(set(self.computable(t)) | set(self.keepable(t)))
        computable = set(self.computable(t))
        frees: Dict[int, List[Tuple[int, int]]] = {}
        for i in present:
            users = [q for q, v in enumerate(positions) if v != i and i in self._reads(t, v)]
            freers = ([positions.index(i)] if i in computable else []) + users
            for q in freers:
                if q == len(positions) - 1:
                    continue  # memory after the stage's last node is the next stage's S
                later = [u for u in users if u > q]
                if any(_is_fixed(self._r_pos(t, positions[u])) for u in later):
                    continue  # a later user surely runs: never freed here
                var = p.var(integer=False)
                if not _is_fixed(self._r_pos(t, positions[q])):
                    p.row([(1.0, var), (-1.0, self._r_pos(t, positions[q]))], ub=0.0)
                if t + 1 < self.stages:
                    p.row([(1.0, var), (1.0, self.s(t + 1, i))], ub=1.0)
                for u in later:
                    p.row([(1.0, var), (1.0, self._r_pos(t, positions[u]))], ub=1.0)
                frees.setdefault(q, []).append((var, i))
        return frees

    def _memory_rows(self, t: int) -> None:
        p = self.program
        g = self.g
        positions = self._positions(t)
        frees = self._free_vars(t)
        size = [b / self.unit for b in g.sizes]
        previous = None
        for q, node in enumerate(positions):
            if t < self.n:
                grad = 0.0
            else:
                s_index = t - self.n
                grad = (g.grad_during if node == -1 else g.grad_before)[s_index] / self.unit
            headroom = self.capacity - grad
            if headroom < 0:
                self.feasible = False
                headroom = 0.0
            u = p.var(upper=headroom, integer=False)
            self.U[(t, q)] = u
            self.grad_bytes[(t, q)] = grad * self.unit
            terms: List[Tuple[float, Ref]] = [(1.0, u)]
            if node != -1:
                terms.append((-size[node], self.r(t, node)))
            if previous is None:
                terms += [(-size[i], self.s(t, i)) for i in self.keepable(t)]
            else:
                terms.append((-1.0, previous))
                terms += [(size[i], var) for var, i in frees.get(q - 1, [])]
            p.row(terms, lb=0.0, ub=0.0)
            previous = u


def _units(graph: TrainingGraph, budget_bytes: float) -> Tuple[float, float]:
    """Scales for bytes and costs, so the solver sees numbers near 1..1e4
    and a tolerance of 1e-6 units stays well below a quarter byte."""
    byte_unit = float(2 ** max(0, min(16, int(math.log2(max(budget_bytes, 1.0) / 4096)))))
    cost_unit = max(sum(graph.costs), 1e-12)
    return byte_unit, cost_unit


def solve_milp(
    model: GraphModel,
    budget: int,
    time_limit: float = 60.0,
    keep_x_gradients: bool = False,
    max_nodes: int = MAX_NODES,
    mip_rel_gap: float = 1e-4,
) -> Optional[MilpResult]:
    """The cheapest Checkmate schedule whose peak (resident included) fits ``budget``.

    Returns None when the program is infeasible, or when HiGHS finds no
    feasible schedule within ``time_limit`` seconds (:func:`run_milp` tells
    the two apart); otherwise the schedule, whether it is proven optimal,
    and its replay in the simulator.  ``mip_rel_gap`` is relative to the
    total compute (forward + recompute + backward): HiGHS stops once the
    schedule is proven that close to the optimum.

    Raises
    ------
    ValueError
        the training graph has more than ``max_nodes`` nodes.
    """
    return run_milp(model, budget, time_limit, keep_x_gradients, max_nodes, mip_rel_gap).result


@dataclass
class MilpOutcome:
    """What one solve ended with, schedule or not (for benchmarks).

    ``status`` is ``"optimal"``, ``"feasible"`` (time limit, schedule found),
    ``"timeout"`` (time limit, none found) or ``"infeasible"``;
    ``lower_bound`` is the total compute no schedule can beat (HiGHS's dual
    bound; None when infeasible or unknown).
    """

    status: str
    lower_bound: Optional[float]
    seconds: float
    variables: int
    integer_variables: int
    constraints: int
    result: Optional[MilpResult]


def run_milp(
    model: GraphModel,
    budget: int,
    time_limit: float = 60.0,
    keep_x_gradients: bool = False,
    max_nodes: int = MAX_NODES,
    mip_rel_gap: float = 1e-4,
) -> MilpOutcome:
    """:func:`solve_milp` with the solver's status, time and program size.

    The MILP's memory rows give every output a new buffer, so the model is
    solved and replayed without in-place forwarding
    (:func:`memsaving.model.graph.without_forwarding`); compare other plans on
    that model too."""
    model = without_forwarding(model)
    graph = training_graph(model, keep_x_gradients)
    if graph.node_count > max_nodes:
        raise ValueError(
            f"the training graph has {graph.node_count} nodes ({graph.forward_count} forward); "
            f"solve_milp accepts at most {max_nodes} (its size grows with the square). "
            "Solve a prefix of the model or raise max_nodes."
        )
    capacity_bytes = budget - model.resident_bytes + 0.25
    if capacity_bytes < 0:
        return MilpOutcome("infeasible", None, 0.0, 0, 0, 0, None)
    byte_unit, cost_unit = _units(graph, capacity_bytes)
    form = _Formulation(graph, capacity_bytes / byte_unit, byte_unit, cost_unit, _fixed_cost(model))
    program = form.program
    size = (len(program.cost), int(sum(program.integer)), len(program.row_lb))
    if not form.feasible:  # gradients alone exceed the budget somewhere
        return MilpOutcome("infeasible", None, 0.0, *size, None)
    start = time.perf_counter()
    res = program.solve(time_limit, mip_rel_gap)
    seconds = time.perf_counter() - start
    if res.x is None:
        if res.status == 2:
            return MilpOutcome("infeasible", None, seconds, *size, None)
        return MilpOutcome("timeout", _dual_bound(res, cost_unit), seconds, *size, None)
    result = _result(model, form, res, seconds, cost_unit, keep_x_gradients)
    if result.peak_bytes > budget:
        raise RuntimeError(
            f"the replayed schedule peaks at {result.peak_bytes} bytes, above the budget of {budget}: "
            "the MILP's memory model fell below the simulator's, which is a bug")
    status = "optimal" if result.optimal else "feasible"
    return MilpOutcome(status, result.lower_bound, seconds, *size, result)


def _dual_bound(res, cost_unit: float) -> Optional[float]:
    """HiGHS's bound on the total compute, in the model's units."""
    dual = getattr(res, "mip_dual_bound", None)
    return float(dual) * cost_unit if dual is not None and np.isfinite(dual) else None


def _fixed_cost(model: GraphModel) -> float:
    """Compute every schedule pays: one forward run of each op and the
    backward pass, counted as :func:`memsaving.sim.simulate.simulate` does."""
    return model.forward_cost() + model.backward_cost()


def _result(model: GraphModel, form: _Formulation, res, seconds: float, cost_unit: float,
            keep_x_gradients: bool) -> MilpResult:
    x = res.x
    events = schedule_of(form, x)
    g = form.g
    recompute = sum(g.costs[i] for (_, i), var in form.R.items() if x[var] > 0.5)
    total = _fixed_cost(model) + recompute
    dual = _dual_bound(res, cost_unit)
    lower = total if res.status == 0 or dual is None else min(total, dual)
    bound = max(x[u] * form.unit + form.grad_bytes[key] for key, u in form.U.items())
    sim = simulate_schedule(model, events, keep_x_gradients=keep_x_gradients)
    program = form.program
    return MilpResult(
        events=events,
        total_cost=total,
        lower_bound=lower,
        recompute_cost=recompute,
        optimal=res.status == 0,
        mip_gap=float(getattr(res, "mip_gap", float("nan")) or 0.0),
        seconds=seconds,
        variables=len(program.cost),
        integer_variables=int(sum(program.integer)),
        constraints=len(program.row_lb),
        bound_bytes=model.resident_bytes + int(math.ceil(bound - 1e-6)),
        peak_bytes=sim.peak_bytes,
        compute_ratio=sim.compute_ratio,
        simulation=sim,
    )


def schedule_of(form: _Formulation, x: np.ndarray) -> List[Event]:
    """Events of a solution: each stage's computed forward nodes in order,
    then its backward node."""
    events: List[Event] = []
    for t in range(form.stages):
        for i in form.computable(t):
            ref = form.r(t, i)
            if (ref > 0.5) if _is_fixed(ref) else x[cast(int, ref)] > 0.5:  # not fixed: a variable's index
                events.append(("forward", i))
        if t >= form.n:
            events.append(("backward", form.g.backward_ops[t - form.n]))
    return events


def peak_lower_bound(model: GraphModel, keep_x_gradients: bool = False) -> int:
    """A peak no schedule can go below: every forward op needs its inputs and
    outputs at once, and every gradient op its forward reads and the
    gradient buffers alive while it runs (resident memory included), on
    the model without in-place forwarding, as :func:`run_milp` solves it."""
    g = training_graph(without_forwarding(model), keep_x_gradients)
    forward = [g.sizes[k] + sum(g.sizes[i] for i in g.deps[k]) for k in range(g.forward_count)]
    backward = [g.grad_during[s] + sum(g.sizes[i] for i in g.backward_deps[s]) for s in range(len(g.backward_ops))]
    return model.resident_bytes + max(forward + backward + [0])
