"""The pure floor (issue [19]; tests/unit/test_layers.py): values and checks with no I/O that import no other
project package: numbers.py (the one number check), limits.py (request limits of the gateway and the
validator), latency.py (TTFT / ITL of a completion record), curves.py (ThroughputCurve)."""
