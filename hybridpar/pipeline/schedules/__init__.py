"""Schedules as data: GPipe, 1F1B, interleaved, ZB-H1, ZBV as plans of (stage, micro-batch)
tasks, lowered to each rank's actions and messages, simulated, and checked against NCCL's
rules (replay). Pure Python: imports nothing of hybridpar outside this room, and no torch."""
