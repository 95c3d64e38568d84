"""Prefect flows: `grpo_train` (train.py) and the CLI commands that run, resume and serve it (cli.py)."""
