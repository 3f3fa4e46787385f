"""The budget selection against the exact optimum of the same plan space."""

import numpy as np
import pytest

from memsaving.planners.budget import select_for_budget
from memsaving.errors import BudgetError
from memsaving.references.exact import optimal_plan
from memsaving.model.graph import chain_model
from memsaving.sim.simulate import simulate

from chains import random_chains


@pytest.mark.slow
def test_budget_plans_are_near_the_exact_optimum():
    ratios = []
    for model in random_chains(9, 11, seed=7):
        plain = simulate(model).peak_bytes
        candidates = list(range(len(model.ops) - 1))
        for fraction in (0.5, 0.65, 0.8):
            budget = int(plain * fraction)
            optimum = optimal_plan(model, candidates, budget)
            if optimum is None:
                with pytest.raises(BudgetError):
                    select_for_budget(model, candidates, budget)
                continue
            proposal = select_for_budget(model, candidates, budget)
            ops, peak = proposal.checkpoint_ops, proposal.peak
            assert peak <= budget
            step = 3 * model.forward_cost()
            ratios.append((step + simulate(model, ops).recompute_cost) / (step + optimum[1]))
    assert len(ratios) >= 12
    assert min(ratios) >= 1.0 - 1e-9, "cannot beat the exact optimum"
    assert float(np.exp(np.mean(np.log(ratios)))) <= 1.02


def test_exact_reference_refuses_large_inputs():
    model = chain_model([10] * 30)
    with pytest.raises(ValueError, match="2\\^n"):
        optimal_plan(model, list(range(29)), 100)
