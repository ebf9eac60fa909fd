"""publisher-es: silver Change Data Feed -> one Elasticsearch index per entity."""
