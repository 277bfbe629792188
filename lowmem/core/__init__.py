"""The method's engine: a network (network) through the op table (optable) and the walk
(schedule) to a memory plan (plan) and one training step (engine: forward and backward sweep)."""
