"""``python -m sbus.analytics``: the command line in ``sbus.analytics.cli``."""
import sys

from sbus.analytics.cli import main

sys.exit(main())
