"""The FUSE adapter: kernel requests to the read path, and store failures to errno."""
