"""`python -m flywheel_client`: the `flywheel` command line."""

import sys

from flywheel_client.cli import main

sys.exit(main())
