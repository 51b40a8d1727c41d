"""The read path: namespace, reads, fetch scheduling, prefetch and admission, assembled into a mount's data path."""
