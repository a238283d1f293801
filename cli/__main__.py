"""`python -m kvbridge.cli ...` runs the `kvbridge` command (scripts and tests start servers this way)."""

import sys

from kvbridge.cli import main

sys.exit(main())
