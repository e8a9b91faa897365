"""One module per subcommand; the typer app in kvdoctor.cli only parses and dispatches."""
