"""The work of each `rolefleet` subcommand, a module per kind of work so that a command imports what it
needs and no more: `cli.py` parses the arguments and imports the one module its command names (its
COMMANDS table), so `rolefleet --help` and an argument error load none of them."""
