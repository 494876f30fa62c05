"""The visibility-latency benchmark (``python -m bench.latency``): see ``__main__``."""
