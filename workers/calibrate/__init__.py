"""Calibration harness: measures this node's matmul throughput, collective times and a grid of
short real runs of the built-in GPT, and writes trainyard/calibration.py's measurement document.

    python -m workers.calibrate --out FILE [--quick]

torch only (no Django): it runs on a node, like the runtime. The fit of the cost model's
constants to the document is the control plane's (trainyard/plan/calibration.py).
"""
