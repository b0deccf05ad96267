"""brisk on Ray Serve: N engine replicas behind one OpenAI-compatible ingress (`brisk serve --replicas N`).

    app.py       the application: the ingress deployment (the single server's app) and the engine deployment
    client.py    RayEngineClient: the EngineClient the ingress's app runs on, reaching the replicas
    replica.py   EngineReplica: one engine with its own KV cache, as a Ray Serve replica
    router.py    PrefixAffinityRouter: Ray Serve's request router, placing requests by prompt prefix
    affinity.py  PrefixAffinity: the placement policy itself, plain Python

Ray is an optional extra (`pip install brisk[ray]`); nothing else in brisk imports this package.
"""
