"""Structured output: the per-request grammar seam (grammar.py), grammars, and bitmask filling."""
