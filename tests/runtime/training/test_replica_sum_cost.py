"""The planner's price of the gradient sum between replica groups
(``planning/replica_groups.groups_grad_sum_s``) counts what ``runtime/replica_sync.py`` sums:
each rank's bytes, the holders in each ring, the holder sets it runs and which of them take
the two-level sum, on every grouped layout that tests/runtime/training/test_replica_groups.py
runs against the reference (which so checks both paths' numbers)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch
from tests.runtime.training.plans import grouped_plan
from tests.runtime.training.test_replica_groups import CASES, LLAMA

from hettrain.planning.replica_groups import _holder_sets, stage_grad_bytes
from hettrain.planning.support import group_cp, group_stage_units
from hettrain.runtime.model import whole_model
from hettrain.runtime.replica_sync import (
    cell_sets,
    chunk_rings,
    slice_bounds,
    two_level,
    unit_param_names,
)

TIED = replace(LLAMA, tie_embeddings=True)  # the head unit is the final norm alone


def _shapes(model) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in whole_model(model, seed=0).named_parameters()}


SHAPES = {LLAMA: _shapes(LLAMA), TIED: _shapes(TIED)}


def _cell_elements(model, name: str, cell) -> int:
    """Elements of one cell of global parameter ``name`` on a rank that holds it."""
    shape = SHAPES[model][name]
    if cell.dim is None:
        return math.prod(shape)
    return math.prod(shape) // shape[cell.dim] * (cell.end - cell.start)


# a tied model runs one stage per replica (runtime.model.check_layout): pp 1 beside pp 1
TIED_CASES = {"tied-pp1": [{"splits": [(0, 4, "a")], "dp": 2, "num_microbatches": 3},
                           {"splits": [(0, 4, "b")], "tp": 2, "num_microbatches": 1}]}


@pytest.mark.parametrize(("case", "model"), [(c, LLAMA) for c in CASES]
                         + [(c, TIED) for c in TIED_CASES])
def test_each_rank_sums_the_bytes_the_planner_prices(case, model):
    plan = grouped_plan({**CASES, **TIED_CASES}[case], model=model)
    units = group_stage_units(plan)
    holders = sum(g.dp * group_cp(g.stages) for g in plan.groups)
    cuts = {s.layer_start for g in plan.groups for s in g.stages}
    equal_tp = all(len({s.tp for g in plan.groups for s in g.stages
                        if s.layer_start <= layer < s.layer_end}) == 1
                   for layer in range(model.layers))
    for r in plan.ranks:
        g = plan.groups[r.group]
        st = g.stages[r.stage]
        names = [n for u in units[(r.group, r.stage)] for n in unit_param_names(model, u)]
        assert set(names) <= set(SHAPES[model])
        mine = [(n, c) for n in names for c in cell_sets(plan, n) if r.rank in c[1]]
        summed = 4 * sum(_cell_elements(model, n, cell) for n, (cell, _, _) in mine)
        want = stage_grad_bytes(model, st.layer_start, st.layer_end, st.tp,
                                st.index == 0, st.index == g.pp - 1)
        assert summed == want, (case, r)
        # every replica (and CP rank) of every group contributes each piece once
        assert all(len(contrib) == holders for _, (_, _, contrib) in mine), (case, r)
        sets = {members for _, (_, members, _) in mine}
        # every set whose holders all contribute is summed in two levels, across datacenters
        # too: inside each group on its DP×CP group, then each rank's 1/d slice between the
        # groups (the planner's _two_level_s), in rings of one owner per group
        elements: dict[tuple[int, ...], int] = {}
        for n, (cell, members, _) in mine:
            elements[members] = elements.get(members, 0) + _cell_elements(model, n, cell)
        for _, (_, members, contrib) in mine:
            split = two_level(plan, members, contrib)
            assert (split is not None) == (contrib == frozenset(members)), (case, r)
            if split is None:
                continue
            assert len(split) == len(plan.groups)
            assert split[r.group] == sorted(  # the rank's own DP×CP group
                x.rank for x in plan.ranks if (x.group, x.stage, x.tp) == (
                    r.group, r.stage, r.tp))
            d = g.dp * group_cp(g.stages)
            bounds = slice_bounds(elements[members], d)
            i = split[r.group].index(r.rank)
            rings = chunk_rings(elements[members], [split[x] for x in sorted(split)])
            pieces = [(lo, hi) for lo, hi, owners in rings if r.rank in owners]
            # its rings cover exactly its slice, each with one owner per group
            assert sum(hi - lo for lo, hi in pieces) == bounds[i + 1] - bounds[i], (case, r)
            assert all(bounds[i] <= lo < hi <= bounds[i + 1] for lo, hi in pieces)
            assert all(len(owners) == len(plan.groups) for *_, owners in rings)
        if equal_tp:  # one ring per run of layers shared with the same stages elsewhere
            assert len(sets) == _holder_sets(st.layer_start, st.layer_end, cuts), (case, r)
            assert all(len(m) == holders for m in sets)


@pytest.mark.parametrize("sizes", [(3, 2), (1, 4), (4, 4, 2), (5, 3, 7)])
@pytest.mark.parametrize("n", [1, 5, 12, 37, 100])
def test_chunk_rings_give_each_element_its_slice_owner_in_every_group(n, sizes):
    """The rings tile the set's elements, and each element's ring holds, in every group, the
    member whose reduce-scatter slice has it (brute force, element by element)."""
    holders = [[100 * g + i for i in range(d)] for g, d in enumerate(sizes)]
    rings = chunk_rings(n, holders)
    assert rings[0][0] == 0 and rings[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(rings))
    for e in range(n):
        (owners,) = [o for lo, hi, o in rings if lo <= e < hi]
        want = []
        for h in holders:
            bounds = slice_bounds(n, len(h))
            assert bounds[0] == 0 and bounds[-1] == n and bounds == sorted(bounds)
            (i,) = [i for i in range(len(h)) if bounds[i] <= e < bounds[i + 1]]
            want.append(h[i])
        assert owners == tuple(sorted(want)), (n, sizes, e)
