"""`python -m composer_lightning report RUN_DIR [--serve]`: the run report from a run's files."""

from __future__ import annotations

import argparse
import glob
import os

DESCRIPTION = """Write the run report of RUN_DIR: one self-contained HTML file (curves, rollouts
with each head's per-token push, held-out replies step by step, served turns) that opens from
disk with no network. RUN_DIR is a run's directory (runs/tiny_cpu/version_0), or the folder of
its versions (runs/tiny_cpu: the newest is taken). With --serve, the report is served on
127.0.0.1 and refreshes as steps land."""


def resolve_run_dir(path: str) -> str:
    """`path`, or the newest `version_*` in it when `path` holds versions and no run files.

    Raises:
        FileNotFoundError: `path` is not a directory.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"run directory {path!r} does not exist (or is not a directory)")
    runs = ("rollouts.jsonl", "config.yaml", "metrics.csv", "hparams.yaml")
    if any(os.path.exists(os.path.join(path, n)) for n in runs) or glob.glob(
        os.path.join(path, "events.out.tfevents.*")
    ):
        return path
    versions = [v for v in glob.glob(os.path.join(path, "version_*")) if os.path.isdir(v)]
    if not versions:
        return path
    return max(versions, key=lambda v: (os.path.getmtime(v), v))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m composer_lightning report", description=DESCRIPTION
    )
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--out", help="the HTML file to write (default RUN_DIR/report.html)")
    parser.add_argument(
        "--max-rows", type=int, default=400, help="rollout rows shown at most, sampled by step"
    )
    parser.add_argument(
        "--token-rows", type=int, default=200, help="rows of per-token details shown at most"
    )
    parser.add_argument(
        "--heldout-problems",
        type=int,
        default=16,
        help="held-out problems shown at every evaluation",
    )
    parser.add_argument(
        "--plain-js",
        action="store_true",
        help="embed plotly.js uncompressed (≈ 5 MB) for browsers without DecompressionStream",
    )
    parser.add_argument(
        "--serve", action="store_true", help="serve the report on 127.0.0.1 while the run goes on"
    )
    parser.add_argument("--port", type=int, default=0, help="--serve's port (0: a free one)")
    parser.add_argument(
        "--refresh",
        type=float,
        default=5.0,
        help="--serve: seconds between the page's checks for new steps",
    )
    args = parser.parse_args(argv)
    limits = {
        "max_rows": args.max_rows,
        "max_token_rows": args.token_rows,
        "heldout_problems": args.heldout_problems,
    }
    try:
        run_dir = resolve_run_dir(args.run_dir)
        if args.serve:
            from composer_lightning.report.serve import ReportServer

            server = ReportServer(
                run_dir, args.port, args.refresh, plain_js=args.plain_js, **limits
            )
            server.page()  # a bad run directory or option is said now, not at the first request
            print(
                f"composer_lightning: report of {run_dir} at {server.url} (Ctrl-C stops)",
                flush=True,
            )
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                pass
            finally:
                server.close()
            return 0
        from composer_lightning.report.page import write_report

        path = write_report(run_dir, args.out, plain_js=args.plain_js, **limits)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise SystemExit(f"composer_lightning: report: {exc}") from None
    print(f"composer_lightning: run report in {path}")
    return 0
