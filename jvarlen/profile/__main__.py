"""``python -m jvarlen.profile``: see :mod:`jvarlen.profile.cli`."""

from jvarlen.profile.cli import main

if __name__ == "__main__":
    print(main())
