"""Evaluation: needle/passkey cases from offline data, scoring, benchmarks."""
