"""`python -m scalegp`: the command line (`scalegp.cli`)."""

from scalegp.cli.app import main

main()
