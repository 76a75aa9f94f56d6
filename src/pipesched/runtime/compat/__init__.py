"""Shims over torch: the oldest torch supported, and the private APIs used, each with a fallback."""
