"""The response cache: answers to repeated and near-repeated requests, served without the model.

    keys.py            what a request is cached under (exact key, semantic namespace)
    guard.py           the second check on a semantic candidate: same meaning, not just similar words
    response_cache.py  exact lookup, then semantic, then store; the figures
    store.py           the ResponseStore interface; sqlite_store.py and redis_store.py implement it
    vectors.py         the vector index (sqlite-vec), partitioned by namespace
"""
