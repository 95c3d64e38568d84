"""Prefect tasks: one per stage of a GRPO step (see stages.py); MLflow tracking (tracking.py)."""
