"""``python -m jaxscale``: the command line."""

import sys

from jaxscale.cli import main

sys.exit(main())
