"""Does the hint help? Each step, the hinted teacher is checked against the student on the
batch's own problems, and its signal is used only where it knows better.

A teacher head (OPD, top-k OPD, SDPO) is only as good as the policy told the hint: on a model
of SmolLM2's size a hint that does not carry the answer moves the hinted teacher toward "talking
about a mistake" more than toward the answer, and OPD's gap on the student's own tokens then
averages −KL(student ‖ teacher) < 0 on every reply (docs/benchmarks.md, "A real model"). Composed
at weight 1, such a signal collapsed SmolLM2 where RL alone learnt. So by default
(`rollout.hint_trust: knows_better`) the teacher is trusted only where it measurably knows
better: for each group with a hint, the policy decodes one greedy reply from the hinted context
(the teacher's) and one from the student's own context (the student's), both are scored by the
score provider, and the group's samples keep their teacher context only when the teacher's
reply scores higher (for a right/wrong verifier: the teacher is right, the student is not).
Elsewhere the samples are RL-only (`has_teacher` false), so a hint that does not help leaves the
run as Dr. GRPO alone would be. A turn whose reply has no score of its own (a tool call) cannot
be checked and is not trusted. `hint_trust: always` is the unchecked behaviour.

The same check, logged every step (`hint/teacher_accuracy`, `hint/student_accuracy`,
`hint/knows_better`, `hint/gated_fraction`), says at step 0 in one line whether the hint helps
on this task, before an hour is spent.

Within a trusted group, `rollout.teacher_replies: below_teacher` (the default) gives the
teacher the replies that scored below the hinted teacher's own greedy reply (the check's score,
`teacher_bars`): in a group with right and wrong replies, the wrong ones, which Dr. GRPO's
advantage already pushes down and the teacher then tells where to go; in a group whose replies
are all wrong (as most are early on, where RL has no signal), every reply, when the teacher is
right. There the teacher is the only signal, and the module's `teacher_alone` sets how hard it
pulls. `below_mean` gives the teacher only the replies below their group's mean reward, so no
teacher where all replies score the same (`below_mean_rows`); `all` gives it every reply,
right ones too, which on SmolLM2 lengthened the replies and stalled the reward
(docs/benchmarks/composition.md). A turn with a next state (a tool call, rewarded with its
episode's outcome) keeps its hint: the outcome does not judge it, and the teacher is its only
per-turn signal.

The placebo (`rollout.hint_placebo`) gives each hinted turn the hint of a different problem of
the same batch: the control that shows a gain comes from what the hint says, not from the extra
teacher signal (`placebo_hints`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Any, Literal, cast

from composer_lightning.chat.hints import HINT_TEMPLATE, fill_hint
from composer_lightning.engines.base import Completion, SamplingConfig
from composer_lightning.rollout.hinted import HintedTurn, episode_turn, first_per_group
from composer_lightning.rollout.providers import (
    provider_components,
    provider_logs,
    provider_values,
)
from composer_lightning.runtime.calls import hint_candidates
from composer_lightning.runtime.distributed import StepMetrics
from composer_lightning.tasks.base import ScoreProvider

#: `rollout.hint_trust`: where a teacher head reads the hint.
HintTrust = Literal["knows_better", "always"]
HINT_TRUST: tuple[str, ...] = ("knows_better", "always")
#: `rollout.teacher_replies`: which replies of a trusted group the teacher heads act on.
TeacherReplies = Literal["below_mean", "below_teacher", "all"]
TEACHER_REPLIES: tuple[str, ...] = ("below_mean", "below_teacher", "all")


def below_mean_rows(
    row_hints: list[Any],
    rewards: list[float | None],
    groups: list[int],
    judged: list[bool] | None = None,
    bars: dict[int, float] | None = None,
) -> tuple[list[Any], StepMetrics]:
    """The rows' teacher hints kept only on the replies that scored below their group's mean
    reward (a negative Dr. GRPO advantage, `r < mean`); the others lose theirs and stay RL
    samples. With `bars` (`teacher_replies: below_teacher`), a group in it keeps them on the
    replies that scored below its bar instead: the hinted teacher's own reply's score
    (`teacher_bars`), so in a group whose replies are all wrong and whose teacher is right,
    every reply keeps its teacher.

    The mean is over the group's judged rows (`judged`: the reward is the score of the row's
    own reply: a single-turn reply, an episode's last turn, a turn with a score of its own),
    the entries of Dr. GRPO's group baseline. A row that is not judged (a turn with a next
    state, rewarded with its episode's outcome: the teacher is its only per-turn signal) or has
    no reward keeps its hint.

    Returns:
        The kept hints, and `hint/teacher_fraction`: the share of hinted rows that keep one.
    """
    judged = [True] * len(rewards) if judged is None else judged
    totals: dict[int, list[float]] = {}
    for r, g, j in zip(rewards, groups, judged, strict=True):
        if r is not None and j:
            totals.setdefault(g, []).append(r)
    mean = {g: sum(v) / len(v) for g, v in totals.items()}
    mean.update({g: b for g, b in (bars or {}).items() if g in mean})

    def below(r: float | None, g: int, j: bool) -> bool:
        if r is None or not j or g not in mean:
            return True
        return r < mean[g] - 1e-9 * max(1.0, abs(mean[g]))

    kept = [
        h if h is not None and below(r, g, j) else None
        for h, r, g, j in zip(row_hints, rewards, groups, judged, strict=True)
    ]
    hinted = sum(h is not None for h in row_hints)
    metrics = StepMetrics()
    metrics.mean(
        "hint/teacher_fraction",
        sum(h is not None for h in kept) / max(hinted, 1),
        weight=float(hinted),
    )
    return kept, metrics


def teacher_bars(check: HintCheck | None) -> dict[int, float]:
    """Each checked group's bar for `teacher_replies: below_teacher`: the score of the hinted
    teacher's own greedy reply (`HintCheck.teacher_replies`), where it has one."""
    if check is None:
        return {}
    return {
        g: float(r["teacher_reward"])
        for g, r in check.teacher_replies.items()
        if r.get("teacher_reward") is not None
    }


