"""How far apart two weight versions are when restarts fork the run: the version tree.

A run's weight version counts its optimizer steps. A resume from a checkpoint at version f
goes on from f, so after a crash at version 13 and a resume from 10 the numbers 11–13 name
two sets of weights: the lost ones, which served turns still in the store, and the resumed
run's. Each start of the run is therefore a *launch* (a row of the store's `launches` table:
its parent launch, the one whose checkpoint it resumed, and the version it started from), and
a turn is stamped with the launch and version that served it. Two (launch, version) pairs
are nodes of a tree rooted at the base weights (version 0); their distance is the number of
optimizer steps on the path between them, through the last version they share (the fork):

    distance((a, V), (b, v)) = (V − fork) + (v − fork)

It is V − v when v is on the current weights' own history (the same launch, or an ancestor
launch at or before the version its child resumed from), and larger than 0 for a turn the lost
weights served, however its version compares with V: such a turn is never taken for on policy.
Different runs share only the base (fork 0). Launch 0 is a turn recorded before launches were
(a store of an older release): its distance is the version difference alone.
"""

from __future__ import annotations

from collections.abc import Mapping

#: launch id -> (parent launch id or None, the version it started from)
Launches = Mapping[int, tuple[int | None, int]]


def path(launches: Launches, launch: int, version: int) -> list[tuple[int, int]]:
    """The history of (launch, version) from the root: `(launch id, its last version on the
    way)` for each launch, oldest first. An launch not in `launches` is a root."""
    steps, seen = [(launch, version)], {launch}
    while True:
        parent, start = launches.get(launch, (None, 0))
        if parent is None:
            return steps[::-1]
        if parent in seen:
            raise ValueError(f"launches form a cycle through launch {parent}")
        seen.add(parent)
        steps.append((parent, start))
        launch = parent


def distance(launches: Launches, current: tuple[int, int], turn: tuple[int, int]) -> int:
    """Optimizer steps between the weights `current` = (launch, version) and those that served
    `turn` = (launch, version), through the tree of launches (module docstring)."""
    if turn[0] == 0 or current[0] == 0:
        return abs(current[1] - turn[1])
    fork = 0
    for (a, va), (b, vb) in zip(path(launches, *current), path(launches, *turn), strict=False):
        if a != b:
            break
        fork = min(va, vb)
        if va != vb:
            break
    return (current[1] - fork) + (turn[1] - fork)
