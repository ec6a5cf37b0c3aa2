"""``python -m poolkeeper``: the ``poolkeeper`` command (see :mod:`poolkeeper.cli`)."""
import sys

from poolkeeper.cli import main

sys.exit(main())
