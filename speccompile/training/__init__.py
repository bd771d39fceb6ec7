"""Drafter-head training (self-distillation on the CPU): `speccompile train-draft`."""
