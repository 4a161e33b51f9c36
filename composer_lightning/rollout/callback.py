"""`RolloutCallback`: generate → score + hint → four-way dispatch → `RolloutBatch`; push weights.

Generation runs in `on_train_batch_start` (the prompt batch is filled in place under the key
`"rollout"`), so step k trains on rollouts of the weights after update k − 1. The push runs in
`on_train_batch_end`, after the rollout batch's last optimizer step, then the engine's prefix
cache is reset. On (re)start the engine is synced from the trainer's weights before it
generates. The callback orchestrates; its parts have owners of their own: the setup checks
(`checks.py`), seeds and tensor-parallel groups (`generation.py`), generation ahead of the
trainer with `max_staleness = k > 0` (`ahead.py`), the episode loop (`episodes.py`), the
dispatch (`dispatch.py`), replies sampled with the hint in context (`hinted.py`) and held-out
evaluation (`validation.py`).

The canary compares the engine's weight fingerprint of the version that generated each batch
with the trainer's (`engines/fingerprint.py`), exactly.

Why this file is long: `RolloutCallback` is the class a run configures as `rollout:`, and its
twenty-four options are documented on it (≈ 70 lines, what `--help` shows); what it
orchestrates lives in the modules named above, the hint check among them (`hint_check.py`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, replace
from typing import Any, Literal, cast

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn

from composer_lightning.callbacks.samples import write_samples
from composer_lightning.engines.base import (
    EngineContext,
    RolloutEngine,
    SamplingConfig,
    stop_text_ids,
)
from composer_lightning.engines.fingerprint import Fingerprint, FingerprintRecorder
from composer_lightning.heads.base import HINTED_REPLIES, TEACHER_SIGNALS
from composer_lightning.models.weights import iter_hf_weights
from composer_lightning.protocols.batch import RolloutBatch
from composer_lightning.rollout.ahead import GenerationAhead
from composer_lightning.rollout.checks import (
    check_engine_layout,
    check_hint_trust,
    check_hinted_replies,
    check_inputs,
    check_settings,
    follow_the_sampling_temperature,
    setting_changes,
)
from composer_lightning.rollout.dispatch import build_rollout
from composer_lightning.rollout.episodes import (
    Episode,
    EpisodeSettings,
    Generate,
    one_turn_episodes,
)
from composer_lightning.rollout.generation import (
    generate_in_group,
    heldout_seed,
    sampling_seed,
    tensor_parallel_group,
)
from composer_lightning.rollout.hint_check import HintCheck, HintTrust, hint_line
from composer_lightning.rollout.hinted import HintedReplies, HintedSampler
from composer_lightning.rollout.providers import share_trainer_state
from composer_lightning.rollout.validation import evaluate, validate_now
from composer_lightning.runtime.calls import check_timeout, check_workers
from composer_lightning.runtime.distributed import (
    StepMetrics,
    agree,
    own,
    per_rank,
    shared_seed,
    world,
)
from composer_lightning.runtime.inputs import check_episode_room, check_prompt_lengths
from composer_lightning.runtime.resume import Differences
from composer_lightning.runtime.rundir import append_rows
from composer_lightning.tasks.base import HintProvider, ScoreProvider
from composer_lightning.tasks.verifiers import VerifierScore
from composer_lightning.training.canary import check_fingerprint


def module_reads(pl_module: Any, signals: frozenset[str]) -> bool:
    """Whether the module's heads read `signals` (a hinted teacher, hinted replies) in the
    updates the next rollout batch trains (True for a module without heads): a head ramped to
    weight 0 asks for no hints."""
    objective = getattr(pl_module, "objective", None)
    if objective is None:
        return True
    step = getattr(pl_module, "global_step", None)
    return objective.reads(signals, step, getattr(pl_module, "updates_per_batch", 1))


class RolloutCallback(L.Callback):
    """Fresh rollouts from an inference engine every step, and the weight push after it.

    Args:
        engine: the inference engine (`VLLMEngine`, `HFEngine`, or any `RolloutEngine`),
            configured here and started in `setup`, once per rank, after the trainer's process
            group and device exist. Without a model path it follows the policy's directory.
        group_size: G, samples per prompt.
        sampling: temperature (must equal the module's); top_p, top_k, min_p, repetition_penalty
            and generation_kwargs shape the sampler, whose log-probs then weight the surrogate
            as a behaviour policy's (`model.importance_cap`, TRL's vLLM importance sampling
            correction), max_tokens, stop ids (the
            tokenizer's and the model's EOS ids are always added), seed (sampling seeds are a
            function of it, the step and the rank; None: drawn once by rank 0 and saved in
            checkpoints).
        score: score provider; default the task verifier.
        hint: hint provider; None gives no teacher (no OPD/SDPO signal). It is not called
            (nor any teacher run) while no head with a non-zero weight reads a teacher.
        hint_role: where the hint goes: "inline" (default), appended to the prompt's last
            message, or a "user" or "system" message after it (`chat.with_hint`). Inline, the
            hinted teacher answers the question as the student does; as a message of its own
            a chat model answers the message ("I'm sorry for any confusion, …"), and OPD and
            SDPO then teach that tone: told the answer as a user message, SmolLM2 fell from
            0.23 to 0 held-out under OPD x1, checked and capped, where inline it did not
            (docs/benchmarks/composition.md).
        samples_every_n_steps: every this many steps, `samples_per_step` of rank 0's samples
            (prompt, completion, reward, hint; the group's first hinted reply with
            `hinted_replies`) go to `rollouts.jsonl` in the run directory and to TensorBoard's
            TEXT tab; 0 turns this off.
        samples_per_step: samples written each time.
        val_samples: k, the sampled completions per held-out prompt for `val/pass@k`
            (validation also decodes greedily: `val/accuracy`).
        val_score: how validation scores completions; default `score`, the run's own.
        val_threshold: a held-out completion solves its prompt when its score is at least
            this (`val/accuracy`, `val/pass@k`); `val/reward_mean` is the mean score itself.
        max_staleness: k. 0: strictly on policy, generation and update take turns. k > 0: the
            engine runs in a child process (one per trainer rank) and generates up to k
            batches ahead with the weights it has (batch m with version m − k, exactly); the
            module weights the surrogate by truncated importance ratios (`importance_cap`).
        mask_truncated_completions: TRL's option: a completion that reaches
            `sampling.max_tokens` without a stop token stays in its group's reward statistics
            but contributes no token to any loss (counted in `rollout/masked_truncated`).
        engine_timeout: with k > 0, seconds to wait for a batch before the engine process is
            declared hung and the run stops; None waits as long as it lives.
        max_turns: assistant turns per episode at most (1: single-turn rollouts). A task's
            `environment` answers each turn (`envs/`); see `episodes.py` for the loop.
        max_episode_tokens: tokens per episode (prompt, turns and observations) at most; None:
            the engine's context only.
        env_timeout: seconds per environment call (reset, step) before its episode fails.
        env_workers: environment calls of different episodes in flight at once (threads; each
            episode has its own environment); 1: one after another.
        turn_score: a score provider of the turns that have a next state (e.g.
            `NextStateJudgeScore`, the PRM on `(a_t, s_{t+1})`): such a turn is rewarded by it
            as a sample of its own; None: every turn gets its episode's outcome.
        val_before_train: run the held-out evaluation once before the first step (verl's
            `val_before_train`), logged at step 0, so a run's before and after come from the
            run itself; a resumed run does not repeat it.
        truncation_penalty: subtracted from the outcome of a reply (an episode) that ran out of
            tokens (`max_tokens`, `max_episode_tokens` or the context), −p when it has none, so
            a policy drifting to cut replies is pushed back even where every outcome is 0
            (DAPO's overlong punishment, flat); 0: off.
        hinted_replies: sample a reply from the hinted context of the first `per_group`
            hinted turns of each group (`rollout/hinted.py`), for a head that imitates them
            (`context_distill`); None: off. Needs `hint` and `max_staleness` 0.
        hint_trust: where the teacher heads (OPD, top-k OPD, SDPO) read the hint.
            "knows_better" (default): each step, for each group with a hint, the policy's
            greedy reply from the hinted context (the teacher's) and from the student's own
            are scored, and the group keeps its teacher context only where the teacher's
            scores higher; elsewhere its samples are RL-only, so a hint that does not help
            leaves the run as RL alone (`rollout/hint_check.py`). Logged as `hint/...` and said
            in one line at step 0. "always": every hint is used (the check still runs and is
            logged). Needs `max_staleness` 0 unless "always".
        hint_placebo: give every hinted turn the hint of a different problem of the batch (a
            seeded shuffle between groups): the control that shows a hint's gain comes from
            what it says, not from the extra teacher signal.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        group_size: int = 4,
        sampling: SamplingConfig | None = None,
        score: ScoreProvider | None = None,
        hint: HintProvider | None = None,
        hint_role: Literal["user", "system", "inline"] = "inline",
        samples_every_n_steps: int = 10,
        samples_per_step: int = 4,
        val_samples: int = 4,
        val_score: ScoreProvider | None = None,
        val_threshold: float = 1.0,
        max_staleness: int = 0,
        mask_truncated_completions: bool = False,
        engine_timeout: float | None = 1800.0,
        max_turns: int = 1,
        max_episode_tokens: int | None = None,
        env_timeout: float | None = 30.0,
        env_workers: int = 32,
        turn_score: ScoreProvider | None = None,
        val_before_train: bool = False,
        truncation_penalty: float = 0.0,
        hinted_replies: HintedReplies | None = None,
        hint_trust: HintTrust = "knows_better",
        hint_placebo: bool = False,
    ):
        check_settings(
            group_size=group_size,
            sampling=sampling or SamplingConfig(),
            hint_role=hint_role,
            val_samples=val_samples,
            val_threshold=val_threshold,
            samples_every_n_steps=samples_every_n_steps,
            samples_per_step=samples_per_step,
            max_staleness=max_staleness,
            engine_timeout=engine_timeout,
            max_turns=max_turns,
            max_episode_tokens=max_episode_tokens,
        )
        self.engine, self.group_size = engine, group_size
        self.sampling = sampling or SamplingConfig()
        self.score = score if score is not None else VerifierScore()
        self.hint, self.hint_role, self.turn_score = hint, hint_role, turn_score
        self.val_samples, self.val_threshold = val_samples, float(val_threshold)
        self.val_score = val_score if val_score is not None else self.score
        self.samples_every_n_steps, self.samples_per_step = samples_every_n_steps, samples_per_step
        self.max_staleness, self.engine_timeout = max_staleness, engine_timeout
        self.mask_truncated_completions = bool(mask_truncated_completions)
        self.episodes = EpisodeSettings(
            max_turns,
            max_episode_tokens,
            check_timeout(env_timeout, "rollout.env_timeout"),
            env_workers=check_workers(env_workers, "rollout.env_workers"),
        )
        self._ahead = GenerationAhead(max_staleness, engine_timeout)
        self.val_before_train = bool(val_before_train)
        if isinstance(truncation_penalty, bool) or not truncation_penalty >= 0:
            raise ValueError(f"truncation_penalty must be >= 0, got {truncation_penalty!r}")
        self.truncation_penalty = float(truncation_penalty)
        if hinted_replies is not None and hint is None:
            raise ValueError(
                "rollout.hinted_replies samples replies from the hinted context, and "
                "rollout.hint is None: give the rollout a hint provider"
            )
        if hinted_replies is not None and max_staleness:
            raise ValueError(
                f"rollout.hinted_replies with max_staleness={max_staleness}: the hinted replies "
                "are sampled by the trainer's engine after the hints, and generation ahead "
                "runs the engine in a process of its own; use max_staleness 0"
            )
        self.hinted_replies = hinted_replies
        self.hint_trust, self.hint_placebo = hint_trust, bool(hint_placebo)
        self._first_hint_check: StepMetrics | None = None  # the step-0 line's figures
        self._fingerprints: dict[int, Fingerprint] = {}  # the trainer's, by version
        self._samples: list[dict[str, Any]] = []
        self._last_start: float | None = None
        self._push_time = 0.0
        self._tp_group: Any = None
        self._base_seed = self.sampling.seed
        self._stop_ids: tuple[Any, list[int]] | None = None  # (tokenizer, its stop texts' ids)

    # ------------------------------------------------------------------ start and sync
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check the configuration (`checks.py`), then start the engine on this rank (and form
        its group)."""
        follow_the_sampling_temperature(pl_module, self.sampling)
        check_hinted_replies(pl_module, self.hinted_replies)
        check_hint_trust(pl_module, self.hint_trust, self.hint, self.max_staleness)
        providers = {
            "rollout.score": self.score,
            "rollout.hint": self.hint,
            "rollout.val_score": self.val_score,
        }
        checked = check_inputs(
            trainer,
            pl_module,
            self.engine,
            self.sampling,
            providers,
            self.episodes.max_episode_tokens,
            self.episodes.max_turns,
        )
        self._context = checked.context
        self.episodes.context_length = None if self._context is None else self._context[0]
        # the engine sizes its context from the same need the checks sized it from
        context = EngineContext.current(
            model_path=getattr(pl_module, "policy_path", None),
            tokens_needed=checked.tokens_needed,
        )
        tp = self.engine.tensor_parallel_size
        check_engine_layout(context.world_size, tp, self.episodes.max_turns, self.max_staleness)
        if self._base_seed is None:  # drawn once, by rank 0: every rank samples from it
            self._base_seed = shared_seed()
        if self.max_staleness:
            weights = iter_hf_weights(cast(nn.Module, pl_module.policy))
            self._ahead.start(self.engine, context, weights, torch.get_num_threads())
            return
        self.engine.start(context)
        self._tp_group = tensor_parallel_group(context.world_size, context.rank, tp)

    @property
    def _seed(self) -> int:
        """The run's base seed: the sampling's, else drawn in `setup`."""
        assert self._base_seed is not None  # set in setup, before any generation
        return self._base_seed

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._push(pl_module)  # also re-syncs a resumed run from the restored weights
        if self.val_before_train and trainer.global_step == 0:
            validate_now(trainer)

    def _push(self, pl_module: L.LightningModule) -> float:
        """Push the policy's weights to the engine, fingerprinting them on the way."""
        start = time.perf_counter()
        weights: Iterable[tuple[str, Tensor]] = iter_hf_weights(cast(nn.Module, pl_module.policy))
        version = cast(int, pl_module.policy_version)
        if callable(getattr(self.engine, "weight_fingerprint", None)):
            weights = FingerprintRecorder.for_engine(weights, self.engine)
        if self._ahead.engine is not None:
            self._ahead.engine.publish(weights, version)
        else:
            self.engine.load_weights(weights, version=version)
        if isinstance(weights, FingerprintRecorder):
            self._fingerprints[version] = weights.finish()
            for old in [v for v in self._fingerprints if v < version - self.max_staleness - 1]:
                del self._fingerprints[old]
        return time.perf_counter() - start

    def _synced(self, pl_module: L.LightningModule) -> bool:
        if self._ahead.engine is not None:
            return self._ahead.engine.published == pl_module.policy_version
        return self.engine.weight_version == pl_module.policy_version

    # ------------------------------------------------------------------ overlap state
    def state_dict(self) -> dict[str, Any]:
        """The sampling seed, the group size and sampling settings (to say what a resume
        changes), and each rank's batches generated ahead and not yet trained on (waits for
        them) with the trainer's fingerprints of their versions. A collective: Lightning asks
        every rank and writes rank 0's."""
        state: dict[str, Any] = {
            "base_seed": self._base_seed,
            "group_size": self.group_size,
            "sampling": asdict(self.sampling),
        }
        pending = self._ahead.pending()
        if pending is None:
            return state
        versions = {entry[0] for entry in pending.values()}
        prints = {v: f for v, f in self._fingerprints.items() if v in versions}
        state["pending"] = per_rank({"batches": pending, "fingerprints": prints})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the seed and the batches generated ahead; a group size or sampling setting
        other than the checkpoint's is honoured (one line each), and batches generated ahead
        under the checkpoint's are generated again."""
        if self.sampling.seed is None and state_dict.get("base_seed") is not None:
            self._base_seed = int(state_dict["base_seed"])  # the run's drawn seed, kept
        pending = state_dict.get("pending", {})
        if isinstance(pending, list):  # one entry per rank
            mine = cast(dict[str, Any], own(pending))
            restored = mine["batches"]
            self._fingerprints.update(mine["fingerprints"])
        else:  # a checkpoint of one process, before per-rank entries
            restored = pending
        changed = setting_changes(state_dict, self.group_size, self.sampling)
        if changed and restored:
            changed.append(
                f"the {len(restored)} batches generated ahead under the checkpoint's "
                "settings are generated again"
            )
            restored = {}
        Differences(changed, []).report()
        self._ahead.restore(restored)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._ahead.close()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        """Stop the engine process; on a signal's stop (a checkpoint follows, whichever
        callback writes it) keep its pending batches for `state_dict` first."""
        self._ahead.close(keep_pending=isinstance(exception, SIGTERMException))
        self.teardown(trainer, pl_module, "fit")

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._push_time = self._push(pl_module)  # logged with the next step's metrics

    def _sampling(self, tokenizer: Any) -> SamplingConfig:
        """The sampling settings with the tokenizer's EOS and the tokens holding a `stop` text
        among the stop ids (engines add the model's own EOS ids), found once per tokenizer."""
        if self._stop_ids is None or self._stop_ids[0] is not tokenizer:
            self._stop_ids = (tokenizer, stop_text_ids(tokenizer, self.sampling.stop))
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        stops = sorted(set(self.sampling.stop_token_ids) | set(eos) | set(self._stop_ids[1]))
        return replace(self.sampling, stop_token_ids=stops, stop=[])

    # ------------------------------------------------------------------ held-out evaluation
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._synced(pl_module):  # `validate` on a checkpoint
            self._push(pl_module)

    def on_validation_batch_start(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Greedy and sampled completions of the held-out prompts: the batch's figures."""
        tokenizer = trainer.datamodule.tokenizer  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__
        sampling = self._sampling(tokenizer)
        engine = self._ahead.engine or self.engine
        tp, prompts = engine.tensor_parallel_size, len(batch["prompt_ids"])
        turns = self.episodes.max_turns  # each turn of an episode samples a range of its own
        seed = heldout_seed(self._seed, batch_idx, prompts, tp, self.val_samples, turns)

        def generate(prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list:
            return generate_in_group(engine, prompts, n, sampling, self._tp_group)

        episodes = None
        if self.episodes.max_turns > 1:
            dm = trainer.datamodule  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__

            def episodes(prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list:
                return self.episodes.run(generate, dm, batch["problems"], prompts, n, sampling)

        share_trainer_state([self.val_score], trainer)
        replies: list[dict[str, Any]] = []  # the greedy replies, for the run report
        batch["val"] = evaluate(
            generate,
            self.val_score,
            tokenizer,
            batch["prompt_ids"],
            batch["problems"],
            sampling,
            self.val_samples,
            seed,
            self.val_threshold,
            episodes,
            replies,
        )
        after = {"step": trainer.global_step}
        append_rows(trainer, "heldout.jsonl", [after | row for row in replies])

    # ------------------------------------------------------------------ generate
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        metrics, rollout, error = StepMetrics(), None, None
        if self._last_start is not None:  # the previous step, push included
            metrics.max("time/step", now - self._last_start)
            metrics.max("rollout/push_time", self._push_time)
        self._last_start = now
        try:
            rollout = self._rollout(trainer, pl_module, batch, metrics)
        except Exception as exc:  # every rank raises it in this step (not one rank alone)
            error = exc
        first, self._first_hint_check = self._first_hint_check, None
        # a rank that failed stops every rank, here; at step 0 the hint check's figures too
        reduced = agree(first, error=error)
        line = hint_line(reduced, self.hint_trust, self.hint_placebo) if first else None
        if line and trainer.is_global_zero:
            print(line, flush=True)
        every = self.samples_every_n_steps
        if every and trainer.global_step % every == 0:
            write_samples(trainer, trainer.global_step, self._samples)
        assert rollout is not None  # (else agree raised)
        rollout.metrics = metrics  # reduced and logged with the module's, once
        rollout = rollout.to(pl_module.device)
        self._ahead.behavior_logprobs(pl_module, rollout)
        batch["rollout"] = rollout
        trainer.datamodule.consumed = int(batch["index"]) + 1  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__

    def _rollout(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: dict[str, Any],
        metrics: StepMetrics,
    ) -> RolloutBatch:
        dm = trainer.datamodule  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__
        tokenizer = dm.tokenizer
        sampling = self._sampling(tokenizer)
        start = time.perf_counter()
        step = int(batch["index"])
        # a task's prompts: only the first batch was checked at setup
        where = [(f"{j} of rollout batch {step}", ids) for j, ids in enumerate(batch["prompt_ids"])]
        check_episode_room(where, self.episodes.max_episode_tokens)
        if self._context is not None:
            check_prompt_lengths(where, sampling.max_tokens, self._context)
        hinted = check = None
        if self._ahead.engine is not None and self.episodes.max_turns > 1:

            def batch_of(i: int) -> tuple[list[dict[str, Any]], list[list[int]]]:
                other = batch if i == step else dm.prompt_batch(i)
                return other["problems"], other["prompt_ids"]

            def run(
                generate: Generate,
                problems: list[dict[str, Any]],
                prompt_ids: list[list[int]],
                n: int,
                sampling: SamplingConfig,
            ) -> list[list[Episode]]:
                return self.episodes.run(generate, dm, problems, prompt_ids, n, sampling)

            version, episodes, gen_time, engine_print = self._ahead.episodes(
                batch_of,
                run,
                step,
                sampling,
                self._seed,
                self.group_size,
                self.episodes.max_turns,
            )
            metrics.max("rollout/wait_time", time.perf_counter() - start)
        elif self._ahead.engine is not None:
            version, outs, gen_time, engine_print = self._ahead.generate(
                lambda i: batch["prompt_ids"] if i == step else dm.prompt_batch(i)["prompt_ids"],
                step,
                sampling,
                self._seed,
                self.group_size,
            )
            metrics.max("rollout/wait_time", time.perf_counter() - start)
            episodes = one_turn_episodes(batch["problems"], batch["prompt_ids"], outs, tokenizer)
        else:
            rank, size = world()
            tp = self.engine.tensor_parallel_size
            turns = len(batch["prompt_ids"]) * tp * self.episodes.max_turns  # a seed range per turn
            seed = sampling_seed(self._seed, step, rank, size, tp, turns, self.group_size)

            def generate(prompts: list[list[int]], n: int, s: SamplingConfig) -> list:
                return generate_in_group(self.engine, prompts, n, s, self._tp_group)

            # a seed range of their own: as many seeds as the batch's (n = 1 per turn)
            hinted_seed = sampling_seed(
                self._seed + 2 * 10**9, step, rank, size, tp, turns, self.group_size
            )
            if self.hinted_replies is not None and module_reads(pl_module, HINTED_REPLIES):
                hinted = HintedSampler(
                    self.hinted_replies, generate, replace(sampling, seed=hinted_seed), tp > 1
                )
            if self.hint is not None and module_reads(pl_module, TEACHER_SIGNALS | HINTED_REPLIES):
                # greedy: the seed only names the call
                greedy = replace(sampling, seed=hinted_seed + 10**9)
                check = HintCheck(self.hint_trust, generate, greedy, tp > 1)
            episodes = self.episodes.run(
                generate,
                dm,
                batch["problems"],
                batch["prompt_ids"],
                self.group_size,
                replace(sampling, seed=seed),
            )
            gen_time = time.perf_counter() - start
            read = getattr(self.engine, "weight_fingerprint", None)
            engine_print = read() if callable(read) else None
            if hinted is None and check is None:  # else after the hinted replies, the check
                self.engine.sleep()  # frees the device for the update (CUDA sleep mode)
            version = self.engine.weight_version
            if version != pl_module.policy_version:
                raise RuntimeError(
                    f"engine weight version {version} != policy version "
                    f"{pl_module.policy_version}: the push did not happen"
                )
        compared = check_fingerprint(self._fingerprints.get(version), engine_print, version)
        metrics.max("rollout/fingerprint_params", compared)
        share_trainer_state([self.score, self.hint, self.turn_score], trainer)
        teacher = module_reads(pl_module, TEACHER_SIGNALS)
        rollout, built, self._samples = build_rollout(
            batch,
            episodes,
            tokenizer,
            sampling.max_tokens,
            self.score,
            self.hint if teacher or hinted is not None else None,
            self.hint_role,
            self.group_size,
            self.samples_per_step,
            self.mask_truncated_completions,
            self.turn_score,
            self.truncation_penalty,
            teacher=teacher,
            hinted=hinted,
            check=check,
            placebo_seed=self._seed + 3 * 10**9 + step if self.hint_placebo else None,
        )
        if hinted is not None or check is not None:
            self.engine.sleep()
        if check is not None and trainer.global_step == 0:
            self._first_hint_check = built  # reduced over ranks, said in one line
        rollout.policy_version = version
        rollout.engine_dtype = getattr(self.engine, "dtype", None)  # the canary's threshold
        rollout.sampler_shaped = sampling.shaped  # the engine's log-probs: a behaviour policy's
        metrics.include(built)
        tokens = built.local()["rollout/tokens"]
        metrics.max("rollout/gen_time", gen_time)
        metrics.sum("rollout/tokens_per_s", tokens / max(gen_time, 1e-9))
        return rollout