def placebo_hints(hints: list[Any], groups: list[int], seed: int) -> list[Any]:
    """Each turn's hint replaced by the hint of another group (another problem of the batch).

    The groups that have a hint are put in a seeded random order and each takes the hints of
    the next one (a cycle, so no group keeps its own); a group's k-th hinted turn takes the
    donor's k-th hint (cycling through the donor's). Turns without a hint keep None; with
    fewer than two hinted groups no other problem exists and every hint is dropped.

    Args:
        hints: one entry per turn: a hint, a list of candidate hints, or None.
        groups: each turn's group id.
        seed: the shuffle's seed (the rollout's, per step).
    """
    by_group: dict[int, list[Any]] = {}
    for hint, g in zip(hints, groups, strict=True):
        if hint_candidates(hint):
            by_group.setdefault(g, []).append(hint)
    order = list(by_group)
    if len(order) < 2:
        return [None] * len(hints)
    random.Random(seed).shuffle(order)
    donor = {g: order[(i + 1) % len(order)] for i, g in enumerate(order)}
    taken: dict[int, int] = {}
    out: list[Any] = []
    for hint, g in zip(hints, groups, strict=True):
        if not hint_candidates(hint):
            out.append(None)
            continue
        given = by_group[donor[g]]
        k = taken.get(g, 0)
        taken[g] = k + 1
        out.append(given[k % len(given)])
    return out


