"""`python -m composer_lightning fit --config configs/<name>.yaml` | `serve` | `heads` | `export` |
`from-trl`."""

import sys

from composer_lightning.cli import main

if __name__ == "__main__":
    sys.exit(main())
