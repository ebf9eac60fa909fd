"""The ingestor: Kafka CDC topics -> bronze Delta tables, exactly-once, with quarantine."""
