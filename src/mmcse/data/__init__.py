"""Data: the demo scene world, real datasets (sources, safe downloads), SentEval readers."""
