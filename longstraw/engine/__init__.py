"""Capture a prompt once, replay branches on its state, and get the GRPO gradient in three modes."""
