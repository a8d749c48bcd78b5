__version__ = "0.1.0"  # the same as pyproject.toml's (tests/project/test_layout.py)
