"""The `lowmem` command (cli, commands/, options, argtypes) and what only it runs: gradient_error
(the gradient error against SGD noise), peak_memory (a step's measured peak), maxbatch, predict
(and rebuilding a run's network from its checkpoint), plot (over timeline, runcurves)."""
