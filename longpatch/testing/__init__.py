"""Offline stand-ins for tests and demos: tiny random-weight models of each family."""
