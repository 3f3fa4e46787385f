"""Whether two versions of the simulator give the same replays, bit for bit.

The simulator's speed-ups (per-model tables, remembered backward units)
must not change a single figure of any plan.  This scores a fixed list of
plans per model with one version of the code and saves every
:class:`~memsaving.sim.simulate.Simulation` (``dump``), then scores them
with another and compares every field (``check``): peak, costs, timeline,
labels, unit ends, step time, swapped bytes.

The plans are the kinds the planners score: plain backprop and keeping
everything, cut plans, sequences of neighbours that add or drop one op at a
time (as :func:`memsaving.planners.refine.keep_more` and
:func:`~memsaving.planners.refine.drop_from_keep_all` try them) or one cut
(the budget search's moves), random plans, and the options: results kept
(``keep_x_gradients``), multi-level plans (``inner``, and neighbours that
change one inner checkpoint), swaps with their timing (``swapped``,
``cost``), ``inplace`` and ``unpinned``.  ``check`` scores them in the
dumped order, then again in a shuffled order with whatever the first pass
left remembered, then each after forgetting everything derived.  The plan
list depends on the models only, so both versions build the same one.

With ``--planners``, the budget planner (:func:`memsaving.planners.budget.plan_for_budget`,
single-level search, per-op refinements, multi-level plans) plans each
model for two budgets instead, and its proposal and every simulation it
remembers (the last 128 it ran) are compared: the sequences of plans the
planners really score.  Both versions must have the same planners then.

    python experiments/replay_identity.py dump  --code /work/main OUT.pkl --models DIR [--only NAME] [--planners]
    python experiments/replay_identity.py check --code .          OUT.pkl --models DIR [--only NAME] [--planners]

``--models``: a folder of pickled graph models (``*.pkl``, as for
``bench_replay --pickles``); every one is read.  ``--code``: the folder
whose ``memsaving`` package is imported (run the script by its path, so
that the folder it lies in does not decide it).
"""

from __future__ import annotations

import argparse
import pathlib
import pickle
import random
import sys
import time
from dataclasses import replace
from typing import Any, Dict, List, Tuple

FIELDS = ("peak_bytes", "forward_cost", "recompute_cost", "backward_cost", "timeline", "labels",
          "unit_ends", "step_seconds", "swapped_bytes")


def _models(folder: pathlib.Path, only: List[str]) -> Dict[str, Any]:
    """The pickled models of ``folder``, small ones also with the two
    executor flags flipped, and two synthetic models."""
    from memsaving.model.graph import chain_model
    models = {}
    for path in sorted(folder.glob("*.pkl")):
        with open(path, "rb") as f:
            model = pickle.load(f)
        models[path.stem] = model
        if len(model.ops) < 400:
            models[path.stem + "/serial"] = replace(model, ready_gradients_early=False)
            models[path.stem + "/held-results"] = replace(model, separate_result_kernels=False)
    models["chain"] = chain_model([4096 + 64 * (k % 7) for k in range(120)], grad_reads="both")
    models["chain/early"] = replace(models["chain"], ready_gradients_early=True, separate_result_kernels=True)
    if only:
        models = {name: model for name, model in models.items() if name.split("/")[0] in only}
    return models


