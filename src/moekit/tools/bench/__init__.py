"""Timing harness shared by benchmarks/ and `moekit bench`."""