@dataclass
class HintCheck:
    """How one rollout batch checks its hints: the trust rule, the rollout's `generate` and
    its sampling settings with this batch's seed for the check.

    Attributes:
        trust: "knows_better": teacher contexts only in the groups where the hinted teacher's
            greedy reply scores higher than the student's; "always": every hint is used (the
            check still runs and is logged).
        generate: the rollout's `(prompts, n, sampling) -> completions`.
        sampling: the rollout's sampling settings (max_tokens, stops); decoding is greedy.
        collective: call `generate` even without prompts (a tensor-parallel engine's ranks
            generate together).
    """

    trust: HintTrust
    generate: Callable[[list[list[int]], int, SamplingConfig], list[list[Completion]]]
    sampling: SamplingConfig
    collective: bool = False
    #: each checked group's hint, the hinted teacher's greedy reply to it and its score (the
    #: sample rows show them)
    teacher_replies: dict[int, dict[str, Any]] = field(default_factory=dict)

    def trusted_groups(
        self,
        tokenizer: Any,
        turns: list[tuple[Any, int]],
        groups: list[int],
        hints: list[Any],
        hint_role: str,
        score: ScoreProvider,
    ) -> tuple[set[int] | None, StepMetrics]:
        """The groups whose hints the teacher heads may read (None: all of them), and the
        step's `hint/...` metrics.

        Args:
            turns: the batch's turns, `(episode, t)`; groups: each turn's group id; hints:
                each turn's hint (or candidates, or None).
        """
        hinted = [
            (group, episode, t, first[0])
            for (episode, t), group, first in zip(
                turns, groups, map(hint_candidates, hints), strict=True
            )
            if first
        ]
        checked = [
            episode_turn(tokenizer, *turn, hint_role)
            for turn in first_per_group(hinted, 1, group=itemgetter(0))
        ]
        start = time.perf_counter()
        teacher, student = self._scores(tokenizer, checked, score)
        pairs = [
            (c.group, t, s)
            for c, t, s in zip(checked, teacher, student, strict=True)
            if t is not None and s is not None
        ]
        better = {g for g, t, s in pairs if t > s}
        rows = [g for g, *_ in hinted]  # one entry per hinted turn
        trusted = better if self.trust == "knows_better" else None
        gated = sum(g not in better for g in rows) if trusted is not None else 0
        metrics = StepMetrics()
        n = float(len(pairs))
        metrics.sum("hint/checked", n)
        metrics.sum("hint/unchecked", float(len(checked)) - n)
        metrics.sum("hint/knows_better", float(len(better)))
        metrics.sum("hint/knows_worse", float(sum(t < s for _, t, s in pairs)))
        metrics.mean("hint/teacher_accuracy", sum(t for _, t, _ in pairs) / max(n, 1.0), weight=n)
        metrics.mean("hint/student_accuracy", sum(s for *_, s in pairs) / max(n, 1.0), weight=n)
        metrics.mean("hint/gated_fraction", gated / max(len(rows), 1), weight=float(len(rows)))
        metrics.max("hint/check_time", time.perf_counter() - start)
        return trusted, metrics

    def _scores(
        self, tokenizer: Any, checked: list[HintedTurn], score: ScoreProvider
    ) -> tuple[list[float | None], list[float | None]]:
        """The scores of each checked turn's greedy reply from the hinted context and from
        the student's own (None: unscored, a turn with a next state, or a failed call)."""
        greedy = replace(self.sampling, temperature=0.0)
        prompts = [c.teacher_prompt for c in checked] + [c.student_ids for c in checked]
        outs = self.generate(prompts, 1, greedy) if prompts or self.collective else []
        replies = [group[0] for group in outs]
        scored = [k for k in range(len(prompts)) if checked[k % len(checked)].problem is not None]
        texts = [
            reply.text
            if reply.text is not None
            else tokenizer.decode(reply.token_ids, skip_special_tokens=True)
            for reply in (replies[k] for k in scored)
        ]
        values, _ = (
            provider_values(
                score,
                "score",
                [cast(dict[str, Any], checked[k % len(checked)].problem) for k in scored],
                texts,
                [list(replies[k].token_ids) for k in scored],
            )
            if scored
            else ([], 0)
        )
        # what the provider keeps of its last call is the student batch's: drop these
        provider_components(score)
        provider_logs(score)
        by_prompt: dict[int, float | None] = dict(zip(scored, values, strict=True))
        n = len(checked)
        for k, (c, reply) in enumerate(zip(checked, replies, strict=False)):  # the teacher's
            said = reply.text or tokenizer.decode(reply.token_ids, skip_special_tokens=True)
            self.teacher_replies[c.group] = {
                "teacher_hint": c.hint,
                "teacher_reply": said,
                "teacher_reward": by_prompt.get(k),
            }
        return [by_prompt.get(k) for k in range(n)], [by_prompt.get(n + k) for k in range(n)]


