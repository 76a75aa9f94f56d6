"""Runtimes execute a Schedule over stage modules: they consume schedules, never build them."""
