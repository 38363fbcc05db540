"""Trainer glue, one module per trainer: `compile_accel.integrations.<trainer>`."""
