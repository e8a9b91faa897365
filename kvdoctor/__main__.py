"""`python -m kvdoctor`: the same command line as the `kvdoctor` script."""

from kvdoctor.cli import main

main()
