"""`python -m lowmem ...`: the same command line as the `lowmem` script (lowmem/cli.py)."""
import sys

from .cli import main

sys.exit(main())
