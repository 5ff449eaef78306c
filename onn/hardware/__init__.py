"""Measure the machine, plan settings for it, and tune them."""
