"""Which weights served a turn: the version tree of launches across restarts
(`serve/lineage.py`) — a turn the lost weights served is never on policy, however its version
number compares with the resumed run's — and the fingerprint check of every push."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from composer_lightning.serve.lineage import distance, path

# launch 1: a fresh run from version 0; it crashed at 13 after a checkpoint at 10.
# launch 2: resumed from launch 1's checkpoint at 10; crashed at 14 after a checkpoint at 12.
# launch 3: resumed from launch 2's checkpoint at 12.
# launch 4: resumed again from launch 1's checkpoint at 10 (launch 2 and 3 abandoned).
# launch 5: another fresh run in the same store.
TREE = {1: (None, 0), 2: (1, 10), 3: (2, 12), 4: (1, 10), 5: (None, 0)}


def test_path_lists_each_launchs_last_version_from_the_root():
    assert path(TREE, 3, 15) == [(1, 10), (2, 12), (3, 15)]
    assert path(TREE, 1, 7) == [(1, 7)]
    assert path({}, 9, 4) == [(9, 4)]  # unknown: a root


@pytest.mark.parametrize(
    ("current", "turn", "steps"),
    [
        ((1, 9), (1, 6), 3),  # one launch: the version difference
        ((1, 9), (1, 9), 0),
        ((2, 11), (1, 10), 1),  # the checkpoint's own weights, then one step
        ((2, 10), (1, 10), 0),  # the restored weights are those that served it: on policy
        ((2, 11), (1, 8), 3),  # before the fork: on the resumed run's own history
        ((2, 10), (1, 13), 3),  # the lost weights: 3 steps past the fork at 10
        ((2, 11), (1, 11), 2),  # same number, other weights: 1 + 1 through the fork
        ((3, 13), (2, 14), 1 + 2),  # launch 2 lost 13-14 past its checkpoint at 12
        ((3, 13), (2, 12), 1),
        ((3, 13), (1, 10), 3),  # through two resumes
        ((3, 13), (1, 12), 3 + 2),  # launch 1's lost 11-13 forked at 10
        ((4, 11), (2, 12), 1 + 2),  # siblings forked from launch 1 at 10
        ((4, 11), (3, 13), 1 + 3),
        ((5, 3), (1, 4), 3 + 4),  # another run: only the base weights are shared
        ((5, 3), (0, 1), 2),  # launch 0 (before launches were recorded): versions alone
    ],
)
def test_distance_counts_the_steps_through_the_fork(current, turn, steps):
    assert distance(TREE, current, turn) == steps
    assert distance(TREE, turn, current) == steps  # a distance: symmetric


def test_a_cycle_of_launches_is_refused_by_name():
    with pytest.raises(ValueError, match="cycle through launch 1"):
        path({1: (2, 0), 2: (1, 0)}, 1, 3)


def _judged(store, launch: int, version: int, session: str) -> int:
    turn = store.record(session, [{"role": "user", "content": "1 + 2?"}], [1, 2], [29, 1], "3",
                        [-0.5, -0.1], version, launch=launch)  # fmt: skip
    store.end_session(session)
    (claimed,) = store.claim_ready(1, claimant="j")
    store.set_judged(claimed.id, 1.0, None, claimant="j")
    return turn


def test_a_turn_the_lost_weights_served_is_importance_corrected_or_dropped(tmp_path):
    """After a crash at 13 and a resume from 10 (launch 2), a turn launch 1 served at version
    11 looks current to a version count at the resumed run's version 11; it is 2 steps away.
    Its batch is stamped 9 (importance-corrected), a batch of the resumed run's own version-11
    turn is on policy (11), and with max_staleness 1 the lost turn is dropped as stale."""
    from transformers import AutoTokenizer

    from composer_lightning.engines import HFEngine
    from composer_lightning.models.tiny import tiny_policy_path
    from composer_lightning.serve.store import TurnStore
    from composer_lightning.serve.training import ServeCallback
    from composer_lightning.tasks.feedback import FeedbackScore

    tok = AutoTokenizer.from_pretrained(tiny_policy_path())
    trainer = SimpleNamespace(
        callbacks=[], _signal_connector=SimpleNamespace(received_sigterm=False)
    )
    for limit, expected in ((4, [(1, 11), (2, 11)]), (1, [(2, 11)])):
        store = TurnStore(tmp_path / f"turns{limit}.sqlite")
        first = store.begin_launch(None, 0)
        cb = ServeCallback(
            HFEngine(model_path=tiny_policy_path()), batch_size=len(expected),
            score=FeedbackScore(), max_staleness=limit,
        )  # fmt: skip
        cb.store, cb._launch = store, store.begin_launch(first, 10)
        lost = _judged(store, first, 11, "lost")
        _judged(store, cb._launch, 11, "own")
        turns = cb.take(trainer, version=11)
        assert [(t.launch, t.version) for t in turns] == expected
        if limit == 1:
            assert store.get(lost).drop_reason == "stale"
            assert cb.samples(turns, tok, version=11).policy_version == 11  # on policy
        else:
            assert cb.samples(turns, tok, version=11).policy_version == 9
            assert cb.samples(turns[1:], tok, version=11).policy_version == 11


def test_every_push_is_checked_against_the_engines_fingerprint(tmp_path):
    """Serving checks each push exactly, before any request sees the weights: a push that
    reaches the engine compares every parameter; one the engine loses one tensor of stops the
    run naming the version (serve batches mix versions, so the log-prob canary often cannot
    compare; the fingerprint always does)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from composer_lightning.engines import HFEngine
    from composer_lightning.models.tiny import tiny_policy_path
    from composer_lightning.serve.backend import EngineBackend
    from composer_lightning.serve.training import ServeCallback
    from composer_lightning.tasks.feedback import FeedbackScore
    from composer_lightning.training.canary import OutOfSyncError

    class LosesOne(HFEngine):
        def load_weights(self, weights, version):
            super().load_weights(
                [(n, t) for n, t in weights if not n.endswith("norm.weight")], version
            )

    policy = AutoModelForCausalLM.from_pretrained(tiny_policy_path())
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.01)  # trained weights: unlike the engine's
    module = SimpleNamespace(policy=policy, policy_version=3)
    tok = AutoTokenizer.from_pretrained(tiny_policy_path())
    for engine_class, fails in ((HFEngine, False), (LosesOne, True)):
        engine = engine_class(model_path=tiny_policy_path())
        cb = ServeCallback(engine, score=FeedbackScore())
        cb.backend = EngineBackend(engine, tok)
        if fails:
            with pytest.raises(OutOfSyncError, match="weights of policy_version 3"):
                cb._push(module)
        else:
            cb._push(module)
            assert cb._fingerprint_params == len(list(policy.parameters()))
