"""Native CPU kernels, compiled from C on first use (see cpu.py)."""
