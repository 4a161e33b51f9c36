"""The surrogate options of `model:` through the objective seam: TRL's loss on a real step's
log-probs, what composes with which head and what is refused in one line, the entropy
threshold over two ranks, and a fit with every head under CISPO, GSPO-token and both masks."""

from __future__ import annotations

import datetime
import glob

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from composer_lightning.functional import grpo_advantages, high_entropy_mask
from composer_lightning.heads.dr_grpo import DrGRPOHead
from composer_lightning.heads.kl import KLHead
from composer_lightning.heads.opd import OPDHead
from composer_lightning.heads.sdpo import SDPOHead
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.protocols.step import StepContext
from composer_lightning.training.objective import Objective
from composer_lightning.training.surrogate import entropy_tokens
from tests.functional.test_surrogates import make_inputs, trl_loss
from tests.helpers import ROOT, run_cli, run_main


def _batch(mask, engine_logprobs=None, rewards=(1.0, 0.0, 0.5, 0.0)) -> RolloutBatch:
    B, T = mask.shape
    return RolloutBatch(
        input_ids=torch.ones(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T, dtype=torch.long),
        response_mask=mask,
        rewards=torch.tensor(rewards, dtype=torch.float64),
        has_reward=torch.ones(B, dtype=torch.bool),
        group_ids=torch.tensor([0, 0, 1, 1]),
        max_response_length=T,
        engine_logprobs=engine_logprobs,
    )


def _ctx(lp, old, ent) -> StepContext:
    return StepContext(
        global_step=0,
        logprobs=lp,
        old_logprobs=old,
        aggregation="token_mean",
        norm_length=None,
        temperature=1.0,
        _provided={"entropy": ent},
    )


@pytest.mark.parametrize(
    "loss_type, mode, level",
    [("dapo", "clip", "sequence"), ("cispo", "cispo", "token"), ("cispo", "cispo", "sequence")],
)
def test_objective_equals_trls_loss_with_both_masks_and_the_entropy_bonus(loss_type, mode, level):
    """Dr. GRPO's advantages through the objective with the high-entropy mask, the off-policy
    mask against the engine's log-probs and an entropy bonus: TRL's `_compute_loss` on the
    same tensors (its `num_items_in_batch` normaliser is `token_mean` on one process)."""
    lp, old, _, mask, ent = make_inputs(per_sequence=False)
    engine = old + 0.3 * torch.rand(old.shape, generator=torch.Generator().manual_seed(1))
    batch = _batch(mask, engine.to(torch.float64))
    objective = Objective(
        [DrGRPOHead()],
        aggregation="token_mean",
        loss_mode=mode,
        importance_sampling_level=level,
        top_entropy_quantile=0.6,
        off_policy_mask_threshold=0.15,
        entropy_coef=0.05,
        importance_cap=None,
    )
    a, b = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    ent_a, ent_b = ent.clone().requires_grad_(), ent.clone().requires_grad_()
    loss, metrics = objective(batch, _ctx(a, old, ent_a), {"dr_grpo": 1.0})
    adv = grpo_advantages(batch.rewards, batch.group_ids, batch.has_reward, "none")
    want = trl_loss(
        b,
        old,
        adv,
        mask,
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_high=1.28 if loss_type == "cispo" else 0.28,
        entropies=ent_b,
        top_entropy_quantile=0.6,
        off_policy_mask_threshold=0.15,
        sampling_per_token_logps=batch.engine_logprobs,
        entropy_coef=0.05,
    )
    assert abs(loss.item() - want.item()) < 1e-12
    (loss + 0 * ent_a.sum()).backward()
    want.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-12, rtol=0)
    assert torch.allclose(ent_a.grad, ent_b.grad, atol=1e-12, rtol=0)
    assert 0 < metrics["ppo/is_entropy_kept"] < 1 and 0 < metrics["ppo/is_off_policy_kept"] <= 1


