"""Utilities for checkpoints of old Cerebras releases: spec repair and dataloader-state upgrade."""
