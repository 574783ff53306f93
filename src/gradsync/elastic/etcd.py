"""An etcd cluster as the elastic job's store, so no one host's death ends the job.

``GRADSYNC_COORDINATOR=etcd://h1:2379,h2:2379,h3:2379[/prefix]`` (and ``gradsync coordinator --coordinator``
the same). torch's ``Store`` interface over etcd v3's JSON gateway (``/v3/kv/...``; no client library):
each call is one linearizable request to one member, and a member that does not answer (dead, or between
leaders) is left for the next until the call's timeout. ``add`` is applied exactly once even when a
request's answer is lost (each call also writes a short-lived marker holding its result); ``compare_set``
is one transaction; ``wait`` polls. Every key lives under ``prefix`` (default ``gradsync``): one prefix per job.
"""
from __future__ import annotations

import base64
import http.client
import json
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

REQUEST_S = 2.0  # one request to one member; electing a new leader takes about a second
POLL_S = 0.01
MARKER_TTL_S = 60  # an add's marker outlives any retry of its request


class _Unanswered(Exception):
    """A request was sent and no answer came: it may have been applied."""


def parse(address: str) -> tuple[list[str], str]:
    """``etcd://h1:2379,h2:2379/prefix`` -> (["h1:2379", "h2:2379"], "prefix")."""
    rest = address[len("etcd://"):]
    hosts, _, prefix = rest.partition("/")
    endpoints = [h for h in hosts.split(",") if h]
    if not endpoints or any(":" not in h for h in endpoints):
        raise ValueError(f"gradsync: an etcd coordinator is etcd://HOST:PORT[,HOST:PORT...][/PREFIX], got {address!r}")
    return endpoints, prefix.strip("/") or "gradsync"


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else bytes(data)).decode()


class EtcdStore(dist.Store):
    """torch's ``Store`` on an etcd cluster (``endpoints``: ``host:port`` of its members' client URLs)."""

    def __init__(self, endpoints: list[str], prefix: str = "gradsync", timeout: timedelta = timedelta(seconds=300)):
        super().__init__()
        self.endpoints, self.prefix, self.call_timeout = list(endpoints), prefix, timeout
        self._member = 0  # the member tried first: the last one that answered
        self._local = threading.local()  # one connection per thread and member (gloo calls from its threads)
        self._lease: tuple[str, float] | None = None

    # ------------------------------------------------------------------ the wire
    def _post(self, path: str, body: dict, idempotent: bool = True) -> dict:
        deadline = time.monotonic() + self.call_timeout.total_seconds()
        failures = []
        while True:
            member = self._member
            host, _, port = self.endpoints[member].rpartition(":")
            conns = self._local.__dict__.setdefault("conns", {})
            conn = conns.get(member) or http.client.HTTPConnection(host, int(port), timeout=REQUEST_S)
            conns[member] = conn
            sent = False
            try:
                conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
                sent = True
                response = conn.getresponse()
                data = json.loads(response.read() or b"{}")
                if response.status == 200:
                    return data
                failures.append(f"{self.endpoints[member]}: HTTP {response.status} {data.get('message', '')}")
            except (OSError, http.client.HTTPException, ValueError) as exc:
                conn.close()
                conns.pop(member, None)
                failures.append(f"{self.endpoints[member]}: {exc!r}")
                if sent and not idempotent:
                    raise _Unanswered(failures[-1]) from exc
            self._member = (member + 1) % len(self.endpoints)
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"gradsync: no etcd member answered {path} within "
                                          f"{self.call_timeout.total_seconds():g}s: {'; '.join(failures[-3:])}")
            if self._member == 0:
                time.sleep(0.05)  # every member refused: an election, or the cluster restarting

    def _key(self, key: str) -> str:
        return _b64(f"{self.prefix}/{key}")

    def _range(self, key: str) -> dict | None:
        kvs = self._post("/v3/kv/range", {"key": self._key(key)}).get("kvs")
        return kvs[0] if kvs else None

    def _txn(self, compare: list, success: list, failure: list) -> dict:
        return self._post("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure}, idempotent=False)

    def _put(self, key: str, value: str | bytes, lease: str | None = None) -> dict:
        put = {"key": self._key(key), "value": _b64(value)}
        return {"request_put": {**put, "lease": lease}} if lease else {"request_put": put}

    def _marker_lease(self) -> str:
        if self._lease is None or time.monotonic() > self._lease[1]:
            granted = self._post("/v3/lease/grant", {"TTL": MARKER_TTL_S})
            self._lease = (granted["ID"], time.monotonic() + MARKER_TTL_S / 2)
        return self._lease[0]

    # ------------------------------------------------------------------ torch's Store
    def set(self, key: str, value: Any) -> None:
        self._post("/v3/kv/put", {"key": self._key(key), "value": _b64(value)})

    def get(self, key: str) -> bytes:
        self.wait([key])
        return base64.b64decode(self._range(key).get("value", ""))

    def check(self, keys: list[str]) -> bool:
        return all(self._range(k) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self.call_timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"gradsync: etcd keys {keys} did not appear within {limit:g}s")
            time.sleep(POLL_S)

    def add(self, key: str, amount: int) -> int:
        marker = f"{key}/.add/{uuid.uuid4().hex}"
        while True:
            kv = self._range(key)
            current = int(base64.b64decode(kv["value"])) if kv and kv.get("value") else 0
            if amount == 0:
                return current
            new = str(current + amount)
            same = ({"key": self._key(key), "target": "MOD", "mod_revision": kv["mod_revision"]} if kv else
                    {"key": self._key(key), "target": "CREATE", "create_revision": "0"})
            try:
                if self._txn([same], [self._put(key, new), self._put(marker, new, self._marker_lease())], [])\
                        .get("succeeded"):
                    return int(new)
            except _Unanswered:
                applied = self._range(marker)
                if applied is not None:
                    return int(base64.b64decode(applied["value"]))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        expected_b = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired_b = desired.encode() if isinstance(desired, str) else bytes(desired)
        same = ({"key": self._key(key), "target": "VALUE", "value": _b64(expected_b)} if expected_b else
                {"key": self._key(key), "target": "CREATE", "create_revision": "0"})
        try:
            answer = self._txn([same], [self._put(key, desired_b)], [{"request_range": {"key": self._key(key)}}])
        except _Unanswered:
            answer = {"succeeded": False, "responses": []}
        if answer.get("succeeded"):
            return desired_b
        kv = self._range(key)
        return base64.b64decode(kv.get("value", "")) if kv is not None else expected_b

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def delete_key(self, key: str) -> bool:
        return int(self._post("/v3/kv/deleterange", {"key": self._key(key)}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        end = _b64(f"{self.prefix}0")  # every key under "prefix/" sorts below "prefix0"
        return int(self._post("/v3/kv/range", {"key": self._key(""), "range_end": end, "count_only": True})
                   .get("count", 0))


__all__ = ["EtcdStore", "parse"]
