"""`python -m composer_lightning fit --config configs/<name>.yaml` | `serve` | `heads` | `export` |
`from-trl`."""

import gc
import sys

from composer_lightning.cli import main

if __name__ == "__main__":
    code = main()
    # the run's objects (a trainer and its module refer to each other) and the collectives'
    # work they hold are freed while the interpreter fully runs: left to its finalization, gloo's
    # worker threads can abort the process ("terminate called without an active exception")
    gc.collect()
    sys.exit(code)
