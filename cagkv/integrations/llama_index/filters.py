"""LlamaIndex metadata filters, answered from the catalog's document rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llama_index.core.vector_stores.types import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
)

if TYPE_CHECKING:
    from cagkv.stores import CacheStore


def matching_document_ids(store: "CacheStore", filters: MetadataFilters | None) -> list[int] | None:
    """Ids of the store's documents whose metadata satisfy `filters` (None: no filter).

    Filters see a document's metadata plus `source` and `document_id`. Every
    `FilterOperator` is supported; conditions AND, OR and NOT nest.
    """
    if filters is None or not filters.filters:
        return None
    return [doc.id for doc in store.list_documents() if _match_all(_document_fields(doc), filters)]


def _document_fields(doc: Any) -> dict[str, Any]:
    fields = dict(doc.metadata or {})
    fields.setdefault("source", doc.source)
    fields.setdefault("document_id", doc.id)
    return fields


def _match_all(meta: dict[str, Any], filters: MetadataFilters) -> bool:
    """LlamaIndex's own semantics (`vector_stores.utils.build_metadata_filter_fn`), nested."""
    results = [
        _match_all(meta, f) if isinstance(f, MetadataFilters) else _match_one(meta, f)
        for f in filters.filters
    ]
    match filters.condition or FilterCondition.AND:
        case FilterCondition.AND:
            return all(results)
        case FilterCondition.OR:
            return any(results)
        case FilterCondition.NOT:  # none of the filters matches
            return not any(results)
    raise NotImplementedError(f"expected filter condition and/or/not, got {filters.condition!r}")


def _match_one(meta: dict[str, Any], f: MetadataFilter) -> bool:
    op, want, got = f.operator, f.value, meta.get(f.key)
    if op == FilterOperator.IS_EMPTY:
        return got is None or got == [] or got == ""
    if got is None:
        return op in (FilterOperator.NE, FilterOperator.NIN)
    try:
        match op:
            case FilterOperator.EQ:
                return bool(got == want)
            case FilterOperator.NE:
                return bool(got != want)
            case FilterOperator.GT:
                return bool(got > want)
            case FilterOperator.LT:
                return bool(got < want)
            case FilterOperator.GTE:
                return bool(got >= want)
            case FilterOperator.LTE:
                return bool(got <= want)
            case FilterOperator.IN:
                return got in want
            case FilterOperator.NIN:
                return got not in want
            case FilterOperator.CONTAINS:
                return want in got
            case FilterOperator.ANY:
                return any(v in got for v in want)
            case FilterOperator.ALL:
                return all(v in got for v in want)
            case FilterOperator.TEXT_MATCH:
                return isinstance(got, str) and isinstance(want, str) and want in got
            case FilterOperator.TEXT_MATCH_INSENSITIVE:
                return isinstance(got, str) and isinstance(want, str) and want.lower() in got.lower()
    except TypeError:  # e.g. "a" > 3 or 3 in 5: a mismatched type never matches
        return False
    raise NotImplementedError(f"filter operator {op!r} is not supported by cagkv")
