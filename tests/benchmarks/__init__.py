"""Tests of the benchmark and reproduction scripts\x27 own logic, against hand computations."""
