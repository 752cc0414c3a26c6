"""Where the tests' neighbours are: the test folder's shared helpers (this folder, on ``sys.path``
through ``tests/python/conftest.py``), the repository root and its ``benchmarks/``."""

import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(SUPPORT)
ROOT = os.path.dirname(os.path.dirname(TESTS))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
