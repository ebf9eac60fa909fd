"""The real local Elasticsearch: index, refresh, search, external versions."""

from __future__ import annotations

import uuid

import pytest
from cdc_shared.clients.connect import make_elasticsearch
from cdc_shared.config.connections import ElasticsearchConfig
from elasticsearch import ConflictError

pytestmark = pytest.mark.integration


def test_index_and_search(es_config: ElasticsearchConfig) -> None:
    es = make_elasticsearch(es_config)
    index = f"pytest-{uuid.uuid4().hex[:8]}"
    try:
        es.indices.create(index=index, settings={"number_of_replicas": 0})
        es.index(index=index, id="1", document={"name": "Ada", "city": "London"})
        es.index(index=index, id="2", document={"name": "Grace", "city": "Arlington"})
        es.indices.refresh(index=index)
        hits = es.search(index=index, query={"match": {"city": "london"}})["hits"]["hits"]
        assert [h["_id"] for h in hits] == ["1"]
        assert es.cluster.health()["status"] in ("green", "yellow")
    finally:
        es.indices.delete(index=index, ignore_unavailable=True)


def test_external_version_rejects_older_write(es_config: ElasticsearchConfig) -> None:
    es = make_elasticsearch(es_config)
    index = f"pytest-{uuid.uuid4().hex[:8]}"
    try:
        es.index(index=index, id="k", document={"v": 2}, version=2, version_type="external")
        with pytest.raises(ConflictError):
            es.index(index=index, id="k", document={"v": 1}, version=1, version_type="external")
        assert es.get(index=index, id="k")["_source"] == {"v": 2}
    finally:
        es.indices.delete(index=index, ignore_unavailable=True)
