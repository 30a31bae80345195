"""The store suite of test_stores.py again, with the catalog on a real PostgreSQL server.

Needs `CAGKV_TEST_PG_URL` (`source scripts/pg.sh && pg_start`); skipped with that reason
when unset, failed when unset in CI (`CI=true`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "reliability"))

from storekit import pg_admin_url, pg_database  # noqa: E402
from test_stores import (  # noqa: E402,F401  (collected again here, on PostgreSQL)
    open_store,
    test_add_search_load_round_trip,
    test_bad_chunks_refused_and_store_unchanged,
    test_block_of_another_model_refused,
    test_chunking_is_part_of_the_unchanged_key,
    test_doctor_checksum_edited_row,
    test_doctor_finds_and_repairs,
    test_doctor_stale_index_rebuilt,
    test_idempotent_ingest_and_replace,
    test_ids_as_strings_accepted,
    test_kv_layout_fixed_by_first_block,
    test_load_blocks_of_removed_chunk_raises_changed,
    test_long_source_is_fine,
    test_path_traversal_blob_key_in_row,
    test_remove_removes_rows_blobs_vectors,
    test_search_by_embedding_and_retrieve,
    test_schema_v1_store_is_read_as_is_and_upgraded_by_the_next_write,
    test_search_restricted_to_documents,
    test_shared_blob_kept_until_last_reference,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def store(tmp_path: Path):
    with pg_database(pg_admin_url()) as url:
        s = open_store(tmp_path / "store", db_url=url)
        yield s
        s.close()


def test_other_canonical_refused_on_postgres(tmp_path: Path):
    with pg_database(pg_admin_url()) as url:
        open_store(tmp_path / "a", db_url=url).close()
        from cagkv.errors import StoreError

        with pytest.raises(StoreError, match="canonical model"):
            open_store(tmp_path / "b", db_url=url, canonical="other")


def test_unreachable_postgres(tmp_path: Path):
    from cagkv.errors import StoreError

    with pytest.raises(StoreError, match="cannot open catalog"):
        open_store(tmp_path / "s", db_url="postgresql+psycopg://u:pw@127.0.0.1:1/none")
