"""The process around the data path: the CLI, launching and serving a mount, its control socket and mount(2) calls."""
