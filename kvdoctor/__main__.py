"""`python -m kvdoctor`: the same command line as the `kvdoctor` script."""

from kvdoctor.console import main

main()
