"""The `scalegp` command line (installed as the package `scalegp.cli`)."""
