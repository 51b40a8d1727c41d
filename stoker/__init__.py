"""The `stoker` command: one front for the mount, the demo, the benchmark and (later) CSI/operator."""
