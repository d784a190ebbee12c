"""Test and benchmark support shared by tests/ and bench/ (see testkit/builders.py)."""
