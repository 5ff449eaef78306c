"""`python -m onn.export.omny`: the command line in cli.py."""

import sys

from onn.export.omny.cli import main

sys.exit(main())
