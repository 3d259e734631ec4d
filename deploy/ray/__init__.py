"""`python -m deploy.ray up | status | scale | down`: the cluster on a Ray cluster (docs/deployment.md).

The gateway runs in an actor pinned to the node `up` runs on; each worker runs in an actor that Ray
places (a SPREAD placement group) and restarts (`max_restarts`). Each actor runs the very process
`honcho start` runs (`python -m gateway`, `python -m worker`), which joins over tcp:// with CURVE
keys. Ray is an optional dependency (`pip install -e .[ray]`); nothing here is imported by the
gateway or the worker.
"""
