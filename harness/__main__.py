"""``python -m harness {train,sweep,lab,claims,list,explain,bench,prepare,docs,soak} ...``: harness/apps/cli.py."""

import sys

from harness.run.errors import one_line_for_a_broken_module

with one_line_for_a_broken_module():
    from harness.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
