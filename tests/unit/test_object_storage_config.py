"""``object_storage``: S3A settings for an ``s3a://`` root, its secrets, and its checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from cdc_shared.config.connections import S3A_STATIC_CREDENTIALS, s3a_bucket
from cdc_shared.config.pipeline import PipelineConfig, load_config
from cdc_shared.config.services import SparkConfig
from cdc_shared.config.values import ConfigError, redact
from cdc_shared.jvm.spark import spark_conf

SECRET = "s3-secret-value-7f3a"
ACCESS = "AKIA-TEST-ACCESS"

PIPELINE = """
storage_root: s3a://lake-bucket/cdc/prod/
object_storage:
  endpoint: http://minio.internal:9000
  path_style_access: true
  region: eu-west-1
  access_key: "${env:TEST_S3_ACCESS_KEY}"
  secret_key: "${file:%(secret_file)s}"
spark: {master: "local[2]", conf: {spark.sql.shuffle.partitions: "3"}}
"""


@pytest.fixture
def s3_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    secret_file = tmp_path / "s3.secret"
    secret_file.write_text(SECRET + "\n")
    monkeypatch.setenv("TEST_S3_ACCESS_KEY", ACCESS)
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE % {"secret_file": secret_file})
    return path


def _error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    return str(raised.value)


def test_secrets_resolved_and_mapped_to_the_roots_bucket_only(s3_file: Path) -> None:
    config = load_config(s3_file)
    assert config.storage_root == "s3a://lake-bucket/cdc/prod"
    assert config.object_storage.secret_key is not None
    assert config.object_storage.secret_key.get_secret_value() == SECRET
    prefix = "fs.s3a.bucket.lake-bucket."
    assert config.spark.hadoop_options() == {
        f"{prefix}endpoint": "http://minio.internal:9000",
        f"{prefix}connection.ssl.enabled": "false",
        f"{prefix}path.style.access": "true",
        f"{prefix}endpoint.region": "eu-west-1",
        f"{prefix}aws.credentials.provider": S3A_STATIC_CREDENTIALS,
        f"{prefix}access.key": ACCESS,
        f"{prefix}secret.key": SECRET,
    }


def test_spark_conf_carries_the_settings_and_the_users_conf_wins(s3_file: Path) -> None:
    config = load_config(s3_file)
    conf = spark_conf(config.spark, "test")
    assert conf["spark.hadoop.fs.s3a.bucket.lake-bucket.secret.key"] == SECRET
    assert conf["spark.hadoop.fs.s3a.bucket.lake-bucket.path.style.access"] == "true"
    assert conf["spark.sql.shuffle.partitions"] == "3"
    overridden = config.spark.model_copy(
        update={"conf": {"spark.hadoop.fs.s3a.bucket.lake-bucket.endpoint.region": "x-1"}}
    )
    assert overridden.hadoop_options() == config.spark.hadoop_options()  # kept by copies
    assert spark_conf(overridden, "t")[
        "spark.hadoop.fs.s3a.bucket.lake-bucket.endpoint.region"
    ] == ("x-1")


def test_secrets_never_in_reprs_or_redacted_options(s3_file: Path) -> None:
    config = load_config(s3_file)
    for text in (repr(config), str(config), repr(config.spark), repr(config.object_storage)):
        assert SECRET not in text
        assert ACCESS not in text
    shown = redact(spark_conf(config.spark, "test"))
    assert SECRET not in str(shown) and ACCESS not in str(shown)
    assert shown["spark.hadoop.fs.s3a.bucket.lake-bucket.path.style.access"] == "true"


def test_https_endpoint_keeps_tls_and_no_keys_means_the_default_chain() -> None:
    config = PipelineConfig(
        storage_root="s3a://bucket-1/x", object_storage={"endpoint": "https://s3.example.com"}
    )
    assert config.spark.hadoop_options() == {
        "fs.s3a.bucket.bucket-1.endpoint": "https://s3.example.com",
        "fs.s3a.bucket.bucket-1.connection.ssl.enabled": "true",
        "fs.s3a.bucket.bucket-1.path.style.access": "false",
    }


def test_local_and_other_roots_get_no_s3a_settings(tmp_path: Path) -> None:
    assert PipelineConfig(storage_root=str(tmp_path)).spark.hadoop_options() == {}
    assert PipelineConfig(storage_root="abfss://c@acct.dfs.core.windows.net/x").s3a_options == {}
    assert s3a_bucket("s3a://b-1/p/q") == "b-1"
    assert s3a_bucket("/data") is None
    assert SparkConfig().hadoop_options() == {}


@pytest.mark.parametrize(
    ("root", "message"),
    [
        ("s3a:///prefix", "an s3a root is s3a://<bucket>[/<prefix>]"),
        ("s3a://Bad_Bucket/x", "an s3a root is s3a://<bucket>[/<prefix>]"),
        ("s3://bucket/x", "use s3a://"),
    ],
)
def test_bad_roots_fail_at_start(tmp_path: Path, root: str, message: str) -> None:
    error = _error(tmp_path, f"storage_root: {root}\n")
    assert "storage_root:" in error and message in error


def test_half_a_key_pair_and_bad_endpoints_fail_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_S3_SECRET", SECRET)
    error = _error(
        tmp_path,
        'storage_root: s3a://bucket/x\nobject_storage: {secret_key: "${env:TEST_S3_SECRET}"}\n',
    )
    assert "object_storage: set both access_key and secret_key, or neither" in error
    assert SECRET not in error
    error = _error(tmp_path, "object_storage: {endpoint: minio:9000}\n")
    assert "object_storage.endpoint: must be http(s)://host[:port]" in error


def test_missing_secret_reference_is_named_not_shown(tmp_path: Path) -> None:
    error = _error(
        tmp_path,
        "storage_root: s3a://bucket/x\n"
        'object_storage: {access_key: a, secret_key: "${env:TEST_S3_UNSET_SECRET}"}\n',
    )
    assert "object_storage.secret_key" in error
    assert "TEST_S3_UNSET_SECRET" in error and "is not set" in error


def test_env_overrides_reach_the_mapping(s3_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CDC_OBJECT_STORAGE__REGION", "us-east-2")
    config = load_config(s3_file)
    assert config.spark.hadoop_options()["fs.s3a.bucket.lake-bucket.endpoint.region"] == (
        "us-east-2"
    )


def test_the_local_production_example_is_cluster_s3_and_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """deploy/local/pipeline-cluster-s3.yaml, the README's production walk-through."""
    monkeypatch.setenv("CDC_S3_ACCESS_KEY", "cdc-local")
    monkeypatch.setenv("CDC_S3_SECRET_KEY", "cdc-local-secret")
    root = Path(__file__).resolve().parents[2]
    config = load_config(root / "deploy" / "local" / "pipeline-cluster-s3.yaml")
    conf = spark_conf(config.spark, "cdc-merger")
    assert config.storage_root == "s3a://cdc/inventory"
    assert conf["spark.master"] == "spark://127.0.0.1:7077"
    assert conf["spark.cores.max"] == "1"
    assert conf["spark.hadoop.fs.s3a.bucket.cdc.secret.key"] == "cdc-local-secret"
    assert config.schema_registry.url is not None
    assert "cdc-local-secret" not in repr(config)
