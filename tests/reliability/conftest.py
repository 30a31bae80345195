"""Fixtures of the reliability suite: a fresh PostgreSQL database per test when a server is set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from storekit import pg_admin_url, pg_database


@pytest.fixture
def pg_url() -> Iterator[str]:
    with pg_database(pg_admin_url()) as url:
        yield url
