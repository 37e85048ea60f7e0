"""Training integration: forward step, arguments, config building and the CPU/GPU train loop."""
