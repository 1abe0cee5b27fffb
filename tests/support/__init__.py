"""Helpers shared by the tests: runs, games, servers and processes they start."""
