"""The `klotski` command: `parser.py` turns flags into one RunConfig, `main.py` runs a
subcommand and turns user errors into one line and an exit status, `commands.py` has one
thin handler per subcommand."""
