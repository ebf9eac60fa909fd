"""``cdc``: the operator command line of the CDC pipeline."""
