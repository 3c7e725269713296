"""`python -m jfa COMMAND`: the workbench's command line (`jfa.workbench.cli`)."""
import sys

from jfa.workbench.cli import main

if __name__ == "__main__":
    sys.exit(main())
