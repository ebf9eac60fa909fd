"""Where the JVM artifacts live: the local cache filled from deploy/jvm/pom.xml.

Versions here must match deploy/jvm/pom.xml and pyproject.toml.
"""

from __future__ import annotations

import os
from pathlib import Path

SPARK_VERSION = "4.2.0"
DELTA_VERSION = "4.4.0"
SCALA_BINARY = "2.13"
KAFKA_VERSION = "4.4.0"
ELASTICSEARCH_VERSION = "9.2.4"
APICURIO_VERSION = "3.3.3"
S3PROXY_VERSION = "4.1.0"
# Kafka Connect and its plugins (deploy/jvm/connect). Connect stays on 4.3.0: 4.4.0
# breaks Debezium 3.6.1. Apicurio's converter is the 2.x line (3.x is not on Maven Central).
CONNECT_VERSION = "4.3.0"
DEBEZIUM_VERSION = "3.6.1.Final"
APICURIO_CONVERTER_VERSION = "2.6.13.Final"

JVM_CACHE_ENV_VAR = "CDC_JVM_CACHE"

#: Maven coordinates for ``spark.jars.packages``: the fallback when the cache is empty
#: and the machine can reach Maven Central at run time.
SPARK_PACKAGES = [
    f"io.delta:delta-spark_{SPARK_VERSION.rsplit('.', 1)[0]}_{SCALA_BINARY}:{DELTA_VERSION}",
    f"org.apache.spark:spark-sql-kafka-0-10_{SCALA_BINARY}:{SPARK_VERSION}",
    f"org.apache.spark:spark-avro_{SCALA_BINARY}:{SPARK_VERSION}",
]


def project_root() -> Path | None:
    """The source checkout this package runs from, if it is one (editable install)."""
    candidate = Path(__file__).resolve().parents[3]
    return candidate if (candidate / "deploy" / "jvm" / "pom.xml").is_file() else None


def jvm_cache_dir() -> Path:
    """``$CDC_JVM_CACHE``, else ``<checkout>/.cache/jvm``, else ``~/.cache/cdc-delta/jvm``."""
    configured = os.environ.get(JVM_CACHE_ENV_VAR)
    if configured:
        return Path(configured)
    root = project_root()
    if root is not None:
        return root / ".cache" / "jvm"
    return Path.home() / ".cache" / "cdc-delta" / "jvm"


def spark_jars() -> list[Path]:
    """The jars every SparkSession loads; empty if unfetched.

    Delta, the Kafka connector, Avro, and hadoop-aws with the AWS SDK modules S3A needs.
    """
    folder = jvm_cache_dir() / "spark"
    return sorted(folder.glob("*.jar")) if folder.is_dir() else []


def class_archive() -> Path:
    """The drivers' JVM class archive (``cdc_shared.jvm.class_archive``; may not exist yet)."""
    return jvm_cache_dir() / "cds" / "spark-driver.jsa"


def kafka_classpath() -> list[Path]:
    """The Kafka broker's runtime classpath; empty if unfetched."""
    folder = jvm_cache_dir() / "kafka" / "libs"
    return sorted(folder.glob("*.jar")) if folder.is_dir() else []


def registry_home() -> Path:
    """The unpacked Apicurio Registry (a Quarkus fast-jar; may not exist yet)."""
    return jvm_cache_dir() / "registry" / f"apicurio-registry-{APICURIO_VERSION}"


def elasticsearch_home() -> Path:
    """The unpacked Elasticsearch distribution (may not exist yet)."""
    return jvm_cache_dir() / "elasticsearch" / f"elasticsearch-{ELASTICSEARCH_VERSION}"


def s3proxy_jar() -> Path:
    """S3Proxy's runnable jar, the dev kit's S3-compatible server (may not exist yet)."""
    return jvm_cache_dir() / "s3proxy" / f"s3proxy-{S3PROXY_VERSION}.jar"
