"""pytest collects test_suite.py here: the other test_*.py files are
scripts that start their own ranks, which test_suite.py runs one rank
count per item (python3 -m pytest python/tests)."""
import glob
import os

_here = os.path.dirname(os.path.abspath(__file__))
collect_ignore = [os.path.basename(p) for p in glob.glob(os.path.join(_here, "*.py"))
                  if os.path.basename(p) not in ("test_suite.py", "conftest.py")]
