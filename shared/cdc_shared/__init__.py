"""The library every CDC service imports: configuration, Spark, Avro, tables, clients."""

__version__ = "0.1.0"