def test_gspo_is_refused_beside_per_token_advantages_and_gspo_token_is_not():
    with pytest.raises(ValueError, match=r"head\(s\) \['opd'\] give per-token advantages: use"):
        Objective([DrGRPOHead(), OPDHead()], importance_sampling_level="sequence")
    with pytest.raises(ValueError, match=r"\['kl'\]"):
        Objective([DrGRPOHead(), KLHead()], importance_sampling_level="sequence")
    # loss heads, a zero-weight OPD and GSPO-token compose
    Objective(
        [DrGRPOHead(), KLHead(0.1, "k3", "loss"), SDPOHead()], importance_sampling_level="sequence"
    )
    Objective([DrGRPOHead(), OPDHead(weight=0.0)], importance_sampling_level="sequence")
    Objective([DrGRPOHead(), OPDHead()], importance_sampling_level="sequence_token")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss_mode": "gspo"}, "loss_mode must be one of ('clip', 'cispo', 'sapo'), got 'gspo'"),
        (
            {"importance_sampling_level": "seq"},
            "importance_sampling_level must be one of ('token', 'sequence', 'sequence_token')",
        ),
        ({"loss_mode": "sapo", "dual_clip": 3.0}, "dual_clip=3.0 bounds the clipped surrogate"),
        ({"top_entropy_quantile": 0.0}, "top_entropy_quantile must be in (0, 1], got 0.0"),
        ({"off_policy_mask_threshold": -1.0}, "off_policy_mask_threshold must be finite"),
        ({"sapo_temperature_neg": 0.0}, "sapo_temperature_neg must be finite and > 0, got 0.0"),
    ],
)
def test_bad_surrogate_options_are_one_line(kwargs, message):
    with pytest.raises(ValueError) as err:
        Objective([DrGRPOHead()], **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def _rank_inputs(rank: int):
    """Rank 1's entropies are 4x rank 0's: its own threshold differs from the pooled one."""
    lp, old, adv, mask, ent = make_inputs(seed=rank)
    return lp, old, adv, mask, ent * (1 + 3 * rank)


def _pooled(rank: int, store: str, results: dict) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    lp, old, _, mask, ent = _rank_inputs(rank)
    kept = entropy_tokens(_ctx(lp, old, ent), _batch(mask), 0.3)
    results[rank] = kept
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # two ranks in processes of their own
def test_the_entropy_threshold_is_taken_over_every_ranks_tokens(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_pooled, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
        results = dict(results)
    pool = torch.cat([_rank_inputs(r)[4][_rank_inputs(r)[3]] for r in (0, 1)])
    for rank in (0, 1):
        _, _, _, mask, ent = _rank_inputs(rank)
        want = high_entropy_mask(ent, mask, 0.3, pool).bool()
        assert torch.equal(results[rank], want)
        assert not torch.equal(want, high_entropy_mask(ent, mask, 0.3).bool())  # pooling matters


@pytest.mark.slow  # fits through the command line
@pytest.mark.parametrize(
    "options",
    [
        "--model.loss_mode=cispo --model.importance_sampling_level=sequence_token "
        "--model.top_entropy_quantile=0.5 --model.off_policy_mask_threshold=0.05",
        "--model.loss_mode=sapo --model.entropy_coef=0.01 --model.top_entropy_quantile=0.8",
    ],
)
def test_every_head_trains_under_the_options(options, tmp_path):
    """The synthetic demo's five heads (Dr. GRPO, OPD, SDPO, replay DPO, KL) with two updates
    per batch, so the second update is off policy."""
    out = run_cli(
        "fit",
        "--config",
        str(ROOT / "configs" / "synthetic_demo.yaml"),
        "--trainer.max_steps=4",
        "--model.ppo_epochs=2",
        *options.split(),
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (metrics,) = glob.glob(str(tmp_path / "synthetic_demo" / "*" / "metrics.csv"))
    text = open(metrics).read()
    assert "ppo/is_entropy_kept" in text
    assert ("ppo/is_off_policy_kept" in text) == ("off_policy" in options)


def test_gspo_beside_opd_is_one_line_from_the_command_line(capfd):
    out = run_main(
        capfd,
        "fit",
        "--config",
        str(ROOT / "configs" / "synthetic_demo.yaml"),
        "--model.importance_sampling_level=sequence",
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "head(s) ['opd', 'kl'] give per-token advantages" in out.stderr
