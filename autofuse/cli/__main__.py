"""`python -m autofuse.cli ...`: how the tuning coordinator starts its worker processes."""

from . import main

main()
