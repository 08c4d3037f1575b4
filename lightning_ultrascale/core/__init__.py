"""The strategy core: the Trainer and Fabric strategies, the composition of plugins, checkpoints, the
non-finite guard and the collectives watchdog."""
