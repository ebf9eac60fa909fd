"""publisher-kafka: silver Change Data Feed -> Avro change topics, exactly-once."""
