"""loomrl.commands: the body of each ``loomrl`` subcommand; :mod:`loomrl.cli` parses arguments and dispatches."""
