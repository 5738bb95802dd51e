"""Trainyard training runtime: runs under torchrun, one process per device.

It must not import django, jobs or controlplane: it talks to the control plane only through
its launch config (config.json) and the job's Redis Stream, both through the SDK
(trainyard.sdk), which it reports, checkpoints and stops with.
"""
