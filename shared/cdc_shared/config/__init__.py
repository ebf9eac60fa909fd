"""The pipeline's configuration: the file and the environment, and the tables it selects."""
