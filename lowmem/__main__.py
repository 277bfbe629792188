"""`python -m lowmem ...`: the same command line as the `lowmem` script (lowmem/tools/cli.py)."""
import sys

from .tools.cli import main

sys.exit(main())
