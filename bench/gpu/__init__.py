"""GPU checks run by bench/gpu_checks.py (see its docstring)."""
