"""``python -m slurmrun``: the ``slurmrun`` command (`slurmrun.cli.main`)."""

import sys

from slurmrun.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
