"""Run by tests/test_config_files.py in a subprocess: for each config on the command line, what
`fit --config <config> --print_config` prints (what a run saves as its `config.yaml`), and
what that printed form prints when given back. A config written `base.yaml,overlay.yaml` is
given as `--config base.yaml --config overlay.yaml`, the overlay read last. One process for
every config: the imports (≈ 7 s) are paid once, not twice per config. Writes one JSON object
to the path in argv[1]: {config: {"status", "out", "err", "again_status", "again_out",
"again_err"}}."""

import contextlib
import io
import json
import os
import sys
import tempfile

from composer_lightning.cli import main


def print_config(config: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = [arg for path in config.split(",") for arg in ("--config", path)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(["fit", *args, "--print_config"])
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
            if not isinstance(exc.code, int | None):
                print(exc.code, file=err)
    return int(status or 0), out.getvalue(), err.getvalue()


out_path, configs = sys.argv[1], sys.argv[2:]
del sys.argv[1:]  # the CLI's arguments are given to it; jsonargparse warns when both are set
results = {}
for config in configs:
    status, out, err = print_config(config)
    entry = {"status": status, "out": out, "err": err[-3000:]}
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "config.yaml")
        with open(saved, "w") as f:
            f.write(out)
        again_status, again_out, again_err = print_config(saved)
    entry.update(again_status=again_status, again_out=again_out, again_err=again_err[-3000:])
    results[config] = entry
with open(out_path, "w") as f:
    json.dump(results, f)
