"""Imported by train.py from the code directory: proves the bundle is on PYTHONPATH."""
GREETING = "helper from the code dir"
