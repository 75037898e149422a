"""``python -m jvarlen.profile``: see :mod:`jvarlen.profile.cli`."""

import sys

from jvarlen.profile.cli import cli

if __name__ == "__main__":
    sys.exit(cli())
