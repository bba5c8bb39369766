"""`python -m autofuse ...`: the command line, as `autofuse ...`."""

from .cli import main

main(prog_name="autofuse")
