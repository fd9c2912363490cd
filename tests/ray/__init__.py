"""Real Ray Train runs (``TorchTrainer``, gloo on CPU) on a local Ray cluster against real
daemons, one per simulated node."""
