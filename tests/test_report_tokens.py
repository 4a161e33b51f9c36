"""Per-token details for the run report: SDPO's per-token divergence (`HeadOutput.token_metrics`),
the objective's observers, and `TokenDetails`' rows, against values derived by hand."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from composer_lightning.datamodules.synthetic import SyntheticRolloutDataModule, synthetic_batch
from composer_lightning.functional import generalized_jsd
from composer_lightning.heads.base import HeadOutput
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.report.tokens import TokenDetails, capture, inserted, pick_rows
from composer_lightning.training.module import ComposerModule
from tests.helpers import context, full_logits, quiet_trainer, tiny_model


def _batch(**kw):
    return synthetic_batch(torch.Generator().manual_seed(4), vocab_size=64, **kw)


def test_sdpo_gives_each_supervised_token_its_own_jsd_and_zero_elsewhere():
    """token_metrics["jsd"][b, t] is the generalised JSD of that token's student and teacher
    distributions (an explicit loop over the mapped positions); its mean over the supervised
    tokens is the loss."""
    policy, teacher = tiny_model(seed=0), tiny_model(seed=1)
    batch = _batch(hint_prob=1.0)
    head = SDPOHead(beta=0.3, temperature=0.7, clip=None)
    module = ComposerModule(policy, [head], teacher=teacher)
    out = head.compute(batch, context(module, batch, set(head.requires)))
    jsd = out.token_metrics["jsd"]
    assert jsd.shape == batch.input_ids.shape and not jsd.requires_grad
    s_logits = full_logits(policy, batch.input_ids, batch.attention_mask)
    t_logits = full_logits(teacher, batch.teacher_input_ids, batch.teacher_attention_mask)
    mask = batch.sdpo_mask & batch.has_teacher.unsqueeze(1)
    for b in range(batch.batch_size):
        for t in range(batch.input_ids.shape[1]):
            if not mask[b, t]:
                assert jsd[b, t] == 0
                continue
            p = int(batch.teacher_positions[b, t])
            ref = generalized_jsd(
                s_logits[b, t - 1 : t], t_logits[b, p - 1 : p], beta=0.3, temperature=0.7
            )
            torch.testing.assert_close(jsd[b, t], ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(jsd[mask].mean(), out.loss.detach(), rtol=0, atol=1e-12)


def test_a_token_metric_that_is_not_b_by_t_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"token_metrics\['jsd'\] must be \[B, T\], got \(3,\)"):
        HeadOutput(loss=torch.tensor(0.0), token_metrics={"jsd": torch.zeros(3)})


def test_the_objective_hands_its_observers_each_heads_output_and_weights():
    module = ComposerModule(tiny_model(), [DrGRPOHead(), OPDHead(weight=0.5)])
    batch = _batch(hint_prob=1.0)
    seen = []
    module.objective.observers.append(lambda *args: seen.append(args))
    weights = module.objective.weights(0)
    module.objective(batch, context(module, batch), weights)
    ((observed, _, outputs, effective),) = seen
    assert observed is batch and set(outputs) == {"dr_grpo", "opd"}
    assert effective == {"dr_grpo": 1.0, "opd": 0.5}


def test_captured_rows_hold_the_opd_gap_centred_per_reply_and_the_student_log_probs():
    """OPD's per-token value is (teacher − student) − its mean over the reply (`center:
    sequence`), from the very log-probs the row holds; Dr. GRPO's is one number over the reply;
    a row without a hint has no teacher log-probs and an OPD value of 0."""
    batch = _batch(hint_prob=0.5, prompts=4, group_size=2)
    module = ComposerModule(tiny_model(), [DrGRPOHead(), OPDHead()])
    ctx = context(module, batch)
    outputs = module.objective.head_outputs(batch, ctx, module.objective.weights(0))
    rows = capture(batch, ctx, outputs, {"dr_grpo": 1.0, "opd": 1.0}, n=4)
    assert len(rows) == 4 and len({r["group"] for r in rows}) == 4
    hinted = [r for r in rows if r["has_teacher"]]
    assert hinted and rows[: len(hinted)] == hinted  # hinted rows first
    for row in rows:
        opd, grpo = row["values"]["opd"], row["values"]["dr_grpo"]
        assert len(opd) == len(grpo) == len(row["token_ids"]) == len(row["student_logprobs"])
        assert len(set(grpo)) == 1
        if not row["has_teacher"]:
            assert row["teacher_logprobs"] is None and set(opd) == {0.0}
            assert row["signal"] in ("rl_only", "dropped")
            continue
        gap = [t - s for t, s in zip(row["teacher_logprobs"], row["student_logprobs"], strict=True)]
        mean = sum(gap) / len(gap)
        assert opd == pytest.approx([g - mean for g in gap], abs=5e-5)
        assert row["teacher_prompt_ids"][: len(row["prompt_ids"])] == row["prompt_ids"]


def test_pick_rows_takes_one_reply_a_group_hinted_groups_first():
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    hinted = [False, True, False, False, True, True, False, False]
    assert pick_rows(groups, hinted, 3) == [4, 0, 2]  # group 2's first row is hinted
    assert pick_rows(groups, hinted, 10) == [4, 0, 2, 6]


@pytest.mark.parametrize(
    "before,after,hint",
    [
        ("What is 2 + 3?", "What is 2 + 3?The answer is odd.", "The answer is odd."),
        ([1, 7, 8, 2], [1, 7, 8, 1, 9, 2], [1, 9]),  # a user turn spliced in, its tokens whole
        ([1, 7, 2], [1, 7, 2], []),
    ],
)
def test_the_hint_is_what_the_teacher_context_adds_to_the_prompt(before, after, hint):
    assert inserted(before, after) == hint


def test_token_details_of_a_fit_hold_every_heads_value_on_each_token(tmp_path):
    """A fit with `TokenDetails` writes `rows` replies of every step, each token with each
    advantage head's value, the student's log-prob and the heads' weights, and lets go of the
    objective at the end."""
    trainer = quiet_trainer(
        max_steps=3,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="run"),
        callbacks=[TokenDetails(rows=2)],
    )
    module = ComposerModule(tiny_model(), [DrGRPOHead(), OPDHead(weight=0.5)])
    trainer.fit(module, SyntheticRolloutDataModule(vocab_size=64))
    assert module.objective.observers == []
    rows = [json.loads(line) for line in open(tmp_path / "run" / "version_0" / "tokens.jsonl")]
    assert [r["step"] for r in rows] == [0, 0, 1, 1, 2, 2]
    for row in rows:
        assert set(row["values"]) == {"dr_grpo", "opd"}
        assert len(row["tokens"]) == len(row["values"]["opd"]) == len(row["student_logprobs"])
        assert row["weights"] == {"dr_grpo": 1.0, "opd": 0.5}


@pytest.mark.parametrize("kwargs", [{"rows": 0}, {"every_n_steps": True}])
def test_bad_token_details_settings_are_refused_naming_the_value(kwargs):
    ((name, value),) = kwargs.items()
    with pytest.raises(
        ValueError, match=f"TokenDetails.{name} must be an integer >= 1, got {value}"
    ):
        TokenDetails(**kwargs)
