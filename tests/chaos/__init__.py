"""A randomized fault harness: see run.py and README (Chaos runs)."""
