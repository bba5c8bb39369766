"""Offline tuning: search spaces, the trial objective, search policies and the per-key driver."""
