"""Experiment tracking: the run's metric log and its MLflow writer."""
