"""Weir: an inference control plane."""
