"""What the services, the CLI and the devkit agree on: tables, their columns and places, headers."""
