"""The command line: one module per ``lowband`` subcommand, each its argparse and ``main``."""
