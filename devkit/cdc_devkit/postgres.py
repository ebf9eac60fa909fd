"""A real PostgreSQL source: the captured tables, a SQL workload, and reading the truth back.

The demo (``cdc demo --source postgres``) and the Debezium end-to-end test run the same
tables through Debezium: ``customers`` (one-column key; a numeric, a date, timestamps with
and without a time zone; a large ``notes`` text, stored out of line (TOASTed) under the
default REPLICA IDENTITY, so every update that leaves it alone arrives with Debezium's
unavailable-value placeholder; a column added midway by ``ALTER TABLE``) and ``orders`` (a
two-column key; truncated midway). :class:`SqlWorkload` writes, from a seed, the SQL a
busy application would run: a snapshot's worth of rows before capture starts, then
inserts, updates, deletes, a primary-key change, re-inserts of deleted keys, the new
column, a ``TRUNCATE``, and a last marker row that says the workload is over.

Statements run through ``psql`` (the client of the ``postgresql-15`` package) over TCP;
the password goes in ``PGPASSWORD``, never on a command line or in a log. What the tables
hold at the end is read back typed as silver holds it (:meth:`Database.rows`), so every
output of the pipeline can be compared with the database itself.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from cdc_devkit import infra

ColumnKind = Literal["int", "long", "text", "bool", "decimal", "date", "timestamp", "timestamptz"]
Key = tuple[Any, ...]
Rows = dict[Key, dict[str, Any]]


@dataclass(frozen=True)
class Column:
    """A table column: its SQL type, and the kind that says how Debezium and silver see it."""

    name: str
    sql_type: str
    kind: ColumnKind
    nullable: bool = True
    precision: int = 0  # decimals
    scale: int = 0


@dataclass(frozen=True)
class Table:
    """A captured table; ``added`` are columns ``ALTER TABLE ... ADD COLUMN`` adds midway."""

    name: str
    key: tuple[str, ...]
    columns: tuple[Column, ...]
    added: tuple[Column, ...] = ()

    @property
    def all_columns(self) -> tuple[Column, ...]:
        """Every column, the added ones last (as they end up in the table)."""
        return (*self.columns, *self.added)

    def create_sql(self) -> str:
        """``CREATE TABLE`` of the table as it starts (without the added columns)."""
        columns = [
            f"{c.name} {c.sql_type}{'' if c.nullable else ' NOT NULL'}" for c in self.columns
        ]
        return (
            f"CREATE TABLE {self.name} ({', '.join(columns)}, PRIMARY KEY ({', '.join(self.key)}))"
        )


CUSTOMERS = Table(
    "customers",
    ("id",),
    (
        Column("id", "integer", "int", nullable=False),
        Column("name", "text", "text", nullable=False),
        Column("email", "text", "text"),
        Column("vip", "boolean", "bool", nullable=False),
        Column("balance", "numeric(12,2)", "decimal", precision=12, scale=2),
        Column("birth_date", "date", "date"),
        Column("created_at", "timestamp(3)", "timestamp", nullable=False),
        Column("updated_at", "timestamptz(3)", "timestamptz"),
        Column("notes", "text", "text"),
    ),
    added=(Column("tier", "text", "text"),),
)
#: Random hex of ``n`` times 32 characters, computed by the server: large (out of line once
#: over ~2 KB compressed) yet a short statement. Created by the workload's schema step.
FILLER_FUNCTION = (
    "CREATE FUNCTION cdc_filler(n integer) RETURNS text LANGUAGE sql VOLATILE AS "
    "$$ SELECT string_agg(md5(random()::text), '') FROM generate_series(1, n) $$;"
)
#: 400 x 32 = 12,800 random hex characters: PostgreSQL compresses them to ~6.4 KB, still
#: above its TOAST threshold, so the value is stored out of line.
LARGE_NOTES = 400


@dataclass(frozen=True)
class SqlExpression:
    """A value the server computes (written into the statement as it is)."""

    sql: str


ORDERS = Table(
    "orders",
    ("order_id", "line_no"),
    (
        Column("order_id", "bigint", "long", nullable=False),
        Column("line_no", "integer", "int", nullable=False),
        Column("customer_id", "integer", "int", nullable=False),
        Column("product", "text", "text"),
        Column("quantity", "integer", "int", nullable=False),
        Column("amount", "numeric(10,2)", "decimal", nullable=False, precision=10, scale=2),
        Column("placed_at", "timestamp(3)", "timestamp"),
    ),
)
#: The captured tables, in the order the workload creates them.
TABLES = (CUSTOMERS, ORDERS)
#: One row lands here when the workload is over: once a connector's topic for it has
#: that row, every change before it is in Kafka (PostgreSQL's WAL is one order).
MARKER = Table(
    "cdc_marker",
    ("id",),
    (Column("id", "integer", "int", nullable=False), Column("note", "text", "text")),
)


def connection_env(password: str) -> dict[str, str]:
    """The environment a ``psql`` child needs: the password and a UTC session."""
    return {**os.environ, "PGPASSWORD": password, "PGTZ": "UTC", "PGCONNECT_TIMEOUT": "10"}


@dataclass(frozen=True)
class Database:
    """One PostgreSQL database reached over TCP with ``psql``."""

    host: str
    port: int
    user: str
    password: str = field(repr=False)
    dbname: str = "postgres"
    bin_dir: Path = Path("/usr/lib/postgresql/15/bin")

    def on(self, dbname: str) -> Database:
        """The same server, another database."""
        return replace(self, dbname=dbname)

    def _psql(self, *args: str, sql: str) -> str:
        done = subprocess.run(
            [
                str(self.bin_dir / "psql"),
                "--no-psqlrc",
                "--quiet",
                "--set=ON_ERROR_STOP=1",
                f"--host={self.host}",
                f"--port={self.port}",
                f"--username={self.user}",
                f"--dbname={self.dbname}",
                *args,
            ],
            input=sql,
            capture_output=True,
            text=True,
            env=connection_env(self.password),
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"psql on {self.dbname} failed: {done.stderr.strip()}")
        return done.stdout

    def execute(self, sql: str) -> None:
        """Run SQL (one or more statements, each in its own transaction unless grouped)."""
        self._psql(sql=sql)

    def query(self, sql: str) -> list[str]:
        """The rows of a query, one line each, unaligned (one column: its text)."""
        out = self._psql("--tuples-only", "--no-align", sql=sql)
        return [line for line in out.splitlines() if line]

    def create_database(self, name: str) -> Database:
        """A new, empty database on this server."""
        self.execute(f'CREATE DATABASE "{name}"')
        return self.on(name)

    def drop_slots(self, name: str) -> None:
        """Drop the idle replication slots of database ``name``.

        The server keeps WAL for every slot until it is consumed or dropped.
        """
        self.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            f"WHERE database = '{name}' AND NOT active"
        )

    def drop_database(self, name: str) -> None:
        """Drop a database with its replication slots."""
        self.drop_slots(name)
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def active_slots(self) -> set[str]:
        """Replication slots of this database a client streams from right now."""
        return set(
            self.query(
                "SELECT slot_name FROM pg_replication_slots "
                f"WHERE database = '{self.dbname}' AND active"
            )
        )

    def rows(self, table: Table) -> Rows:
        """What ``table`` holds, by key, typed as silver holds it (see :func:`typed`)."""
        return _typed_rows(table, self.query(f"SELECT row_to_json(t) FROM {table.name} t"))

    def execute_watching(self, step: Step, table: Table) -> list[Rows]:
        """Run ``step`` as :meth:`execute` does; what ``table`` held after each statement.

        Each of the step's statements is followed, in the same session and transaction (a
        transaction sees its own changes), by a ``SELECT`` of the whole table: so the
        database itself says every state a row went through, also between two statements
        of one transaction (Debezium sends each statement's changes as events of their own).
        The step's changes are the same as without the ``SELECT`` s: they write nothing.
        """
        select = f"SELECT row_to_json(t) FROM {table.name} t;\nSELECT '{_END_OF_STATE}';"
        watched = [f"{statement}\n{select}" for statement in step.each_statement]
        sql = "\n".join(watched)
        if step.statements:
            sql = f"BEGIN;\n{sql}\nCOMMIT;"
        lines = self.query(sql)
        states: list[list[str]] = [[]]
        for line in lines:
            if line == _END_OF_STATE:
                states.append([])
            else:
                states[-1].append(line)
        if states.pop() or len(states) != len(watched):
            raise RuntimeError(
                f"expected {len(watched)} states of {table.name}, read {lines!r:.200}"
            )
        return [_typed_rows(table, state) for state in states]


#: Ends each state of a table :meth:`Database.execute_watching` reads (no row's JSON).
_END_OF_STATE = "-- end of state --"


def _typed_rows(table: Table, lines: list[str]) -> Rows:
    """Rows of ``table`` from ``row_to_json`` lines, by key, typed (see :func:`typed`)."""
    columns = {c.name: c for c in table.all_columns}
    rows: Rows = {}
    for line in lines:
        raw = json.loads(line, parse_float=Decimal)
        row = {name: typed(columns[name], value) for name, value in raw.items()}
        rows[tuple(row[k] for k in table.key)] = row
    return rows


def local_server(settings: infra.InfraSettings) -> Database:
    """The superuser's way into the PostgreSQL that ``cdc infra up --with-postgres`` runs."""
    return Database(
        "127.0.0.1",
        settings.postgres_port,
        infra.POSTGRES_SUPERUSER,
        infra.postgres_password(settings),
        bin_dir=settings.postgres_bin,
    )


def typed(column: Column, value: Any) -> Any:
    """A value of ``row_to_json`` as Python: numerics exact, times as dates and datetimes.

    ``timestamp`` (no zone) is naive: Debezium reads it as UTC, and so does the comparison.
    """
    if value is None:
        return None
    if column.kind == "decimal":
        return Decimal(str(value)).quantize(Decimal(1).scaleb(-column.scale))
    if column.kind == "date":
        return dt.date.fromisoformat(value)
    if column.kind in ("timestamp", "timestamptz"):
        return dt.datetime.fromisoformat(value)
    return value


# --- the versions a table went through -------------------------------------------------


@dataclass
class RowVersion:
    """One version of a row: its values while they held, and what ended it.

    ``ended``: ``"change"`` (a statement changed a value: the next version begins at the
    same event), ``"delete"`` (a ``DELETE``, a ``TRUNCATE`` or the key moved away), or
    None while the row still holds these values.
    """

    row: dict[str, Any]
    ended: Literal["change", "delete"] | None = None


@dataclass
class TableVersions:
    """Every version each key of ``table`` went through, from the table's states in order.

    :meth:`observe` takes what the table holds after each statement that ran (e.g. from
    :meth:`Database.execute_watching`): a key that appears opens a version, a row whose
    values changed closes its version and opens one, a key that disappears closes its
    version; a statement that changed none of a row's values (an ``UPDATE`` setting what
    was there) makes none. Every column of the table counts (a column added later is null
    in the states before it).
    """

    table: Table
    versions: dict[Key, list[RowVersion]] = field(default_factory=dict)
    _current: Rows = field(default_factory=dict, repr=False)

    def observe(self, state: Rows) -> None:
        """The table's next state."""
        names = [c.name for c in self.table.all_columns]
        rows = {key: {c: row.get(c) for c in names} for key, row in state.items()}
        for key in self._current.keys() - rows.keys():
            self.versions[key][-1].ended = "delete"
        for key, row in rows.items():
            before = self._current.get(key)
            if before == row:
                continue
            if before is not None:
                self.versions[key][-1].ended = "change"
            self.versions.setdefault(key, []).append(RowVersion(row))
        self._current = rows


# --- the workload ---------------------------------------------------------------------

_NAMES = ("ada", "grace", "alan", "edsger", "barbara", "donald", "ken", "radia", "leslie")
_PRODUCTS = ("widget", "gadget", "gizmo", "sprocket", None)
_EPOCH = dt.datetime(2026, 3, 1, 9, 0, tzinfo=dt.UTC)


def literal(column: Column, value: Any) -> str:
    """``value`` as a SQL literal of ``column``'s type."""
    if value is None:
        return "NULL"
    if isinstance(value, SqlExpression):
        return value.sql
    if column.kind in ("int", "long", "decimal"):
        return str(value)
    if column.kind == "bool":
        return "TRUE" if value else "FALSE"
    if column.kind == "timestamp":
        return f"'{value.strftime('%Y-%m-%d %H:%M:%S.%f')[:-3]}'"
    if column.kind == "timestamptz":
        return f"'{value.strftime('%Y-%m-%d %H:%M:%S.%f')[:-3]}+00'"
    if column.kind == "date":
        return f"'{value.isoformat()}'"
    return "'" + str(value).replace("'", "''") + "'"


@dataclass(frozen=True)
class Step:
    """One transaction of the workload: what it does (for the demo's output) and its SQL.

    ``statements``: those of a transaction of several, in order (``sql`` runs them between
    ``BEGIN`` and ``COMMIT``); empty: ``sql`` is one statement.
    """

    phase: Literal["schema", "snapshot", "changes", "marker"]
    what: str
    sql: str
    statements: tuple[str, ...] = ()

    @classmethod
    def transaction(cls, what: str, statements: list[str]) -> Step:
        """A ``changes`` step running ``statements`` in one transaction."""
        sql = "BEGIN;\n" + "\n".join(statements) + "\nCOMMIT;"
        return cls("changes", what, sql, tuple(statements))

    @property
    def each_statement(self) -> tuple[str, ...]:
        """The step's statements, in order (without ``BEGIN`` and ``COMMIT``)."""
        return self.statements or (self.sql,)

    def display(self, rows: int = 2) -> str:
        """The SQL to print: a long ``VALUES`` list cut to its first ``rows`` rows."""
        lines = self.sql.splitlines()
        values = [i for i, line in enumerate(lines) if line.startswith("  (")]
        if len(values) <= rows + 1:
            return self.sql
        kept = [*lines[: values[rows]], f"  ... ({len(values) - rows} more rows)"]
        return "\n".join(kept + lines[values[-1] + 1 :])


@dataclass
class SqlWorkload:
    """A deterministic SQL workload over ``tables`` (same seed, same statements).

    ``customers`` (always) and ``orders`` rows are inserted before capture starts
    (Debezium's snapshot reads them), then ``changes`` transactions of 1-4 statements
    run: inserts, updates of every column, deletes, re-inserts of deleted keys; at fixed
    points ``TRUNCATE orders`` (``customers`` without ``orders``; new rows follow), a
    primary-key change, and ``ALTER TABLE customers ADD COLUMN tier`` (later writes fill
    it). The large ``notes`` are random text made by the server, so the tables' end state
    is whatever the database holds: compare outputs with :meth:`Database.rows`, not with
    this model.
    """

    seed: int = 7
    customers: int = 40
    orders: int = 60
    changes: int = 120
    run: str = ""  # goes into the marker row, so each run's marker differs
    tables: tuple[Table, ...] = TABLES
    _rng: random.Random = field(init=False, repr=False)
    _customer_ids: set[int] = field(init=False, repr=False, default_factory=set)
    _deleted: list[int] = field(init=False, repr=False, default_factory=list)
    _order_keys: set[tuple[int, int]] = field(init=False, repr=False, default_factory=set)
    _lines: dict[int, int] = field(init=False, repr=False, default_factory=dict)  # order: last
    _next_customer: int = field(init=False, default=1)
    _next_order: int = field(init=False, default=1)
    _altered: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def schema(self) -> list[Step]:
        """The tables (and the marker table), empty, and the large values' function."""
        tables = (*self.tables, MARKER)
        return [
            Step("schema", "create cdc_filler (large random text)", FILLER_FUNCTION),
            *[Step("schema", f"create {t.name}", t.create_sql() + ";") for t in tables],
        ]

    @property
    def _with_orders(self) -> bool:
        return ORDERS in self.tables

    def snapshot(self) -> list[Step]:
        """Rows that exist before capture starts (Debezium's initial snapshot reads them)."""
        customers = [self._new_customer() for _ in range(self.customers)]
        steps = [Step("snapshot", f"{len(customers)} customers", _insert(CUSTOMERS, customers))]
        if self._with_orders:
            orders = [self._new_order() for _ in range(self.orders)]
            steps.append(Step("snapshot", f"{len(orders)} order lines", _insert(ORDERS, orders)))
        return steps

    def changes_steps(self) -> Iterator[Step]:
        """The captured changes, one transaction a step.

        The truncate comes first, so the key change and the new column show in the end
        state (a truncate after them would hide whether they were applied).
        """
        fixed = {
            self.changes // 4: self._truncate,
            self.changes // 2: self._key_change,
            self.changes * 2 // 3: self._alter,
        }
        for number in range(self.changes):
            special = fixed.get(number)
            if special is self._key_change and not self._customer_ids:
                special = None  # nothing to move: an ordinary change instead
            if special is not None:
                yield special()
                continue
            statements = [self._random_change() for _ in range(self._rng.randint(1, 4))]
            what = "; ".join(s[0] for s in statements)
            yield Step.transaction(what, [s[1] for s in statements])

    def marker(self) -> Step:
        """The last transaction: one row in the marker table."""
        return Step(
            "marker",
            "the marker row",
            f"INSERT INTO {MARKER.name} (id, note) "
            f"VALUES (1, {literal(MARKER.columns[1], self.run)});",
        )

    # --- rows and statements

    def _timestamp(self) -> dt.datetime:
        millis = self._rng.randrange(0, 90 * 86_400_000)
        return _EPOCH + dt.timedelta(milliseconds=millis)

    def _money(self, high: int) -> Decimal:
        return Decimal(self._rng.randrange(-high * 100 // 10, high * 100)).scaleb(-2)

    def _customer_values(self, customer_id: int) -> dict[str, Any]:
        rng = self._rng
        first = rng.choice(_NAMES)
        name = f"{first} o'{rng.choice(_NAMES)}"  # a quote, to be escaped
        return {
            "id": customer_id,
            "name": name,
            "email": None if rng.random() < 0.2 else f"{first}{customer_id}@example.com",
            "vip": rng.random() < 0.3,
            "balance": None if rng.random() < 0.1 else self._money(100_000),
            "birth_date": None
            if rng.random() < 0.2
            else dt.date(1950, 1, 1) + dt.timedelta(days=rng.randrange(0, 20_000)),
            "created_at": self._timestamp().replace(tzinfo=None),
            "updated_at": None if rng.random() < 0.2 else self._timestamp(),
            "notes": self._notes(),
            **({"tier": rng.choice(("gold", "silver", None))} if self._altered else {}),
        }

    def _notes(self) -> str | SqlExpression | None:
        """Mostly large (TOASTed), sometimes short (stored inline) or null."""
        roll = self._rng.random()
        if roll < 0.1:
            return None
        if roll < 0.25:
            return f"short note {self._rng.randrange(1000)}"
        return SqlExpression(f"cdc_filler({LARGE_NOTES})")

    def _new_customer(self) -> dict[str, Any]:
        customer_id = self._next_customer
        self._next_customer += 1
        self._customer_ids.add(customer_id)
        return self._customer_values(customer_id)

    def _new_order(self) -> dict[str, Any]:
        rng = self._rng
        order_id = (
            self._next_order
            if rng.random() < 0.6 or self._next_order == 1
            else (rng.randrange(1, self._next_order))
        )
        if order_id == self._next_order:
            self._next_order += 1
        line_no = self._lines[order_id] = self._lines.get(order_id, 0) + 1
        self._order_keys.add((order_id, line_no))
        return {
            "order_id": 10_000_000_000 + order_id,  # beyond 32 bits: a real bigint
            "line_no": line_no,
            "customer_id": rng.randrange(1, max(2, self._next_customer)),
            "product": rng.choice(_PRODUCTS),
            "quantity": rng.randint(1, 9),
            "amount": abs(self._money(10_000)),
            "placed_at": None if rng.random() < 0.1 else self._timestamp().replace(tzinfo=None),
        }

    def _random_change(self) -> tuple[str, str]:
        rng = self._rng
        roll = rng.random()
        inserts = 0.2 if self._with_orders else 0.35
        if roll < inserts or not self._customer_ids:
            if self._deleted and rng.random() < 0.3:  # a deleted key comes back
                customer_id = self._deleted.pop(rng.randrange(len(self._deleted)))
                self._customer_ids.add(customer_id)
                row = self._customer_values(customer_id)
                return f"re-insert customer {customer_id}", _insert(CUSTOMERS, [row])
            row = self._new_customer()
            return f"insert customer {row['id']}", _insert(CUSTOMERS, [row])
        if roll < 0.3 and self._with_orders:
            row = self._new_order()
            return f"insert order {row['order_id']}/{row['line_no']}", _insert(ORDERS, [row])
        if roll < 0.65 or (roll < 0.85 and not self._with_orders):
            customer_id = rng.choice(sorted(self._customer_ids))
            values = self._customer_values(customer_id)
            changed = rng.sample(
                [c for c in CUSTOMERS.all_columns if c.name in values and c.name != "id"],
                rng.randint(1, 3),
            )
            sets = ", ".join(f"{c.name} = {literal(c, values[c.name])}" for c in changed)
            return (
                f"update customer {customer_id} ({', '.join(c.name for c in changed)})",
                f"UPDATE customers SET {sets} WHERE id = {customer_id};",
            )
        if roll < 0.8 and self._order_keys:
            order_id, line_no = rng.choice(sorted(self._order_keys))
            quantity = rng.randint(1, 9)
            return (
                f"update order {order_id}/{line_no}",
                f"UPDATE orders SET quantity = {quantity}, amount = amount + 1.25 "
                f"WHERE order_id = {10_000_000_000 + order_id} AND line_no = {line_no};",
            )
        if roll < 0.9 and self._order_keys:
            order_id, line_no = rng.choice(sorted(self._order_keys))
            self._order_keys.discard((order_id, line_no))
            return (
                f"delete order {order_id}/{line_no}",
                f"DELETE FROM orders WHERE order_id = {10_000_000_000 + order_id} "
                f"AND line_no = {line_no};",
            )
        customer_id = rng.choice(sorted(self._customer_ids))
        self._customer_ids.discard(customer_id)
        self._deleted.append(customer_id)
        return f"delete customer {customer_id}", f"DELETE FROM customers WHERE id = {customer_id};"

    def _key_change(self) -> Step:
        old = min(self._customer_ids)
        new = self._next_customer
        self._next_customer += 1
        self._customer_ids.discard(old)
        self._customer_ids.add(new)
        return Step(
            "changes",
            f"primary-key change: customer {old} becomes {new}",
            f"UPDATE customers SET id = {new}, name = name || ' (moved)' WHERE id = {old};",
        )

    def _alter(self) -> Step:
        self._altered = True
        added = ", ".join(f"ADD COLUMN {c.name} {c.sql_type}" for c in CUSTOMERS.added)
        return Step("changes", "schema change: a new column", f"ALTER TABLE customers {added};")

    def _truncate(self) -> Step:
        if self._with_orders:
            self._order_keys.clear()
            return Step("changes", "truncate orders", "TRUNCATE orders;")
        self._customer_ids.clear()  # keys may come back: as new rows, after the truncate
        return Step("changes", "truncate customers", "TRUNCATE customers;")


def _insert(table: Table, rows: list[dict[str, Any]]) -> str:
    columns = [c for c in table.all_columns if c.name in rows[0]]
    values = ",\n  ".join(
        "(" + ", ".join(literal(c, row[c.name]) for c in columns) + ")" for row in rows
    )
    return f"INSERT INTO {table.name} ({', '.join(c.name for c in columns)}) VALUES\n  {values};"
