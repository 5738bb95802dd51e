"""The experiments' pure policy: no ORM, no I/O; frozen dataclasses in and out."""
