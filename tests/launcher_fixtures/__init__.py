"""Helper programs the launcher tests start under real torchrun."""
