"""Eval."""
