"""Gradient shares and gradient-norm matching over two gloo ranks under FSDP2 equal one
process's measurement of the ranks' mean objective (tests/scale/_grad_share.py)."""

import os
import subprocess
import sys

import pytest
import torch

from composer_lightning.functional.gradients import (
    gradient_gram,
    gradient_shares,
    hidden_gradients,
)
from composer_lightning.training.mixer import grad_norm_scales
from tests.helpers import ROOT
from tests.scale._grad_share import batch, module

pytestmark = pytest.mark.slow  # two ranks in processes of their own


def test_two_ranks_measure_the_mean_objective_and_agree_on_the_scales(tmp_path):
    """DDP and FSDP2 average the ranks' gradients, so the step's objective is the ranks' mean:
    the Gram matrix is Σ_r G_r / 4. Both ranks log this process's norms and shares of the
    mean of their pieces, and the same matched weights, to 1e-10; the measurement leaves the
    FSDP2 backward's (averaged) parameter gradients bit for bit as without it; measured in
    micro-batches, norms, shares and gradients are the unbatched ones to 1e-10."""
    out = tmp_path / "run.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scale" / "_grad_share.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(f"{out}.rank{r}") for r in (0, 1)]

    pieces, at = {}, []
    m = module()
    weights = m.objective.weights(0)
    for r in (0, 1):
        b = batch(r)
        ctx = m.step_context(b, m.objective.requirements(weights))
        outputs = m.objective.head_outputs(b, ctx, weights)
        for name, piece in m.objective.pieces(b, ctx, outputs, weights).items():
            pieces[name] = pieces.get(name, 0.0) + piece / 2
        at += ctx.policy_states()
    names = list(pieces)
    gram = gradient_gram(hidden_gradients(pieces, at))
    want = gradient_shares(gram, names)
    unit = {n: float(gram[h, h]) / weights[n] ** 2 for h, n in enumerate(names)}
    scales = grad_norm_scales(unit, "dr_grpo")
    assert any(abs(s - 1) > 1e-3 for s in scales.values())

    for saved in ranks:
        got = saved["plain_True"]["metrics"]
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
        matched = saved["matched_False"]["metrics"]
        for name in names:
            assert matched[f"{name}/weight"] == pytest.approx(
                weights[name] * scales[name], rel=1e-10
            )
        measured, plain = saved["plain_True"]["grads"], saved["plain_False"]["grads"]
        assert all(torch.equal(measured[n], plain[n]) for n in plain)
        micro = saved["micro_True"]
        for key, value in want.items():
            assert micro["metrics"][key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
        for n, g in plain.items():
            torch.testing.assert_close(micro["grads"][n], g, rtol=0, atol=1e-10, msg=n)