def _plans(model) -> List[Tuple[str, Dict[str, Any]]]:
    """``(name, simulate keyword arguments)`` of every plan scored on ``model``."""
    from memsaving.candidates.cuts import memory_candidates
    from memsaving.model.schedule import RECOMPUTING, backward_units, kept_set, validate_inner
    from memsaving.planners.refine import recomputed_ops
    from memsaving.sim.swap import CostModel, swap_candidates

    rng = random.Random(len(model.ops))
    scale = max(1, len(model.ops) // 1500)  # fewer plans on the largest graphs
    cuts = [sorted(cut) for cut, _ in memory_candidates(model)]
    candidates = [i for i, op in enumerate(model.ops) if op.forward and op.copyable
                  and sum(model.tensors[t].nbytes for t in op.outputs) > 0]
    plans: List[Tuple[str, Dict[str, Any]]] = []

    def add(name: str, ops, **options) -> None:
        plans.append((name, dict(checkpoint_ops=sorted(set(ops)), **options)))

    def union(chosen) -> List[int]:
        return sorted({i for k in chosen for i in cuts[k]})

    add("plain", [])
    add("keep all", candidates)
    for k in (1, 2, 4, 8):
        add(f"every {k}th cut", union(range(0, len(cuts), k)))

    def neighbours(name: str, start: List[int], count: int, every: int, **options) -> None:
        """keep_more's trials: the start plus one recomputed op, every
        ``every``-th trial accepted."""
        current = sorted(start)
        order = sorted(recomputed_ops(model, current))
        rng.shuffle(order)
        for n, i in enumerate(order[:count]):
            trial = sorted(set(current) | {i})
            add(f"{name} +{i}", trial, **options)
            if n % every == every - 1:
                current = trial

    def drops(name: str, count: int, every: int, **options) -> None:
        """drop_from_keep_all's trials: everything kept but one more op."""
        current = set(candidates)
        order = list(candidates)
        rng.shuffle(order)
        for n, i in enumerate(order[:count]):
            trial = current - {i}
            add(f"{name} -{i}", trial, **options)
            if n % every == every - 1:
                current = trial

    def cut_moves(name: str, count: int, **options) -> None:
        """The budget search's moves: add, drop or shift one cut."""
        chosen = sorted(rng.sample(range(len(cuts)), min(len(cuts), max(1, len(cuts) // 6))))
        for _ in range(count):
            move = rng.choice("ads")
            if move == "a" or not chosen:
                chosen = sorted(set(chosen) | {rng.randrange(len(cuts))})
            elif move == "d":
                chosen = sorted(set(chosen) - {rng.choice(chosen)})
            else:
                k = rng.randrange(len(chosen))
                chosen = sorted(set(chosen[:k] + [min(len(cuts) - 1, chosen[k] + 1)] + chosen[k + 1:]))
            add(f"{name} {tuple(chosen)[:6]}", union(chosen), **options)

    start = union(range(0, len(cuts), 4))
    neighbours("keep more", start, 60 // scale, 3)
    neighbours("keep more, results kept", union(range(0, len(cuts), 2)), 20 // scale, 2, keep_x_gradients=True)
    drops("drop", 50 // scale, 2)
    drops("drop, results kept", 12 // scale, 3, keep_x_gradients=True)
    cut_moves("cut moves", 30 // scale)
    for n in range(20 // scale):
        density = rng.choice((0.05, 0.2, 0.5, 0.9))
        add(f"random {n}", [i for i in candidates if rng.random() < density],
            keep_x_gradients=rng.random() < 0.3)
    for n in range(6 // scale):
        ops = [i for i in candidates if rng.random() < 0.3]
        add(f"inplace {n}", ops, inplace=True)
        add(f"inplace off {n}", ops, inplace=False)
    for n in range(4 // scale):
        add(f"unpinned {n}", [i for i in candidates if rng.random() < 0.2], unpinned=True,
            keep_x_gradients=n % 2 == 1)
    for n in range(4 // scale):
        ops = [i for i in candidates if rng.random() < 0.4]
        tensors = swap_candidates(model, kept_set(model, ops))
        swapped = tuple(t for t in tensors if rng.random() < 0.3)
        add(f"swapped {n}", ops, swapped=swapped, cost=CostModel())
        add(f"timed {n}", ops, cost=CostModel(bandwidth=8e9))
        add(f"swapped, default cost {n}", ops, swapped=swapped[::2], unpinned=True)

    def with_inner(ops: List[int], depth: int) -> Dict[int, Tuple[int, ...]]:
        """Inner checkpoints in some segments of the plan keeping ``ops``."""
        kept = kept_set(model, ops)
        inner: Dict[int, Tuple[int, ...]] = {}
        for unit in backward_units(model, kept):
            inside = [i for i in unit.ops if i != unit.anchor and model.ops[i].copyable
                      and any(model.tensors[t].trainable for t in model.ops[i].outputs)]
            if unit.kind in RECOMPUTING and len(inside) >= 3 and rng.random() < 0.6:
                inner[unit.anchor] = tuple(sorted(rng.sample(inside, min(len(inside) // 2, 3))))
                if depth > 1:
                    deeper = kept | set(inner[unit.anchor])
                    for sub in inner[unit.anchor]:
                        sub_units = backward_units(model, deeper | {sub})
                        segment = [u for u in sub_units if u.anchor == sub and u.kind in RECOMPUTING]
                        below = [i for i in (segment[0].ops if segment else ()) if i != sub and i in inside]
                        if len(below) >= 2 and rng.random() < 0.5:
                            inner[sub] = (below[len(below) // 2],)
        try:
            validate_inner(model, kept, inner)
        except ValueError:
            return {}
        return inner

    for n in range(8 // scale):
        ops = union(range(0, len(cuts), 3 + n % 3))
        inner = with_inner(ops, depth=1 + n % 2)
        if inner:
            add(f"inner {n}", ops, inner=inner, keep_x_gradients=n % 3 == 2)
            add(f"inner {n}, swapped", ops, inner=inner, swapped=tuple(sorted(swap_candidates(model, kept_set(
                model, ops), inner))[::3]), cost=CostModel())
            # neighbours: one inner checkpoint dropped at a time
            for anchor in sorted(inner)[:6]:
                fewer = dict(inner)
                fewer[anchor] = fewer[anchor][1:]
                try:
                    validate_inner(model, kept_set(model, ops), fewer)
                except ValueError:
                    continue
                add(f"inner {n} less at {anchor}", ops, inner=fewer)
    return plans


def _score(model, plans, forget_all: bool = False) -> List[Tuple]:
    """Every plan's simulation, as a tuple of :data:`FIELDS` (the
    remembered simulations forgotten first, so each is replayed)."""
    from memsaving.sim.simulate import simulate
    found = []
    for _, options in plans:
        if forget_all:
            sim = simulate(replace(model), **options)  # a copy: nothing derived yet
        else:
            model.derived("simulations", dict).clear()
            sim = simulate(model, **options)
        found.append(tuple(getattr(sim, name) for name in FIELDS))
    return found


def _planned(model) -> List[Tuple[str, Any]]:
    """The budget planner's proposals for two budgets between the lowest
    peak and plain backprop's, each with the simulations it remembers."""
    from memsaving.candidates.cuts import memory_candidates
    from memsaving.errors import BudgetError
    from memsaving.planners.budget import lowest_peak_plan, plan_for_budget
    from memsaving.sim.simulate import simulate

    candidates = [cut for cut, _ in memory_candidates(model)]
    plain = simulate(replace(model)).peak_bytes
    lowest = lowest_peak_plan(replace(model), candidates).peak
    found = []
    for fraction in (0.4, 0.8):
        copy = replace(model)
        budget = int(plain - fraction * (plain - lowest))
        try:
            proposal = repr(plan_for_budget(copy, candidates, budget))
        except BudgetError as error:
            proposal = str(error)
        remembered = {key: tuple(getattr(sim, name) for name in FIELDS)
                      for key, sim in copy.derived("simulations", dict).items()}
        found.append((f"budget {budget}: {proposal}", remembered))
    return found


def _compare(name: str, plans, expected, got, how: str) -> int:
    """Count (and print the first few of) the plans whose fields differ."""
    wrong = 0
    for (plan, _), want, have in zip(plans, expected, got):
        if want != have or repr(want) != repr(have):
            wrong += 1
            if wrong <= 3:
                fields = [field for field, a, b in zip(FIELDS, want, have) if a != b or repr(a) != repr(b)]
                print(f"  MISMATCH {name} [{how}] {plan}: {fields}")
    return wrong


def _dump(file: pathlib.Path, models: Dict[str, Any], make, describe) -> None:
    """Save ``make(model)`` of every model to ``file`` (what ``check`` compares
    against), printing ``describe`` of each and the time it took."""
    saved = {}
    for name, model in models.items():
        start = time.process_time()
        saved[name] = make(model)
        print(f"{name:28s} {describe(saved[name])}  {time.process_time() - start:6.1f} s")
    with open(file, "wb") as f:
        pickle.dump(saved, f)


def _check(file: pathlib.Path, models: Dict[str, Any], compare, what: str) -> None:
    """Compare every model with what ``_dump`` saved in ``file``:
    ``compare(name, model, saved)`` prints its line and returns (figures
    compared, figures that differ).  Exits 1 when any differs."""
    with open(file, "rb") as f:
        saved = pickle.load(f)
    total = wrong = 0
    for name, model in models.items():
        compared, bad = compare(name, model, saved[name])
        total += compared
        wrong += bad
    print(f"{total} {what} compared, {wrong} differ")
    sys.exit(1 if wrong else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("dump", "check"))
    parser.add_argument("file", type=pathlib.Path)
    parser.add_argument("--code", type=pathlib.Path, required=True, help="folder holding the memsaving package")
    parser.add_argument("--models", type=pathlib.Path, required=True,
                        help="folder of pickled GraphModel objects (*.pkl, as for bench_replay --pickles)")
    parser.add_argument("--only", nargs="*", default=[], help="model names (pickle stems, or chain)")
    parser.add_argument("--planners", action="store_true", help="compare the budget planner's runs instead")
    args = parser.parse_args()
    sys.path.insert(0, str(args.code.resolve()))
    import memsaving
    print(f"memsaving from {pathlib.Path(memsaving.__file__).parent}")
    models = _models(args.models, args.only)
    if args.planners:
        _check_planners(args, models)
        return
    if args.mode == "dump":
        def plans_and_scores(model):
            plans = _plans(model)
            return plans, _score(model, plans)

        _dump(args.file, models, plans_and_scores, lambda found: f"{len(found[0]):4d} plans")
        return
    _check(args.file, models, _replays_compared, "replays")


def _replays_compared(name: str, model, saved) -> Tuple[int, int]:
    """One model's dumped replays against this version's: in order,
    shuffled, and every seventh alone after forgetting everything."""
    plans, expected = saved
    if _plans(model) != plans:
        print(f"  {name}: the plan list differs from the dumped one")
        return 0, 1
    start = time.process_time()
    bad = _compare(name, plans, expected, _score(model, plans), "in order")
    order = list(range(len(plans)))
    random.Random(1).shuffle(order)
    shuffled = [plans[k] for k in order]
    bad += _compare(name, shuffled, [expected[k] for k in order], _score(model, shuffled), "shuffled")
    few = plans[::7]
    bad += _compare(name, few, expected[::7], _score(model, few, forget_all=True), "each alone")
    print(f"{name:28s} {len(plans):4d} plans  {bad} differ  {time.process_time() - start:6.1f} s")
    return 2 * len(plans) + len(few), bad


def _check_planners(args, models) -> None:
    """``main`` with ``--planners``."""
    if args.mode == "dump":
        _dump(args.file, models, _planned, lambda found: f"{len(found):4d} proposals")
        return
    _check(args.file, models, _planner_runs_compared, "proposals and simulations")


def _planner_runs_compared(name: str, model, saved) -> Tuple[int, int]:
    """One model's dumped planner proposals, and the simulations each
    remembered, against this version's."""
    total = wrong = 0
    for (want, want_sims), (have, have_sims) in zip(saved, _planned(model)):
        total += 1 + len(want_sims)
        bad = (want != have) + sum(want_sims.get(key) != sims for key, sims in have_sims.items())
        bad += len(set(want_sims) ^ set(have_sims))
        wrong += bad
        print(f"{name:28s} {len(have_sims):4d} simulations  {bad} differ  {have[:70]}")
    return total, wrong


if __name__ == "__main__":
    main()
