"""Ingestion under load, with loss accounting: N clients for M seconds against gunicorn on PostgreSQL.

    .venv/bin/python bench/ingest_load.py [--clients 8] [--seconds 30] [--batch 50] [--workers 3]

Every client shares one API key and sends JSON arrays of trajectories (bench/ingest.py's synthetic shape)
on a connection of its own. A batch mixes new ids, replays of the client's earlier ids with new content,
ids that every client writes (so that two requests upsert one row at once), and bad records (an unknown
outcome, a negative latency, NaN, a lone surrogate, ...). Now and then a request is cut off on its own
socket: either "torn" (half the body is sent, then the socket closes) or "abandoned" (the whole body is
sent, then the socket closes before the answer is read). The server's per-key rate limit is off
(FLYWHEEL_API_RATE_PER_S=0): this measures ingestion, not the limiter.

Every write is entered in a ledger with its content's digest and the client's clock around it. Once the
server has stopped (gracefully: every request it took has finished), the ledger is checked against the
database. Per external_id, with "acknowledged" meaning the 200 answer was read and did not reject it:

- an acknowledged write A may be the stored content only if no acknowledged write of the same id started
  after A's answer was read (with one writer per id, that is the last acknowledged write); any
  unacknowledged (abandoned) write may be too, since the server may have run it before or after the others;
- an id with an acknowledged write must be stored (else it is lost), with one of those contents, whole (not
  a mix of two writes' fields);
- an id stored without any acknowledged write must hold one of its abandoned writes: the content of a torn
  request (its JSON array can never parse) or of a rejected record is never stored.

Loss counts the acknowledged ids that are missing or hold content the rules above do not allow. Prints
throughput (acknowledged records per second), request latency p50/p95/p99, the loss count and the status
counts the clients and the server's access log saw; the last line is JSON. Exits 1 if anything was lost,
stored that should not be, misreported, or answered with a 5xx.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import random
import socket
import struct
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest import bench_env, create_api_key, gunicorn, scratch_database, synthetic

PATH = "/api/v1/trajectories"
HOT_IDS = 8  # ids that every client writes
# Which of a client's first requests are cut off, and how: (mode, reset).
FIRST_CUTS = {1: ("torn", True), 2: ("abandoned", False), 3: ("torn", False), 4: ("abandoned", True)}
# The fields ingestion stores as sent, with what an absent one is stored as: what the digest covers.
STORED_FIELDS = {
    "agent": "",
    "model_version": "",
    "messages": None,
    "tools": [],
    "outcome": "unknown",
    "feedback": None,
    "human_intervention": None,
    "latency_ms": None,
    "usage": None,
    "metadata": {},
}


def _break_tool_message(r: dict) -> None:
    del r["messages"][3]["tool_call_id"]  # messages[3] is the first tool result


# A bad record is a valid one with one thing broken, and the field the rejection must name (a prefix).
BAD_KINDS: dict[str, tuple[str, Callable[[dict], None]]] = {
    "no-messages": ("messages", lambda r: r.pop("messages")),
    "outcome": ("outcome", lambda r: r.update(outcome="maybe")),
    "latency": ("latency_ms", lambda r: r.update(latency_ms=-5)),
    "unknown-field": ("color", lambda r: r.update(color="blue")),
    "tool-message": ("messages[3]", _break_tool_message),
    "nan": ("metadata", lambda r: r["metadata"].update(score=float("nan"))),
    "infinity": ("usage", lambda r: r["usage"].update(cost=float("inf"))),
    "surrogate": ("messages[1]", lambda r: r["messages"][1].update(content="half a pair: \ud800")),
}


def digest(record: dict[str, Any]) -> bytes:
    """The identity of what a write stores; equal for a record as sent and as read back from jsonb."""
    fields = {name: record.get(name, default) for name, default in STORED_FIELDS.items()}
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16).digest()


@dataclass(slots=True)
class Write:
    """One record of one request. state: acked, abandoned (no answer read), torn, rejected."""

    external_id: str
    version: str
    digest: bytes
    start: float
    end: float | None = None
    state: str = "sent"


@dataclass
class ClientLog:
    writes: list[Write] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # seconds, requests whose answer was read
    statuses: Counter = field(default_factory=Counter)
    disconnects: Counter = field(default_factory=Counter)  # torn or abandoned, with or without reset
    bad: Counter = field(default_factory=Counter)  # bad records sent, by kind
    replays: int = 0
    hot: int = 0
    problems: list[str] = field(default_factory=list)  # answers that misreport records, client errors


@dataclass
class Ledger:
    """Everything the clients did: the input of `audit`."""

    run: str
    seconds: float
    clients: list[ClientLog]

    def writes(self) -> list[Write]:
        return [w for c in self.clients for w in c.writes]


class Client(threading.Thread):
    def __init__(self, n: int, *, run: str, port: int, key: str, batch: int, deadline: float, seed: int,
                 replay_rate: float, bad_rate: float, hot_rate: float, disconnect_rate: float,
                 bad_kinds: list[str]) -> None:  # fmt: skip
        super().__init__(name=f"client-{n}")
        self.n, self.run_name, self.port, self.key, self.batch = n, run, port, key, batch
        self.deadline = deadline
        self.rng = random.Random(seed * 1000 + n)
        self.replay_rate, self.bad_rate, self.hot_rate = replay_rate, bad_rate, hot_rate
        self.disconnect_rate, self.bad_kinds = disconnect_rate, bad_kinds
        self.log = ClientLog()
        self.own: list[str] = []  # ids this client sent before: candidates for replays
        self.owned: set[str] = set()
        self.bad_sent = n  # clients start at different kinds
        self.seq = 0
        self.conn: http.client.HTTPConnection | None = None

    # --- what a batch holds ---

    def record(self, external_id: str) -> dict[str, Any]:
        self.seq += 1
        version = f"{self.n}.{self.seq}"
        rec = synthetic(self.rng.randrange(1_000_000), self.run_name)
        rec["external_id"] = external_id
        rec["messages"][1]["content"] += f" (version {version})"
        rec["metadata"]["load"] = {"version": version, "client": self.n}
        rec["outcome"] = self.rng.choice(("success", "failure", "unknown"))
        if self.rng.random() < 0.3:
            rec["feedback"] = {"rating": self.rng.randint(1, 5), "version": version}
        return rec

    def make_batch(self) -> tuple[list[dict], list[str | None]]:
        """(records, for each the bad kind or None). No id twice in one batch: within a batch the later
        record wins by design, which would make 'acknowledged' ambiguous."""
        records: list[dict] = []
        kinds: list[str | None] = []
        used: set[str] = set()
        for _ in range(self.batch):
            roll = self.rng.random()
            if roll < self.hot_rate:
                external_id = f"{self.run_name}-hot-{self.rng.randrange(HOT_IDS)}"
                self.log.hot += 1
            elif roll < self.hot_rate + self.replay_rate and self.own:
                external_id = self.rng.choice(self.own)
                self.log.replays += 1
            else:
                external_id = f"{self.run_name}-c{self.n}-{self.seq + 1}"
            if external_id in used:
                external_id = f"{self.run_name}-c{self.n}-{self.seq + 1}"
            rec = self.record(external_id)
            kind = None
            if self.rng.random() < self.bad_rate:
                kind = self.bad_kinds[self.bad_sent % len(self.bad_kinds)]  # each kind in turn
                self.bad_sent += 1
                if self.rng.random() < 0.5:  # half on a fresh id, which must then never be stored
                    rec["external_id"] = f"{self.run_name}-bad-c{self.n}-{self.seq}"
                BAD_KINDS[kind][1](rec)
                self.log.bad[kind] += 1
            used.add(rec["external_id"])
            records.append(rec)
            kinds.append(kind)
        return records, kinds

    # --- sending ---

    def run(self) -> None:
        try:
            self.send_until_deadline()
        except Exception as exc:  # a bug of the bench, not of the server: say so rather than die quietly
            self.log.problems.append(f"client {self.n} crashed: {exc!r}")
            raise

    def send_until_deadline(self) -> None:
        requests = 0
        while time.monotonic() < self.deadline:
            records, kinds = self.make_batch()
            # json.dumps writes NaN and Infinity as bare words and a lone surrogate as \ud800: what a
            # careless client sends.
            body = json.dumps(records).encode()
            writes = [
                Write(r["external_id"], r["metadata"].get("load", {}).get("version", ""), digest(r), 0.0)
                for r in records
            ]
            self.log.writes.extend(writes)
            # The first requests cut off for sure, so that even a short run has both kinds.
            if requests in FIRST_CUTS:  # so that even a short run has every kind of cut
                self.drop(body, writes, *FIRST_CUTS[requests])
            elif self.rng.random() < self.disconnect_rate:
                self.drop(body, writes, self.rng.choice(("torn", "abandoned")), self.rng.random() < 0.5)
            else:
                self.send(body, records, kinds, writes)
            for w in writes:
                if (
                    w.external_id.startswith(f"{self.run_name}-c{self.n}-")
                    and w.external_id not in self.owned
                ):
                    self.owned.add(w.external_id)
                    self.own.append(w.external_id)
            requests += 1
        if self.conn is not None:
            self.conn.close()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}

    def send(self, body: bytes, records: list[dict], kinds: list[str | None], writes: list[Write]) -> None:
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        start = time.monotonic()
        for w in writes:
            w.start = start
        try:
            self.conn.request("POST", PATH, body=body, headers=self.headers())
            response = self.conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:
            # The answer was not read: as good as abandoned. A healthy server never causes this.
            self.log.problems.append(f"request failed: {exc!r}")
            self.log.statuses["no answer"] += 1
            for w in writes:
                w.state = "abandoned"
            self.conn.close()
            self.conn = None
            return
        end = time.monotonic()
        self.log.latencies.append(end - start)
        self.log.statuses[response.status] += 1
        if response.status not in (200, 422):
            self.log.problems.append(f"{response.status}: {payload[:300]!r}")
            for w in writes:  # unknown fate: a 5xx may or may not have committed
                w.state = "abandoned"
            return
        answer = json.loads(payload)
        rejected = {item["index"]: item for item in answer["rejected"]}
        for index, (w, kind) in enumerate(zip(writes, kinds, strict=True)):
            if index in rejected:
                w.state = "rejected"
                fields = [e["field"] for e in rejected[index]["errors"]]
                if kind is None:
                    self.log.problems.append(f"valid record {w.external_id} rejected: {rejected[index]}")
                elif not any(f.startswith(BAD_KINDS[kind][0]) for f in fields):
                    self.log.problems.append(
                        f"{kind} record rejected naming {fields}, not {BAD_KINDS[kind][0]}"
                    )
                elif rejected[index]["external_id"] != records[index].get("external_id"):
                    self.log.problems.append(
                        f"rejection of {w.external_id} names {rejected[index]['external_id']}"
                    )
            else:
                w.state, w.end = "acked", end
                if kind is not None:
                    self.log.problems.append(f"{kind} record {w.external_id} accepted")
        valid = sum(1 for k in kinds if k is None)
        if answer["accepted"] != len(writes) - len(rejected) or len(rejected) != len(writes) - valid:
            self.log.problems.append(f"answer counts {answer['accepted']} accepted of {valid} valid")

    def drop(self, body: bytes, writes: list[Write], mode: str, reset: bool) -> None:
        """Send on a socket of its own and close it: after half the body (torn) or after all of it, before
        reading the answer (abandoned). With `reset` the close resets the connection (SO_LINGER 0) rather
        than ending it: a crashed client, not a polite one."""
        start = time.monotonic()
        for w in writes:
            w.start, w.state = start, mode
        head = (
            f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nAuthorization: Bearer {self.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.log.disconnects[mode + (" with reset" if reset else "")] += 1
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
                sock.sendall(head + (body[: len(body) // 2] if mode == "torn" else body))
                if mode == "abandoned" and self.rng.random() < 0.5:
                    time.sleep(self.rng.random() * 0.05)  # sometimes while the server is at work
                if reset:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError as exc:
            self.log.problems.append(f"{mode} request could not be sent: {exc!r}")


def run_load(*, port: int, key: str, clients: int, seconds: float, batch: int, seed: int = 0,
             replay_rate: float = 0.3, bad_rate: float = 0.05, hot_rate: float = 0.02,
             disconnect_rate: float = 0.05, bad_kinds: list[str] | None = None) -> Ledger:  # fmt: skip
    """`clients` threads sending batches for `seconds`; the ledger of every write they made."""
    run = f"load-{uuid.uuid4().hex[:6]}"
    deadline = time.monotonic() + seconds
    threads = [
        Client(n, run=run, port=port, key=key, batch=batch, deadline=deadline, seed=seed,
               replay_rate=replay_rate, bad_rate=bad_rate, hot_rate=hot_rate,
               disconnect_rate=disconnect_rate, bad_kinds=bad_kinds or list(BAD_KINDS))
        for n in range(clients)
    ]  # fmt: skip
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Ledger(run=run, seconds=time.monotonic() - start, clients=[t.log for t in threads])


def stored_rows(database_url: str, project_slug: str) -> dict[str, tuple[str, bytes]]:
    """external_id -> (version, digest) of every trajectory of the project, read with SQL."""
    import psycopg

    columns = ", ".join(f"t.{name}" for name in STORED_FIELDS)
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            f"SELECT t.external_id, {columns} FROM trajectories_trajectory t "
            "JOIN accounts_project p ON p.id = t.project_id WHERE p.slug = %s",
            [project_slug],
        ).fetchall()
    out = {}
    for external_id, *values in rows:
        record = dict(zip(STORED_FIELDS, values, strict=True))
        version = ((record["metadata"] or {}).get("load") or {}).get("version", "")
        out[external_id] = (version, digest(record))
    return out


def audit(
    ledger: Ledger, *, database_url: str, project_slug: str, access_log: Path | None = None
) -> dict[str, Any]:
    """Check the database against the ledger (the rules are in the module's docstring) and read the
    server's access log (see `access_log_options`); the figures, with `ok` when all is well."""
    by_id: dict[str, list[Write]] = {}
    for w in ledger.writes():
        by_id.setdefault(w.external_id, []).append(w)
    stored = stored_rows(database_url, project_slug)
    lost: list[str] = []  # acknowledged ids missing or holding content not allowed
    phantom: list[str] = []  # stored without a write that may be there (torn, rejected, never sent)
    corrupt: list[str] = []  # a version's tag with content other than that version's
    final_abandoned = stale_abandoned = 0
    for external_id, writes in by_id.items():
        acked = [w for w in writes if w.state == "acked"]
        allowed = {w.version: w for w in writes if w.state == "abandoned"}
        latest_start = max((w.start for w in acked), default=0.0)
        for w in acked:
            if not latest_start > w.end:  # no acknowledged write began after this one's answer
                allowed[w.version] = w
        row = stored.get(external_id)
        if row is None:
            if acked:
                lost.append(f"{external_id}: missing")
            continue
        version, found = row
        write = allowed.get(version)
        if write is None:
            states = {w.version: w.state for w in writes}
            (lost if acked else phantom).append(
                f"{external_id}: holds {version!r} ({states.get(version, 'never sent')})"
            )
        elif write.digest != found:
            corrupt.append(f"{external_id}: {version!r} stored with other content than was sent")
        elif write.state == "abandoned":
            final_abandoned += 1
            if acked and write.start < min(w.start for w in acked if w.version in allowed):
                stale_abandoned += 1  # abandoned before the last acknowledged write, and ran after it
    phantom += [f"{external_id}: never sent" for external_id in stored.keys() - by_id.keys()]

    statuses: Counter = Counter()
    disconnects: Counter = Counter()
    bad: Counter = Counter()
    latencies: list[float] = []
    problems: list[str] = []
    replays = hot = 0
    for c in ledger.clients:
        statuses.update(c.statuses)
        disconnects.update(c.disconnects)
        bad.update(c.bad)
        latencies += c.latencies
        problems += c.problems
        replays += c.replays
        hot += c.hot
    latencies.sort()

    def pct(p: float) -> float | None:
        if not latencies:
            return None
        return round(latencies[min(len(latencies) - 1, int(len(latencies) * p))] * 1000, 1)

    writes = ledger.writes()
    acked_records = sum(1 for w in writes if w.state == "acked")
    figures = {
        "clients": len(ledger.clients),
        "seconds": round(ledger.seconds, 2),
        "requests": sum(statuses.values()) + sum(disconnects.values()),
        "records_sent": len(writes),
        "acked_records": acked_records,
        "throughput_per_s": round(acked_records / ledger.seconds, 1),
        "p50_ms": pct(0.50),
        "p95_ms": pct(0.95),
        "p99_ms": pct(0.99),
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "client_5xx": sum(v for k, v in statuses.items() if isinstance(k, int) and k >= 500),
        "disconnects": dict(disconnects),
        "bad_records": dict(bad),
        "replays": replays,
        "hot_writes": hot,
        "ids": len(by_id),
        "acked_ids": sum(1 for ws in by_id.values() if any(w.state == "acked" for w in ws)),
        "stored": len(stored),
        "final_abandoned": final_abandoned,
        "stale_abandoned": stale_abandoned,
        "loss": len(lost),
        "phantom": len(phantom),
        "corrupt": len(corrupt),
        "problems": len(problems),
        "examples": list(dict.fromkeys(lost + phantom + corrupt + problems))[:10],
    }
    # Every request the server took, also those whose answer no client read (torn, abandoned).
    server = server_statuses(access_log) if access_log else Counter()
    figures["server_statuses"] = dict(sorted(server.items()))
    figures["server_5xx"] = sum(v for k, v in server.items() if k.startswith("5"))
    figures["ok"] = not any(
        figures[name] for name in ("loss", "phantom", "corrupt", "problems", "client_5xx", "server_5xx")
    )
    return figures


def access_log_options(path: Path) -> list[str]:
    """gunicorn options that log each request's status, method and path to `path`, for `audit`."""
    return ["--access-logfile", str(path), "--access-logformat", "%(s)s %(m)s %(U)s"]


def server_statuses(access_log: Path) -> Counter:
    """Status counts of the POSTs in gunicorn's access log (format '%(s)s %(m)s %(U)s'): the fate of
    requests whose answer no client read."""
    counts: Counter = Counter()
    for line in access_log.read_text().splitlines():
        status, method, path = (line.split() + ["", "", ""])[:3]
        if method == "POST" and path == PATH:
            counts[status] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (threads), one API key")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the clients send")
    parser.add_argument("--batch", type=int, default=50, help="records per request")
    parser.add_argument("--workers", type=int, default=3, help="gunicorn workers")
    parser.add_argument("--replay-rate", type=float, default=0.3, help="share of records replaying an id")
    parser.add_argument("--bad-rate", type=float, default=0.05, help="share of records that are bad")
    parser.add_argument("--disconnect-rate", type=float, default=0.05, help="share of requests cut off")
    parser.add_argument(
        "--bad-kinds",
        default=",".join(BAD_KINDS),
        help=f"which bad records to send, of {','.join(BAD_KINDS)}",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"),
        help="a PostgreSQL server to make a scratch database on (dropped at the end)",
    )
    args = parser.parse_args()

    with scratch_database(args.database_url) as db_url, tempfile.TemporaryDirectory() as tmp:
        access_log = Path(tmp) / "access.log"
        env = bench_env(db_url)  # with FLYWHEEL_API_RATE_PER_S=0: one key, many clients, no limit
        key = create_api_key(env, slug="load")
        with gunicorn(env, args.workers, *access_log_options(access_log)) as (_, port):
            ledger = run_load(
                port=port, key=key, clients=args.clients, seconds=args.seconds, batch=args.batch,
                seed=args.seed, replay_rate=args.replay_rate, bad_rate=args.bad_rate,
                disconnect_rate=args.disconnect_rate, bad_kinds=args.bad_kinds.split(","),
            )  # fmt: skip
        # The server has stopped gracefully: every request it took, abandoned ones included, is done.
        figures = audit(ledger, database_url=db_url, project_slug="load", access_log=access_log)
    figures["workers"] = args.workers
    figures["batch"] = args.batch

    f = figures
    print(
        f"{f['clients']} clients x {f['seconds']} s, batch {f['batch']}, {f['workers']} gunicorn workers, one API key"
    )
    print(
        f"requests {f['requests']} (answered: {f['statuses']}; cut off: {f['disconnects']}); "
        f"server saw {f['server_statuses']}"
    )
    print(
        f"records sent {f['records_sent']}: {f['replays']} replays, {f['hot_writes']} on shared ids, "
        f"bad {sum(f['bad_records'].values())} {f['bad_records']}"
    )
    print(
        f"throughput {f['throughput_per_s']} acknowledged records/s; latency p50 {f['p50_ms']} ms, "
        f"p95 {f['p95_ms']} ms, p99 {f['p99_ms']} ms"
    )
    print(
        f"ids {f['ids']} ({f['acked_ids']} acknowledged), stored {f['stored']}, of which {f['final_abandoned']} "
        f"hold an abandoned write ({f['stale_abandoned']} one older than the last acknowledged)"
    )
    print(
        f"loss {f['loss']}, phantom {f['phantom']}, corrupt {f['corrupt']}, misreported {f['problems']}, "
        f"5xx {f['server_5xx']}"
    )
    for example in f["examples"]:
        print("  " + example)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(json.dumps(figures))
    sys.exit(0 if figures["ok"] else 1)


if __name__ == "__main__":
    main()
