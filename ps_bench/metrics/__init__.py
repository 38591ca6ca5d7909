"""Timers, statistics, byte accounting, tables and results files."""
