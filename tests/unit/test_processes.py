"""The service processes (``cdc_devkit.processes``): what they run, their memory."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from cdc_cli.application import select_services
from cdc_devkit.local_run import SERVICE_PORT_RANGE, service_ports
from cdc_devkit.processes import (
    SERVICES,
    ProcessSample,
    RunMode,
    ServiceProcess,
    group_rss_bytes,
    launch,
    owns_its_memory,
    process_snapshot,
)

MIB = 2**20


def sample(
    pid: int, parent: int, virtual_pages: int, rss_mib: int, executable: str = ""
) -> ProcessSample:
    return ProcessSample(pid, parent, 100, virtual_pages, rss_mib * MIB, 0, executable)


def test_a_spawned_child_still_in_its_parents_memory_is_counted_once() -> None:
    jvm = sample(101, 100, 900_000, 1_200)
    spawning = sample(102, 101, 900_000, 1_200)  # posix_spawn: same address space
    chmod = sample(103, 101, 1_500, 1)  # after exec: its own
    snapshot = {p.pid: p for p in (jvm, spawning, chmod)}

    assert [owns_its_memory(p, snapshot) for p in (jvm, spawning, chmod)] == [True, False, True]
    assert group_rss_bytes(100, snapshot) == 1_201 * MIB


def test_a_spawned_child_read_while_its_parent_grew_is_still_counted_once() -> None:
    # /proc is read one process after another: the JVM mapped memory in between.
    jvm = sample(101, 100, 901_500, 1_200)
    spawning = sample(102, 101, 900_000, 1_200)
    snapshot = {p.pid: p for p in (jvm, spawning)}

    assert not owns_its_memory(spawning, snapshot)
    assert group_rss_bytes(100, snapshot) == 1_200 * MIB


def test_a_jvm_as_large_as_its_python_driver_is_counted() -> None:
    # A driver with many Kafka clients maps as much as its JVM: sizes alone would take
    # the JVM for a child not yet exec'd, and drop it.
    driver = sample(100, 1, 1_900_000, 300, "/usr/bin/python3.11")
    jvm = sample(101, 100, 1_910_000, 2_400, "/usr/lib/jvm/java-17/bin/java")
    spawning = sample(102, 101, 1_910_000, 2_400, "/usr/lib/jvm/java-17/bin/java")
    snapshot = {p.pid: p for p in (driver, jvm, spawning)}

    assert [owns_its_memory(p, snapshot) for p in (driver, jvm, spawning)] == [True, True, False]
    assert group_rss_bytes(100, snapshot) == 2_700 * MIB


def test_the_current_process_group_is_measured() -> None:
    snapshot = process_snapshot()
    me = snapshot[os.getpid()]

    assert me.resident_bytes > 0
    assert group_rss_bytes(me.group, snapshot) >= me.resident_bytes


def test_a_run_of_some_services_launches_only_those() -> None:
    chosen = (SERVICES[0], SERVICES[2])
    (application,) = launch(RunMode.APPLICATION, Path("p.yaml"), Path("logs"), chosen)
    services = launch(RunMode.SERVICES, Path("p.yaml"), Path("logs"), chosen)

    arguments = application.command[application.command.index("--config") + 2 :]
    assert arguments == ["--service", chosen[0], "--service", chosen[1]]
    assert select_services(arguments[1::2]) == list(chosen)  # names `cdc run` takes
    assert [s.name for s in services] == list(chosen)
    assert "--service" not in launch(RunMode.APPLICATION, Path("p.yaml"), Path("l"))[0].command


def test_a_port_another_program_took_is_not_a_healthy_service(tmp_path: Path) -> None:
    """A service's port taken while it was down (by a JVM's Py4J gateway, which answers
    an HTTP request with a line of its own) reads as not healthy; the wait goes on."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def answer() -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(1024)
                connection.sendall(b"!zspy4j.Py4JException: Unknown command received\n")

        answering = threading.Thread(target=answer, daemon=True)
        answering.start()
        service = ServiceProcess("merger", tmp_path / "pipeline.yaml", tmp_path / "merger.log")
        assert service.healthy(server.getsockname()[1]) is False
        answering.join(5)


def test_service_ports_are_free_distinct_and_outside_the_ephemeral_range() -> None:
    """Ports the kernel never hands to a process binding port 0: a run keeps its ports
    while its services restart."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = service_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        assert port in SERVICE_PORT_RANGE and not low <= port <= high
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # free once chosen