def checked_hints(
    check: HintCheck | None,
    placebo_seed: int | None,
    tokenizer: Any,
    turns: list[tuple[Any, int]],
    groups: list[int],
    hints: list[Any],
    hint_role: str,
    score: ScoreProvider,
    teacher: bool,
    template: str = HINT_TEMPLATE,
) -> tuple[list[Any], list[Any], StepMetrics]:
    """A batch's hints as the dispatch uses them: each put in `template` (`chat.fill_hint`);
    with `placebo_seed` each another problem's (`placebo_hints`); the rows' teacher hints (none
    without `teacher`, a head that reads one), only in the groups `check` trusts.

    Returns:
        The hints (what the hinted replies and the sample rows use), the rows' teacher hints,
        and the check's `hint/...` metrics.
    """
    hints = [fill_hint(template, h) for h in hints]
    if placebo_seed is not None:
        hints = placebo_hints(hints, groups, placebo_seed)
    rows = hints if teacher else [None] * len(hints)  # else they only seed hinted replies
    if check is None:
        return hints, rows, StepMetrics()
    trusted, metrics = check.trusted_groups(tokenizer, turns, groups, hints, hint_role, score)
    if trusted is not None:  # no teacher where it does not know better
        rows = [h if g in trusted else None for h, g in zip(rows, groups, strict=True)]
    return hints, rows, metrics


def hint_line(
    reduced: dict[str, float], trust: str, placebo: bool, replies: str = "all"
) -> str | None:
    """The step-0 line that says whether the hint helps the teacher on this task, from the
    check's metrics reduced over ranks (`replies`: `rollout.teacher_replies`); None when
    nothing was checked."""
    checked = int(reduced.get("hint/checked", 0))
    unchecked = int(reduced.get("hint/unchecked", 0))
    what = "hints of other problems (placebo)" if placebo else "the hint"
    helps, does_not = ("help", "do NOT help") if placebo else ("helps", "does NOT help")
    if not checked:
        if not unchecked:
            return None
        return (
            f"hint check: {unchecked} hinted turn(s) have no score of their own (tool calls), so "
            f"whether {what} {helps} cannot be checked; "
            + (
                "their teacher signal is off (rollout.hint_trust: always uses it unchecked)"
                if trust == "knows_better"
                else "rollout.hint_trust: always uses it unchecked"
            )
        )
    teacher, student = reduced["hint/teacher_accuracy"], reduced["hint/student_accuracy"]
    better = int(reduced.get("hint/knows_better", 0))
    worse = int(reduced.get("hint/knows_worse", 0))
    verdict = helps if better > worse else does_not
    line = (
        f"hint check, first batch: told {what}, the policy's greedy reply scores "
        f"{teacher:.3f} on {checked} problems with a hint, {student:.3f} without it (better on "
        f"{better}, worse on {worse}): {what} {verdict} the teacher on this task; "
    )
    which, every = "", ""
    if replies == "below_mean":
        which = ", on the replies below their group's mean reward"
        every = "; rollout.teacher_replies: all, on every reply"
    elif replies == "below_teacher":
        which = ", on the replies that score below the hinted teacher's own"
        every = "; rollout.teacher_replies: all, on every reply"
    if trust == "knows_better":
        return line + (
            f"teacher signals act on the {better} problem(s) where the hinted teacher knows "
            f"better{which} (rollout.hint_trust: always uses every hint{every})"
        )
    return line + f"every hint is used{which} (rollout.hint_trust: always{every})"
