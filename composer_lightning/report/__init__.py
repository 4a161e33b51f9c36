"""The run report: one self-contained HTML page of a run — curves, rollouts, each head's
per-token push on the reply's tokens, held-out replies step by step, served turns.

Owns: what the report reads from a run directory (`read.py`, the run's own files only), its
curves (`figures.py`), the page (`page.py`, with `static/report.js` and `static/report.css`),
serving it while the run goes on (`serve.py`), the command line
(`python -m composer_lightning report RUN_DIR`, `cli.py`), and the callbacks of a fit: each
head's per-token values on a few replies per step, written only when asked (`tokens.py`,
`TokenDetails`), and the page written at the end of every fit (`callback.py`, `RunReport`).
May import: `functional`, `runtime`, `protocols`, `heads`, `callbacks` (the rooms below it);
the objective is observed through `ComposerModule.objective.observers`, not imported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RunReport", "TokenDetails", "write_report"]


def __getattr__(name: str) -> Any:  # lazy: `report RUN_DIR` must not import Lightning
    if name == "RunReport":
        from composer_lightning.report.callback import RunReport

        return RunReport
    if name == "TokenDetails":
        from composer_lightning.report.tokens import TokenDetails

        return TokenDetails
    if name == "write_report":
        from composer_lightning.report.page import write_report

        return write_report
    raise AttributeError(name)
