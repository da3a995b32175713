"""What several test files share (the tiny model's settings, hand-made batches, a stopped run, fake results): test
files import from here or get fixtures from tests/conftest.py, never from one another."""
