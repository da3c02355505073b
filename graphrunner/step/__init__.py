"""One step of the runner: its buffers, plan, body, graphs and output."""
