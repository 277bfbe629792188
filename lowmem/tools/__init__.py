"""The `lowmem` command (cli, commands/, options, argtypes) and the tools it runs: diagnostics,
maxbatch, export, predict, plot."""
