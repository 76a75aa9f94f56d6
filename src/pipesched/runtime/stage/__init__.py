"""What runs inside a stage: recomputation, randomness, deferred BatchNorm, micro-batches."""
