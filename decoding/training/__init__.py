"""Offline training and fitting of what the runtime policies load: the self-distillation data, the feature
drafter (`train-drafter`), the Medusa heads and their tree (`train-medusa`) and HeadSplit's profile
(`profile-headsplit`). Only the CLI's commands import these modules; nothing `serve` or a worker imports
reaches them (tests/test_layout.py)."""
