"""The `lowmem` subcommands, one module each, named for the subcommand: `lowmem plan` is plan.py.

Every module has `HELP` (its line in `lowmem --help`), `add_arguments(parser)` and
`run(args) -> exit status`; lowmem/tools/cli.py registers them and dispatches. The
library code they call lives beside this folder (lowmem/tools/maxbatch.py, gradient_error.py,
peak_memory.py, predict.py, plot.py) and below it (train/, core/, bits/, formats/).
"""
