"""The training run: the loop (trainer), its settings (config), its data (pipeline), its
checkpoint (trainstate, checkpoint), its folder (rundir, steplog), stopping (stop), SGD (optim)."""
