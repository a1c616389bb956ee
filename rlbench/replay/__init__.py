"""The run directory: writing committed steps atomically, reading them back validated."""
