"""deploy/kafka-acls/kafka-acls.sh grants exactly the rows of the ACL table in code.

The secured-Kafka tests and ``cdc infra up --secure`` grant ``acl_table``
(cdc_devkit.secured_kafka); operators run the script. The script's commands (its dry run)
must add the same (principal, resource, name, pattern, operation) rows, no more, no less,
so that what the tests prove holds for the ACLs a deployment gets.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from cdc_devkit.secured_kafka import acl_table

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "kafka-acls" / "kafka-acls.sh"
RESOURCES = {"--topic": "topic", "--group": "group", "--transactional-id": "transactional-id"}

Row = tuple[str, str, str, str, str]  # principal, resource, name, pattern, operation


def _script_rows() -> set[Row]:
    env = {
        "PATH": os.environ["PATH"],
        "DRY_RUN": "1",
        "BOOTSTRAP": "broker:9093",
        "COMMAND_CONFIG": "admin.properties",
        "SOURCE_TOPIC_PREFIX": "src.",
        "CHANGE_TOPIC_PREFIX": "chg.",
    }
    out = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, check=True
    ).stdout
    rows: set[Row] = set()
    for line in out.splitlines():
        words = shlex.split(line)
        principal = words[words.index("--allow-principal") + 1].removeprefix("User:")
        flag = next(w for w in words if w in RESOURCES)
        name = words[words.index(flag) + 1]
        pattern = "prefixed" if "prefixed" in words else "literal"
        operations = [words[i + 1] for i, w in enumerate(words) if w == "--operation"]
        rows |= {(principal, RESOURCES[flag], name, pattern, op.lower()) for op in operations}
    return rows


def _table_rows() -> set[Row]:
    rows: set[Row] = set()
    for grant in acl_table(
        source_prefix="src.", change_prefix="chg.", progress_topic="_cdc_publisher_progress"
    ):
        resource = grant.resource.name.lower().replace("_", "-")
        pattern = grant.pattern.name.lower()
        for operation in grant.operations:
            op = operation.name.lower().replace("_", "")
            rows.add((grant.user, resource, grant.name, pattern, op))
    return rows


def test_the_script_grants_the_table_of_the_tests() -> None:
    script = _script_rows()
    assert ("cdc-operator", "topic", "_cdc_publisher_progress", "literal", "describe") in script
    assert script == _table_rows()
